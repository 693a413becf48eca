"""PowerSGD: a rank-r approximation P Q^T of each gradient matrix (Vogels et al., 2019).

One encode is one step of subspace iteration, the same math as PyTorch's
``powerSGD_hook`` (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py):

    M   = the tensor viewed as a (rows, cols) matrix
    Q   = previous Q (warm start) or a seeded standard normal (cols, r) matrix
    P   = orthonormalise(M Q)          # (rows, r), Gram-Schmidt (re-orthogonalised once)
    Q   = M^T P                        # (cols, r)
    M~  = P Q^T                        # what the decoder rebuilds

Both factors travel, so the decoder needs no state: ``bytes = 4 r (rows + cols)``
plus framing. The encoder's only state is the warm-start Q of each key, which
`ErrorFeedback` keeps beside the key's residual (PowerSGD is biased: use it with
error feedback). A bare `encode` starts from the seeded random Q every time.

Layout and rank, per tensor: a tensor of two or more dimensions is viewed as
``(shape[0], numel / shape[0])`` like the hook; a flat one as the near-square
``(d, numel / d)`` with d the largest divisor of numel not above its square root,
unless the caller names ``rows`` (the parameter server's workers pass each
parameter's own row count, and 1 for biases). The rank is ``min(rank, rows, cols)``,
and a tensor whose factors would not be `min_compression_rate` times smaller than the
tensor itself (1-D tensors, tiny layers) travels dense in float32, exactly.

Wire: params (rows u32, cols u32, rank u32), P (float32 rows x rank, row-major),
Q (float32 cols x rank), dense (float32 per element; empty when rank > 0).
"""

from __future__ import annotations

import math
import struct

import numpy as np

from hybridfleet.codec.base import Codec, check_gradient
from hybridfleet.codec.frame import Frame, check_numel, pack_frame
from hybridfleet.errors import ProtocolError

_PARAMS = struct.Struct("<III")
MAX_RANK = 1024
DEPENDENT = 1e-4  # float32 eps (1.2e-7) times a margin for the rounding of M Q


def near_square_rows(numel: int) -> int:
    """The largest divisor of `numel` that is not above its square root (1 for 0 and primes)."""
    for d in range(math.isqrt(numel), 1, -1):
        if numel % d == 0:
            return d
    return 1


