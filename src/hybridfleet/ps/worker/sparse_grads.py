"""Row-sparse gradients (embeddings built with ``sparse=True``) on the parameter server.

The worker reads a sparse gradient as the dense gradient it stands for (zeros on the rows
the batch did not touch, duplicate rows summed), so everything downstream (codecs, error
feedback, site and secure aggregation, the shards' optimizer) sees a dense gradient. That is
exact only where the script's optimizer, run alone, applies to a sparse gradient the very
update it applies to the dense one; `refusal` says, at connect, where it does not:

- torch ``SGD`` (momentum, dampening, nesterov) and ``Adagrad``: the sparse update is the dense
  one (torch coalesces the gradient; rows it does not hold stay as zero rows would leave them);
  with ``weight_decay`` torch itself raises on a sparse gradient, as do ``Adam``, ``AdamW``,
  ``RMSprop`` and the other classes, so the plain script fails too: refused with torch's reason.
- torch ``SparseAdam`` is lazy (only the touched rows' moments move): refused.
- paddle ``SGD`` and ``Adagrad``: the sparse update is the dense one. Paddle's sparse kernels of
  ``Momentum``, ``Adam`` / ``AdamW`` (with or without ``lazy_mode``), ``RMSProp``, ``Adamax`` and
  ``Adadelta`` do not compute the dense update (measured with paddle 3.3.1: Momentum and RMSProp
  leave out a row of an unsorted sparse gradient, Adam's first step differs, lazy_mode moves only
  the touched rows' moments, the others raise): refused.

With no script optimizer on the shards (``ps.optimizer`` set in the job, or ``ps.sync: local``
where the script's optimizer steps on the worker) nothing is refused: the shards' optimizer
applies its dense update to the dense gradient.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridfleet.errors import SpecError

SPARSE_TORCH = ("SGD", "Adagrad")
SPARSE_PADDLE = ("SGD", "Adagrad")
_FIX = "build the embedding with sparse=False (every optimizer trains a dense embedding)"


def _torch_reason(optimizer: Any, group: dict) -> str | None:
    """Why the shards cannot apply ``optimizer`` to a sparse gradient in ``group`` exactly (None: they can)."""
    name = type(optimizer).__name__
    if name == "SparseAdam":
        return ("torch.optim.SparseAdam is lazy (only the touched rows' moments move), an update the shards do not "
                f"run; use torch.optim.SGD or Adagrad with sparse=True, or {_FIX} and Adam / AdamW")
    if not type(optimizer).__module__.startswith("torch.optim"):
        return None  # the optimizer reader refuses it, naming the classes the shards run
    if name not in SPARSE_TORCH:
        return (f"torch.optim.{name} does not support sparse gradients (torch raises at optimizer.step(), the plain "
                f"script fails too); use torch.optim.SGD or Adagrad, or {_FIX}")
    if group.get("weight_decay", 0):
        torch_says = ("weight_decay option is not compatible with sparse gradients" if name == "Adagrad"
                      else "add(sparse, dense) is not supported")
        return (f"torch.optim.{name}(weight_decay={group['weight_decay']}) raises on sparse gradients ({torch_says}), "
                "the plain script fails too; put the embedding in a parameter group with weight_decay=0, or " + _FIX)
    return None


def _paddle_reason(optimizer: Any) -> str | None:
    name = type(optimizer).__name__
    if not type(optimizer).__module__.startswith("paddle.optimizer"):
        return None
    if name in SPARSE_PADDLE:
        return None
    if name in ("Adam", "AdamW") and getattr(optimizer, "_lazy_mode", False):
        return (f"paddle.optimizer.{name}(lazy_mode=True) moves only the touched rows' moments, an update the shards "
                f"do not run; use paddle.optimizer.SGD or Adagrad with sparse=True, or {_FIX}")
    return (f"paddle.optimizer.{name}'s sparse kernel does not apply the update its dense kernel applies (the shards "
            f"apply the dense one, so the result would differ from the plain script's); use paddle.optimizer.SGD or "
            f"Adagrad with sparse=True, or {_FIX}")


def refusal(framework: str, optimizer: Any, sparse: dict[str, str], params: dict[str, Any]) -> None:
    """Raise SpecError, naming the parameter, the optimizer and the fix, when the shards applying
    ``optimizer`` to the dense reading of a sparse gradient would not reproduce the plain script.

    ``sparse``: parameter name -> the layer that makes its gradient sparse; ``params``: name -> tensor."""
    if optimizer is None or not sparse:
        return
    for name in sorted(sparse):
        if framework == "torch":
            param = params[name]
            group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), None)
            if group is None:
                continue  # not stepped by the script's optimizer: nothing is pushed for it
            why = _torch_reason(optimizer, group)
        else:
            why = _paddle_reason(optimizer)
        if why is not None:
            raise SpecError(f"parameter {name!r} ({sparse[name]}) has sparse gradients: {why}")


def torch_dense(grad: Any) -> Any:
    """A torch sparse COO gradient as its dense tensor (duplicate indices summed); others unchanged."""
    return grad.coalesce().to_dense() if grad.is_sparse else grad


def paddle_dense(grad: Any) -> np.ndarray:
    """A paddle SelectedRows gradient (rows, values, height) as the float32 dense array it stands for:
    each row's values summed into its row of a zero table."""
    values = grad._get_tensor_from_selected_rows().astype("float32").numpy()
    height = grad.get_selected_rows().height()
    rows = np.asarray(grad.rows(), dtype=np.int64)
    dense = np.zeros((height, *values.shape[1:]), dtype=np.float32)
    if rows.size:
        np.add.at(dense, rows, values.reshape(rows.size, *values.shape[1:]))
    return dense
