"""Error feedback: what a codec drops from one push is added to the next.

Kept on the worker, per key, because only the sender knows what its codec
dropped; the server sees ordinary payloads. For every push

    corrected    = grad + residual
    payload      = codec.encode(corrected)
    residual_new = corrected - codec.decode(payload)

so decode(payload) + residual_new == grad + residual (to float rounding) and,
over T pushes, sum(decoded) + final residual == sum(grads): nothing is lost,
only delayed.

With `momentum` > 0 (sparse codecs only) this becomes the momentum correction
of Deep Gradient Compression (Lin et al., 2018): velocity u = m * u + grad,
accumulation v = v + u, send top-k of v, then clear the sent coordinates of u
and v. Momentum is then applied here, so the server should run plain SGD.

`warmup_steps` > 0 (sparse codecs only) lowers the kept fraction
exponentially from dense to the codec's ratio over the first pushes of each
key: ratio ** (step / warmup_steps) at step 0, 1, ... warmup_steps - 1.

A push that the server may refuse encodes with ``stage=True``: the new state is held
apart until `commit` (the push was applied) or `discard` (it was refused or lost, e.g. a
stale round or a restarted shard), so a refused push leaves every residual exactly as it
was before encoding and the next push still carries it.

A codec with a warm start (powersgd) also keeps one more array per key here, the Q factor
its last encoding returned, passed back to the next encoding of that key; it is staged,
committed, discarded and saved (``q/<key>``) with the residual.

Not thread-safe for one key; different keys may be encoded from different threads.
"""

from __future__ import annotations

import numpy as np

from hybridfleet.codec.base import Codec, all_finite, check_gradient
from hybridfleet.codec.cast import FP16_MAX

_KINDS = ("residual", "velocity", "step", "q")


