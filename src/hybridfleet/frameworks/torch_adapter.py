"""PyTorch adapter (imported only through `get_adapter("torch")`)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

from hybridfleet.ckpt.safetensors_io import BFLOAT16
from hybridfleet.frameworks.base import Adapter
from hybridfleet.frameworks.optim_meta import from_json_group, to_json_group


def _kind(module: torch.nn.Module) -> str | None:
    nn = torch.nn
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return "conv"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "batchnorm"
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    if isinstance(module, nn.GroupNorm):
        return "groupnorm"
    return None


def _writable(arr: np.ndarray) -> np.ndarray:
    # torch.from_numpy warns on read-only buffers (e.g. bytes from a store).
    return arr if arr.flags.writeable and arr.flags.c_contiguous else np.array(arr, copy=True, order="C")


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU numpy view of ``tensor``; bfloat16 (which numpy lacks) as ml_dtypes.bfloat16, same bits."""
    t = tensor.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def _tensor(arr: np.ndarray) -> torch.Tensor:
    """A CPU tensor of ``arr`` (sharing memory where it can); ml_dtypes.bfloat16 becomes torch.bfloat16."""
    if arr.dtype == BFLOAT16:
        return torch.from_numpy(_writable(arr).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(_writable(arr))


class TorchAdapter(Adapter):
    name = "torch"

    @property
    def version(self) -> str:
        return torch.__version__

    def owns(self, obj: Any) -> bool:
        return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor))

    def from_numpy(self, arr: np.ndarray) -> Any:
        return _tensor(np.asarray(arr))

    def to_numpy(self, tensor: Any) -> np.ndarray:
        arr = _numpy(tensor)
        return arr if arr.flags.c_contiguous else np.array(arr, order="C")

    def model_state(self, model: Any) -> dict[str, np.ndarray]:
        return {k: np.array(_numpy(v), copy=True, order="C") for k, v in model.state_dict().items()}

    def model_views(self, model: Any) -> dict[str, np.ndarray]:
        return {k: self.to_numpy(v) for k, v in model.state_dict().items()}

    def _expected_state(self, model: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()}

    def _assign_state(self, model: Any, state: dict[str, np.ndarray]) -> None:
        model.load_state_dict({k: self.from_numpy(v) for k, v in state.items()}, strict=True)

    def optimizer_state(self, optimizer: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        full = optimizer.state_dict()
        tensors: dict[str, np.ndarray] = {}
        scalars: dict[str, Any] = {}
        for param_id, entries in full["state"].items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"state.{param_id}.{key}"] = np.array(_numpy(value), copy=True, order="C")
                else:
                    scalars[f"{param_id}.{key}"] = value
        meta = {"param_groups": [to_json_group(g) for g in full["param_groups"]], "scalars": scalars}
        return tensors, meta

    def load_optimizer_state(self, optimizer: Any, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        state: dict[int, dict[str, Any]] = {}
        for name, arr in tensors.items():
            _, param_id, key = name.split(".", 2)
            state.setdefault(int(param_id), {})[key] = _tensor(np.array(arr, copy=True, order="C"))
        for name, value in meta.get("scalars", {}).items():
            param_id, key = name.split(".", 1)
            state.setdefault(int(param_id), {})[key] = value
        groups = [from_json_group(g) for g in meta["param_groups"]]
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    def _framework_rng_state(self) -> Any:
        return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii")

    def _set_framework_rng_state(self, state: Any) -> None:
        raw = np.frombuffer(base64.b64decode(state), dtype=np.uint8).copy()
        torch.set_rng_state(torch.from_numpy(raw))

    def module_kinds(self, model: Any) -> dict[str, str]:
        kinds: dict[str, str] = {}
        names = set(model.state_dict())
        for prefix, module in model.named_modules():
            kind = _kind(module)
            if kind is None:
                continue
            for local in list(module._parameters) + list(module._buffers):
                full = f"{prefix}.{local}" if prefix else local
                if full in names:
                    kinds[full] = kind
        return kinds
