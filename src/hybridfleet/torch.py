"""PyTorch adapter for parameter-server training: ``hf.connect(model)`` then ``ps.step()``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridfleet.ps.worker import sparse_grads
from hybridfleet.ps.worker.frontend import ParameterServerHandle
from hybridfleet.ps.worker.overlap import same_bits
from hybridfleet.ps.worker.session import WorkerConfig


class TorchParameterServer(ParameterServerHandle):
    framework = "torch"

    def _named_parameters(self) -> dict[str, Any]:
        # frozen ones too: they stay part of the job (unchanged while they have no gradient)
        return dict(self.model.named_parameters())

    def _sparse_gradient_parameters(self) -> dict[str, str]:
        out = {}
        for prefix, module in self.model.named_modules():
            if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
                out[f"{prefix}.weight" if prefix else "weight"] = f"nn.{type(module).__name__}(sparse=True)"
        return out

    def _buffer_values(self) -> dict[str, np.ndarray]:
        out = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.nn.Parameter):  # a parameter, trained or frozen, tied or not, is no buffer
                t = t.detach().cpu()
                out[name] = (t.float() if t.is_floating_point() else t).numpy().copy()
        return out

    def _assign_buffers(self, values: dict[str, np.ndarray]) -> None:
        state = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, arr in values.items():
                t = state[name]
                t.copy_(torch.from_numpy(np.array(arr, order="C")).to(t.device, t.dtype))  # 0-d stays 0-d

    def _trainable(self, param: Any) -> bool:
        return param.requires_grad

    def _on_accelerator(self, param: Any) -> bool:
        return param.device.type != "cpu"

    def _register_grad_hook(self, param: Any, submit: Any) -> None:
        param.register_post_accumulate_grad_hook(lambda p: submit(p.grad))

    def _grad_token(self, tensor: Any) -> tuple:
        # torch bumps a tensor's version on every in-place write (mul_, zero_, unscale_, +=)
        return (id(tensor), tensor._version)

    def _same_values(self, array: np.ndarray, tensor: Any) -> bool:
        # on the CPU the values are at hand for free: a write past the version counter (through
        # .data or a numpy view) is caught too; on an accelerator the version counter decides
        if tensor.device.type != "cpu":
            return True
        return same_bits(array, self._to_numpy(tensor))

    def _to_numpy(self, tensor: Any) -> np.ndarray:
        # a sparse gradient (nn.Embedding(sparse=True)) is read as the dense one it stands for
        return sparse_grads.torch_dense(tensor.detach()).to("cpu", torch.float32).numpy()

    def _assign(self, values: dict[str, np.ndarray]) -> None:
        # the shards keep float32 master weights; a float16 / bfloat16 parameter takes them cast to its dtype
        params = self._named_parameters()
        with torch.no_grad():
            for name, arr in values.items():
                p = params[name]
                p.copy_(torch.from_numpy(np.ascontiguousarray(arr)).to(p.device, p.dtype))

    def step(self) -> None:
        super().step()
        if self.optimizer is not None:
            # the shards stepped the script's optimizer: a scheduler stepped next must not warn that it was not
            self.optimizer._opt_called = True

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)


def connect(model: "torch.nn.Module", optimizer: Any = None, config: WorkerConfig | None = None) -> TorchParameterServer:
    """Join the job this process was started for (``HFLEET_*`` variables) and load its parameters into ``model``.

    ``optimizer``: the script's optimizer; the shards apply it (class, groups, hyperparameters, each
    step's learning rates) unless the job sets ``ps.optimizer``; in ``ps.sync: local`` it is the inner
    optimizer (required there)."""
    return TorchParameterServer(model, config, optimizer)
