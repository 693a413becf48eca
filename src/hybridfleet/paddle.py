"""PaddlePaddle adapter for parameter-server training: ``hf.connect(model)`` then ``ps.step()``."""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
from paddle.nn.layer.norm import _BatchNormBase

from hybridfleet.ps.worker import sparse_grads
from hybridfleet.ps.worker.frontend import ParameterServerHandle
from hybridfleet.ps.worker.overlap import same_bits
from hybridfleet.ps.worker.session import WorkerConfig


class PaddleParameterServer(ParameterServerHandle):
    framework = "paddle"

    def _named_parameters(self) -> dict[str, Any]:
        # frozen ones too: they stay part of the job (unchanged while they have no gradient); BatchNorm's
        # running statistics are parameters to paddle but buffers to the job (they follow ps.buffers)
        statistics = set(self._buffers())
        return {n: p for n, p in self.model.named_parameters() if n not in statistics}

    def _sparse_gradient_parameters(self) -> dict[str, str]:
        out = {}
        for prefix, layer in self.model.named_sublayers(include_self=True):
            if isinstance(layer, paddle.nn.Embedding) and getattr(layer, "_sparse", False):
                out[f"{prefix}.weight" if prefix else "weight"] = "nn.Embedding(sparse=True)"
        return out

    def _buffers(self) -> dict[str, Any]:
        # BatchNorm's running statistics are non-trainable parameters in paddle; other buffers are buffers
        state = self.model.state_dict()
        out = {n: b for n, b in self.model.named_buffers() if n in state}
        for prefix, layer in self.model.named_sublayers(include_self=True):
            if isinstance(layer, _BatchNormBase):
                for attr in ("_mean", "_variance"):
                    out[f"{prefix}.{attr}" if prefix else attr] = getattr(layer, attr)
        return out

    def _buffer_values(self) -> dict[str, np.ndarray]:
        out = {}
        for name, t in self._buffers().items():
            arr = t.numpy()
            out[name] = arr.astype(np.float32) if arr.dtype.kind == "f" else arr.copy()
        return out

    def _assign_buffers(self, values: dict[str, np.ndarray]) -> None:
        tensors = self._buffers()
        for name, arr in values.items():
            t = tensors[name]
            t.set_value(np.array(arr, dtype=t.numpy().dtype, order="C"))

    def _trainable(self, param: Any) -> bool:
        return not param.stop_gradient

    def _on_accelerator(self, param: Any) -> bool:
        return not param.place.is_cpu_place()

    def _register_grad_hook(self, param: Any, submit: Any) -> None:
        # called after the gradient is accumulated into param.grad (paddle's sharding uses it alike)
        param._register_backward_hook(lambda *_: submit(param.grad))

    def _grad_token(self, tensor: Any) -> tuple:
        # paddle.grad hands out a new wrapper each time: the storage and its in-place version say which
        return (tensor.data_ptr(), tensor._inplace_version())

    def _same_values(self, array: np.ndarray, tensor: Any) -> bool:
        # clear_gradients() zeroes in place without bumping the version: compare the values (the copy
        # to host made here is the one ps.overlap: off makes too; the encoding is what overlaps)
        return same_bits(array, self._to_numpy(tensor))

    def _to_numpy(self, tensor: Any) -> np.ndarray:
        if tensor.is_selected_rows():  # the gradient of nn.Embedding(sparse=True), read as the dense one
            return sparse_grads.paddle_dense(tensor)
        return tensor.detach().cpu().astype("float32").numpy()

    def _assign(self, values: dict[str, np.ndarray]) -> None:
        # the shards keep float32 master weights; a float16 / bfloat16 parameter takes them cast to its dtype
        params = self._named_parameters()
        for name, arr in values.items():
            p, value = params[name], np.ascontiguousarray(arr, dtype=np.float32)
            p.set_value(value if p.dtype == paddle.float32 else paddle.to_tensor(value).astype(p.dtype))

    def zero_grad(self) -> None:
        for p in self._named_parameters().values():
            p.clear_gradient()


def connect(model: "paddle.nn.Layer", optimizer: Any = None, config: WorkerConfig | None = None) -> PaddleParameterServer:
    """Join the job this process was started for (``HFLEET_*`` variables) and load its parameters into ``model``.

    ``optimizer``: the script's optimizer; the shards apply it (class, groups, hyperparameters, each
    step's learning rates, grad_clip on this worker) unless the job sets ``ps.optimizer``; in
    ``ps.sync: local`` it is the inner optimizer (required there)."""
    return PaddleParameterServer(model, config, optimizer)