def orthonormalise(matrix: np.ndarray) -> np.ndarray:
    """Orthonormalise the columns of `matrix` in place and return it: Gram-Schmidt (the hook's
    procedure) with one re-orthogonalisation pass, which float32 needs once a column is nearly
    dependent on the previous ones; such a column (left with under `DEPENDENT` of its norm)
    becomes zero instead of a normalised rounding error (or NaN)."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i]
        before = np.linalg.norm(col)
        if i:
            done = matrix[:, :i]
            for _ in range(2):
                col -= done @ (done.T @ col)
        norm = np.linalg.norm(col)
        if norm > DEPENDENT * before:
            col /= norm
        else:
            col[:] = 0
    return matrix


class PowerSGDCodec(Codec):
    """Rank-`rank` PowerSGD factors of each matrix, or the dense values where they would not save bytes.

    Bound: the decoded matrix is P P^T M with P orthonormal, so its error is never larger
    than the input (``||M - M~||_F <= ||M||_F``) and is zero when M has rank <= r; dense
    payloads are exact float32. Options: `rank` in [1, 1024], `min_compression_rate` > 1
    (the hook's default 2), `seed` for the first Q.
    """

    name = "powersgd"
    num_fields = 4
    warm_start = True  # ErrorFeedback keeps the Q of each key and passes it back (see encode_warm)

    def __init__(self, rank: int = 4, min_compression_rate: float = 2.0, seed: int = 0):
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 1 <= rank <= MAX_RANK:
            raise ValueError(f"powersgd: rank must be an integer in [1, {MAX_RANK}] (got {rank!r})")
        if (isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float))
                or not min_compression_rate >= 1):
            raise ValueError(f"powersgd: min_compression_rate must be a number >= 1 (got {min_compression_rate!r})")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"powersgd: seed must be an integer >= 0 (got {seed!r})")
        self.rank = int(rank)
        self.min_compression_rate = float(min_compression_rate)
        self.seed = int(seed)

    def options(self) -> dict:
        return {"rank": self.rank, "min_compression_rate": self.min_compression_rate, "seed": self.seed}

    def layout(self, shape: tuple[int, ...], rows: int | None = None) -> tuple[int, int, int]:
        """(rows, cols, rank) a tensor of `shape` is encoded with; rank 0 means dense.

        ValueError when `rows` does not divide the tensor's element count.
        """
        numel = math.prod(shape)
        if rows is not None:
            if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1 or numel % rows:
                raise ValueError(f"powersgd: rows must be a positive divisor of the tensor's {numel} elements "
                                 f"(got {rows!r})")
            rows = int(rows)
        elif len(shape) >= 2:
            rows = shape[0]
        else:
            rows = near_square_rows(numel)
        if numel == 0:
            return rows, 0, 0
        cols = numel // rows
        rank = min(self.rank, rows, cols)
        if not (rows + cols) * rank * self.min_compression_rate < numel:
            return rows, cols, 0
        return rows, cols, rank

    def encode(self, x: np.ndarray, *, rows: int | None = None) -> bytes:
        """One frame holding `x`'s factors, from the seeded Q (see `layout` for `rows`)."""
        return self.encode_warm(x, None, rows=rows)[0]

    def encode_warm(self, x: np.ndarray, q: np.ndarray | None, *, rows: int | None = None
                    ) -> tuple[bytes, np.ndarray | None]:
        """The frame for `x` starting from `q` (the previous call's Q for this tensor; None or a Q
        of another layout starts from the seeded random Q), and the new Q to pass next time
        (None for a dense frame). Never modifies `q`."""
        array = check_gradient(x, self.name)
        shape = tuple(array.shape)
        check_numel(shape)
        with np.errstate(over="ignore"):
            flat = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)
        if array.dtype.itemsize > 4 and not np.isfinite(flat).all():
            raise ValueError(f"codec {self.name!r} computes in float32; the gradient holds values beyond its range")
        n_rows, cols, rank = self.layout(shape, rows)
        if rank == 0:
            empty = np.zeros(0, dtype=np.float32)
            fields = [_PARAMS.pack(n_rows, cols, 0), empty, empty, flat]
            return pack_frame(self.name, array.dtype, shape, fields), None
        matrix = flat.reshape(n_rows, cols)
        if q is None or q.shape != (cols, rank):
            q = np.random.default_rng((self.seed, n_rows, cols)).standard_normal((cols, rank)).astype(np.float32)
        q = orthonormalise(np.array(q, dtype=np.float32))
        p = orthonormalise(matrix @ q)
        q_new = matrix.T @ p
        fields = [_PARAMS.pack(n_rows, cols, rank), p, q_new, np.zeros(0, dtype=np.float32)]
        return pack_frame(self.name, array.dtype, shape, fields), q_new

    def _encode_fields(self, flat: np.ndarray) -> list:  # encode is overridden: it needs the shape
        raise NotImplementedError

    def _decode_fields(self, frame: Frame) -> np.ndarray:
        numel = frame.header.numel
        rows, cols, rank = frame.params(0, _PARAMS, "params")
        if rank == 0:
            frame.array(1, np.float32, 0, "P")
            frame.array(2, np.float32, 0, "Q")
            return frame.array(3, np.float32, numel, "dense").copy()
        if rows * cols != numel:
            raise ProtocolError(f"powersgd payload announces {rows * cols} values for a tensor of {numel} elements")
        if rank > min(rows, cols, MAX_RANK):
            raise ProtocolError(f"powersgd payload: rank {rank} exceeds min(rows, cols) = {min(rows, cols)} "
                                f"(or {MAX_RANK})")
        p = frame.array(1, np.float32, rows * rank, "P").reshape(rows, rank)
        q = frame.array(2, np.float32, cols * rank, "Q").reshape(cols, rank)
        frame.array(3, np.float32, 0, "dense")
        return (p @ q.T).reshape(-1)
