"""PaddlePaddle adapter (imported only through `get_adapter("paddle")`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle

from hybridfleet.ckpt.safetensors_io import BFLOAT16
from hybridfleet.frameworks.base import Adapter


def _kind(layer: Any) -> str | None:
    nn = paddle.nn
    if isinstance(layer, nn.Linear):
        return "linear"
    if isinstance(layer, (nn.Conv1D, nn.Conv2D, nn.Conv3D, nn.Conv1DTranspose, nn.Conv2DTranspose, nn.Conv3DTranspose)):
        return "conv"
    if isinstance(layer, nn.Embedding):
        return "embedding"
    if isinstance(layer, (nn.BatchNorm, nn.BatchNorm1D, nn.BatchNorm2D, nn.BatchNorm3D)):
        return "batchnorm"
    if isinstance(layer, nn.LayerNorm):
        return "layernorm"
    if isinstance(layer, nn.GroupNorm):
        return "groupnorm"
    return None


def _param_names(optimizer: Any) -> list[str]:
    params = optimizer._parameter_list or []
    if params and isinstance(params[0], dict):  # parameter groups
        params = [p for group in params for p in group["params"]]
    return [p.name for p in params]


def _by_position(key: str, names: list[str]) -> str:
    # Accumulator names embed the global parameter name (linear_3.w_0_moment1_0), which
    # depends on how many layers the process built before; positions do not.
    matches = [i for i, n in enumerate(names) if key.startswith(n + "_")]
    if not matches:
        return key
    index = max(matches, key=lambda i: len(names[i]))
    return f"param{index}{key[len(names[index]):]}"


def _by_name(key: str, names: list[str]) -> str:
    head, sep, rest = key.partition("_")
    if head.startswith("param") and head[5:].isdigit() and sep:
        index = int(head[5:])
        if index >= len(names):
            raise ValueError(f"optimizer state {key!r} refers to parameter {index}, but the optimizer has {len(names)}")
        return f"{names[index]}_{rest}"
    return key


def _numpy_dtype(tensor: Any) -> np.dtype:
    name = str(tensor.dtype).split(".")[-1]
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def _numpy(tensor: Any) -> np.ndarray:
    """A copy of ``tensor`` as numpy; bfloat16 (paddle gives its bits as uint16) as ml_dtypes.bfloat16."""
    arr = np.array(tensor.numpy(), copy=True, order="C")
    return arr.view(BFLOAT16) if str(tensor.dtype).endswith("bfloat16") else arr


def _paddle_value(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``arr`` cast to ``dtype`` in the form paddle loads: bfloat16 as its uint16 bits."""
    arr = np.asarray(arr).astype(dtype, copy=False)
    return np.ascontiguousarray(arr).view(np.uint16) if dtype == BFLOAT16 else arr


class PaddleAdapter(Adapter):
    name = "paddle"

    @property
    def version(self) -> str:
        return paddle.__version__

    def owns(self, obj: Any) -> bool:
        return isinstance(obj, (paddle.nn.Layer, paddle.optimizer.Optimizer, paddle.Tensor))

    def from_numpy(self, arr: np.ndarray) -> Any:
        arr = np.asarray(arr)
        if arr.dtype == BFLOAT16:  # paddle reads uint16 arrays as bfloat16 bits
            return paddle.to_tensor(np.ascontiguousarray(arr).view(np.uint16))
        if arr.flags.writeable and arr.flags.c_contiguous and arr.ndim > 0:
            try:
                return paddle.from_dlpack(arr)  # zero-copy
            except (BufferError, TypeError, RuntimeError, ValueError):
                pass
        return paddle.to_tensor(arr)

    def to_numpy(self, tensor: Any) -> np.ndarray:
        arr = super().to_numpy(tensor)
        return arr.view(BFLOAT16) if str(tensor.dtype).endswith("bfloat16") else arr

    def model_state(self, model: Any) -> dict[str, np.ndarray]:
        return {k: _numpy(v) for k, v in model.state_dict().items()}

    def _expected_state(self, model: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        return {k: (tuple(v.shape), str(v.dtype).split(".")[-1]) for k, v in model.state_dict().items()}

    def _assign_state(self, model: Any, state: dict[str, np.ndarray]) -> None:
        current = model.state_dict()
        model.set_state_dict({k: _paddle_value(v, _numpy_dtype(current[k])) for k, v in state.items()})

    def optimizer_state(self, optimizer: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        tensors: dict[str, np.ndarray] = {}
        meta: dict[str, Any] = {}
        names = _param_names(optimizer)
        for key, value in optimizer.state_dict().items():
            if isinstance(value, paddle.Tensor):
                tensors[_by_position(key, names)] = _numpy(value)
            elif key == "master_weights":
                for name, tensor in value.items():
                    tensors[f"master_weights/{name}"] = _numpy(tensor)
            else:
                meta[key] = value
        return tensors, meta

    def load_optimizer_state(self, optimizer: Any, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        full: dict[str, Any] = dict(meta)
        names = _param_names(optimizer)
        for key, arr in tensors.items():
            tensor = self.from_numpy(np.array(arr, copy=True))
            if key.startswith("master_weights/"):
                full.setdefault("master_weights", {})[key.split("/", 1)[1]] = tensor
            else:
                full[_by_name(key, names)] = tensor
        optimizer.set_state_dict(full)

    def _framework_rng_state(self) -> Any:
        return [list(s.__getstate__()) for s in paddle.get_rng_state()]

    def _set_framework_rng_state(self, state: Any) -> None:
        kind = type(paddle.get_rng_state()[0])
        restored = []
        for entry in state:
            generator_state = kind.__new__(kind)
            generator_state.__setstate__(tuple(entry))
            restored.append(generator_state)
        paddle.set_rng_state(restored)

    def module_kinds(self, model: Any) -> dict[str, str]:
        kinds: dict[str, str] = {}
        names = set(model.state_dict())
        for prefix, layer in model.named_sublayers(include_self=True):
            kind = _kind(layer)
            if kind is None:
                continue
            for local in list(layer._parameters) + list(layer._buffers):
                full = f"{prefix}.{local}" if prefix else local
                if full in names:
                    kinds[full] = kind
        return kinds