class ErrorFeedback:
    """Wraps a codec with a per-key residual (and optional DGC momentum and warm-up)."""

    def __init__(self, codec: Codec, *, momentum: float = 0.0, warmup_steps: int = 0):
        if not isinstance(codec, Codec):
            raise TypeError(f"ErrorFeedback wraps a Codec (got {type(codec).__name__})")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"momentum must be a number in [0, 1) (got {momentum!r})")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0 (got {warmup_steps!r})")
        if (momentum or warmup_steps) and not codec.sparse:
            what = "momentum correction" if momentum else "ratio warm-up"
            raise ValueError(f"{what} needs a sparsifying codec (topk, randomk); got {codec.name!r}")
        self.codec = codec
        self.momentum = float(momentum)
        self.warmup_steps = warmup_steps
        self._residuals: dict[str, np.ndarray] = {}
        self._velocities: dict[str, np.ndarray] = {}
        self._steps: dict[str, int] = {}
        self._warm: dict[str, np.ndarray] = {}  # key -> the warm-start Q of a codec that has one
        self._staged: dict[str, tuple[np.ndarray, np.ndarray | None, int, np.ndarray | None]] = {}

    def ratio_at(self, step: int) -> float | None:
        """The kept fraction used at a key's `step` (None for codecs without a ratio)."""
        ratio = getattr(self.codec, "ratio", None)
        if ratio is None or step >= self.warmup_steps:
            return ratio
        return ratio ** (step / self.warmup_steps)

    def encode(self, key: str, grad: np.ndarray, *, stage: bool = False, rows: int | None = None) -> bytes:
        """The payload for `grad` corrected by the residual of `key`; updates that residual
        (with ``stage=True`` only once `commit` is called; `discard` drops the update).
        `rows` goes to a codec with a matrix layout (powersgd: the row count to view `grad` with).

        The payload has grad's shape and dtype. On any error (bad key, dtype,
        shape, NaN) the state of every key is unchanged.
        """
        grad = self._check(key, grad)
        work_dtype = np.result_type(grad.dtype, np.float32)
        step = self._steps.get(key, 0)
        velocity = None
        if self.momentum:
            velocity = np.array(grad, dtype=work_dtype, order="C")
            if key in self._velocities:
                velocity += self.momentum * self._velocities[key]
            corrected = self._plus_residual(key, velocity, work_dtype)
        else:
            corrected = self._plus_residual(key, grad, work_dtype)

        codec = self.codec
        ratio = self.ratio_at(step)
        if ratio is not None and ratio != codec.ratio:
            codec = codec.with_ratio(ratio)
        q = None
        if getattr(codec, "warm_start", False):
            payload, q = codec.encode_warm(_to_wire_dtype(corrected, grad.dtype), self._warm.get(key), rows=rows)
        else:
            payload = codec.encode(_to_wire_dtype(corrected, grad.dtype))

        if codec.sparse:
            sent = codec.decode_sparse(payload)
            corrected.reshape(-1)[sent.indices] -= sent.values.astype(work_dtype)
            if velocity is not None:
                velocity.reshape(-1)[sent.indices] = 0
        else:
            corrected -= codec.decode(payload).astype(work_dtype)

        if stage:
            self._staged[key] = (corrected, velocity, step + 1, q)
        else:
            self._store(key, corrected, velocity, step + 1, q)
        return payload

    def _store(self, key: str, residual: np.ndarray, velocity: np.ndarray | None, step: int,
               q: np.ndarray | None = None) -> None:
        self._residuals[key] = residual
        if velocity is not None:
            self._velocities[key] = velocity
        self._steps[key] = step
        if q is None:
            self._warm.pop(key, None)
        else:
            self._warm[key] = q

    def commit(self) -> list[str]:
        """Keep the state staged by ``encode(..., stage=True)`` (its push was applied); returns the keys."""
        keys = list(self._staged)
        for key, (residual, velocity, step, q) in self._staged.items():
            self._store(key, residual, velocity, step, q)
        self._staged.clear()
        return keys

    def discard(self) -> list[str]:
        """Drop the staged state (its push was not applied): every key keeps the residual it had
        before that encoding; returns the keys."""
        keys = list(self._staged)
        self._staged.clear()
        return keys

    def keep_staged(self, keys) -> list[str]:
        """Drop the staged state of every key not in ``keys`` (as if it had not been encoded);
        returns the dropped keys."""
        dropped = [key for key in self._staged if key not in keys]
        for key in dropped:
            del self._staged[key]
        return dropped

    @property
    def staged(self) -> bool:
        """Whether an encoding waits for `commit` or `discard`."""
        return bool(self._staged)

    def residual(self, key: str) -> np.ndarray | None:
        """A copy of the residual kept for `key` (None before its first push)."""
        residual = self._residuals.get(key)
        return None if residual is None else residual.copy()

    def keys(self) -> list[str]:
        """The keys that have state."""
        return list(self._residuals)

    def reset(self, key: str | None = None) -> None:
        """Forget the state of `key` (or of every key)."""
        for table in (self._residuals, self._velocities, self._steps, self._warm, self._staged):
            if key is None:
                table.clear()
            else:
                table.pop(key, None)

    def state_dict(self) -> dict[str, np.ndarray]:
        """The state as a flat dict of numpy arrays (safetensors-ready): ``residual/<key>``,
        ``velocity/<key>`` (with momentum), ``q/<key>`` (warm-start codecs) and ``step/<key>``
        (int64, shape (1,))."""
        state: dict[str, np.ndarray] = {}
        for key, residual in self._residuals.items():
            state[f"residual/{key}"] = residual.copy()
            state[f"step/{key}"] = np.array([self._steps[key]], dtype=np.int64)
            if key in self._velocities:
                state[f"velocity/{key}"] = self._velocities[key].copy()
            if key in self._warm:
                state[f"q/{key}"] = self._warm[key].copy()
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Replace all state with `state` (as made by `state_dict`).

        ValueError naming the entry if anything is inconsistent; the current
        state is then left as it was.
        """
        tables: dict[str, dict[str, np.ndarray]] = {kind: {} for kind in _KINDS}
        for name, value in state.items():
            kind, sep, key = name.partition("/")
            if not sep or kind not in tables or not key:
                raise ValueError(f"error-feedback state: unknown entry {name!r} (expected residual/, velocity/, q/ or step/<key>)")
            if not isinstance(value, np.ndarray):
                raise ValueError(f"error-feedback state: {name!r} must be a numpy array (got {type(value).__name__})")
            tables[kind][key] = value
        residuals, velocities, steps, warm = tables["residual"], tables["velocity"], tables["step"], tables["q"]
        for key, residual in residuals.items():
            if residual.dtype not in (np.float32, np.float64) or not all_finite(residual):
                raise ValueError(f"error-feedback state: residual/{key} must be finite float32 or float64 (got {residual.dtype})")
            step = steps.get(key)
            if step is None or step.shape != (1,) or step.dtype.kind not in "iu" or step[0] < 0:
                raise ValueError(f"error-feedback state: step/{key} must be a non-negative int64 array of shape (1,)")
        for kind, table in (("velocity", velocities), ("step", steps), ("q", warm)):
            for key in table.keys() - residuals.keys():
                raise ValueError(f"error-feedback state: {kind}/{key} has no residual/{key}")
        if velocities and not self.momentum:
            raise ValueError("error-feedback state holds velocities but momentum is off")
        for key, velocity in velocities.items():
            if velocity.shape != residuals[key].shape or velocity.dtype != residuals[key].dtype:
                raise ValueError(
                    f"error-feedback state: velocity/{key} {velocity.dtype}{list(velocity.shape)} does not match "
                    f"residual/{key} {residuals[key].dtype}{list(residuals[key].shape)}"
                )
        if warm and not getattr(self.codec, "warm_start", False):
            raise ValueError(f"error-feedback state holds warm-start Q factors but codec {self.codec.name!r} has none")
        for key, q in warm.items():
            if q.dtype != np.float32 or q.ndim != 2 or not np.isfinite(q).all():
                raise ValueError(f"error-feedback state: q/{key} must be a finite 2-D float32 array "
                                 f"(got {q.dtype}{list(q.shape)})")
        self._warm = {key: np.array(value, order="C") for key, value in warm.items()}
        self._residuals = {key: np.array(value, order="C") for key, value in residuals.items()}
        self._velocities = {key: np.array(value, order="C") for key, value in velocities.items()}
        self._steps = {key: int(value[0]) for key, value in steps.items()}

    def _check(self, key: str, grad: np.ndarray) -> np.ndarray:
        if not isinstance(key, str) or not key:
            raise TypeError(f"error-feedback key must be a non-empty string (got {key!r})")
        grad = check_gradient(grad, self.codec.name)
        residual = self._residuals.get(key)
        expected_dtype = np.result_type(grad.dtype, np.float32)
        if residual is not None and (residual.shape != grad.shape or residual.dtype != expected_dtype):
            raise ValueError(
                f"key {key!r}: gradient {grad.dtype}{list(grad.shape)} does not match the residual kept for it "
                f"({residual.dtype}{list(residual.shape)}); call reset({key!r}) if the parameter changed"
            )
        return grad

    def _plus_residual(self, key: str, x: np.ndarray, work_dtype: np.dtype) -> np.ndarray:
        """A new C-ordered array x + residual[key] (the residual itself is not touched)."""
        out = np.array(x, dtype=work_dtype, order="C")
        if key in self._residuals:
            out += self._residuals[key]
        return out


def _to_wire_dtype(corrected: np.ndarray, dtype: np.dtype) -> np.ndarray:
    # The payload keeps the gradient's dtype; for float16 the corrected value may
    # exceed its range, and the clipped excess stays in the residual.
    if dtype == np.float16:
        return np.clip(corrected, -FP16_MAX, FP16_MAX).astype(np.float16)
    return corrected.astype(dtype, copy=False)
