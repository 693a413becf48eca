"""One parameter-server shard's state: parameters, optimizer, membership and consistency.

The gRPC layer (`service.py`) only moves bytes; everything that decides whether a
push is valid and when it is applied lives here, behind one lock, so it can be
tested without a network. A rejected push raises `Reject` and changes nothing.
The state's methods are grouped by concept: `membership` (join, leave, reaping),
`rounds` (push validation and application), `downlink` (pull, the delta log).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from hybridfleet.obs.log import get_logger
from hybridfleet.ps.aggregate import RoundAggregator
from hybridfleet.ps.server.downlink import Downlink
from hybridfleet.ps.server.groups import ScriptOptimizer
from hybridfleet.ps.server.membership import Member, Membership
from hybridfleet.ps.server.rounds import STEP_WINDOW, Rounds, values_digest  # noqa: F401  (re-exported)
from hybridfleet.ps.wire.buffers import DTYPE
from hybridfleet.ps.wire.sharding import ShardingPlan
from hybridfleet.spec.models import PSSpec
from hybridfleet.spec.rules import ROUND_SYNC_MODES

log = get_logger("ps.shard")

__all__ = ["DTYPE", "Member", "ShardState", "STEP_WINDOW", "values_digest"]


class ShardState(Membership, Rounds, Downlink):
    """Parameters and optimizer state of one shard, with BSP/SSP/ASP consistency."""

    def __init__(self, shard: int, spec: PSSpec, flavour: str = "torch", expected_workers: int = 0,
                 codec: str | None = None, clock=time.monotonic, sites: dict[str, int] | None = None,
                 secagg=None, initialiser: str | None = None):
        """``sites``: each site's worker count from the job; with it a Join must name one of the
        job's worker ids (``<site>-<rank>``, rank below the count) and a push may count at most
        that many contributors. ``secagg``: the job's resolved `SecAggSettings` when
        ``spec.secure_aggregation`` is on (pushes are then masked ring vectors). ``initialiser``:
        the one worker id whose INIT is accepted (`hybridfleet.security.credentials.initialising_worker`;
        None: any member's)."""
        from hybridfleet.ps.server.optim import make_optimizer

        self.shard = shard
        self.spec = spec
        self.sync = spec.sync
        self.in_rounds = spec.sync in ROUND_SYNC_MODES  # local: one round per outer step, like bsp
        self.codec_name = codec or spec.compression.codec
        self.expected_workers = expected_workers
        self.sites = dict(sites) if sites is not None else None
        self.initialiser = initialiser
        self.flavour = flavour
        self.optimizer = make_optimizer(spec.optimizer, flavour)  # the job's ps.optimizer (numpy)
        self.script_optimizer: ScriptOptimizer | None = None     # the script's, made on its first step
        self.round_optimizer: dict[int, tuple[str, dict | None]] = {}  # round -> (first pusher, its optimizer)
        self.plan: ShardingPlan | None = None
        self.params: dict[str, np.ndarray] = {}
        self.key_version: dict[str, int] = {}
        self._wire_cache: dict[str, tuple[int, np.ndarray, list[memoryview]]] = {}  # key -> (key version, values, pieces)
        self.value_changes: dict[str, int] = {}  # key -> writes into its `params` array (see LivePieces)
        self.detached_values = 0  # parameter arrays replaced by a copy because a pull still sent from them
        self.initialized: set[str] = set()
        self.version = 0
        self.init_digest = ""   # sha256 of the initial values (see values_digest)
        self.members: dict[str, Member] = {}
        self.rounds: dict[int, RoundAggregator] = {}
        self.applied_pushes = 0
        self.rejected_pushes = 0
        self.skipped_rounds = 0  # rounds closed without an update: a worker's gradient was not finite
        self.skipped_pushes = 0  # the same outside rounds (asp, ssp): one worker's update skipped
        self.skip_votes: dict[int, set[str]] = {}  # round -> workers that pushed skip_nonfinite
        self.on_applied: Callable[[], None] | None = None  # called after each applied version, lock held
        self._first_join: float | None = None
        self._now = clock
        # one lock; `cond` wakes secure aggregation's waiters, each waiting pull has its own
        # condition on the same lock (see `Downlink.pull`)
        self._lock = threading.RLock()
        self.cond = threading.Condition(self._lock)
        self._pull_waiters: dict[str | int, set[threading.Condition]] = {}
        self.pull_wakeups = 0  # waiting pulls woken by an event that could make them ready
        self._changed_cache: tuple[int, dict[int, list]] = (-1, {})  # version -> since -> pull items
        self._pulled: tuple[int, set[str]] = (-1, set())  # version -> workers answered at it (round modes)
        self._keys_of: tuple[ShardingPlan | None, list[str], int] = (None, [], 0)
        self._codec = None
        # compressed downlink (codec != none): workers hold `broadcast`, not `params`;
        # each applied version sends codec(params - broadcast) and adds its decoding to
        # `broadcast`, so what the codec dropped stays in the difference and is sent
        # later (error feedback on the server), and every worker holds the same values.
        self.compress_down = self.codec_name != "none"
        self.broadcast: dict[str, np.ndarray] = {}
        self._down_q: dict[str, np.ndarray | None] = {}  # a warm-start codec's Q per key (powersgd downlink)
        # (version, key -> encoded delta cut into wire pieces once, shared by every puller,
        # key -> its encoded bytes); at most `delta_log_bound_bytes` in all, oldest dropped first
        self.delta_log: deque[tuple[int, dict[str, list[memoryview]], dict[str, int]]] = deque()
        self.delta_log_bytes = 0
        self.downlink_dense_bytes = 0
        self.downlink_encoded_bytes = 0
        if (spec.secure_aggregation is None) != (secagg is None):
            raise ValueError("ShardState: pass the job's SecAggSettings exactly when ps.secure_aggregation is on")
        self.secagg = None
        if secagg is not None:
            from hybridfleet.ps.secagg.server import SecAggServer

            self.secagg = SecAggServer(self, secagg)

    # ----------------------------------------------------------------- helpers
    @property
    def keys(self) -> list[str]:
        """This shard's keys in plan order (worked out once per plan; do not modify the list)."""
        return self._plan_facts()[1]

    @property
    def slice_bytes(self) -> int:
        """The float32 bytes of this shard's slice of the parameters (0 before the plan is fixed)."""
        return self._plan_facts()[2]

    def _plan_facts(self) -> tuple[ShardingPlan | None, list[str], int]:
        if self._keys_of[0] is not self.plan:
            blocks = self.plan.blocks_for_shard(self.shard) if self.plan else []
            self._keys_of = (self.plan, [b.key for b in blocks],
                             sum((b.stop - b.start) * DTYPE.itemsize for b in blocks))
        return self._keys_of

    def codec(self):
        if self._codec is None:
            from hybridfleet.codec import codec_for, get_codec

            c = self.spec.compression
            self._codec = codec_for(c) if self.codec_name == c.codec else get_codec(self.codec_name)
        return self._codec

    def is_initialized(self) -> bool:
        return self.plan is not None and len(self.initialized) == len(self.keys)

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        with self.cond:
            return {
                "shard": self.shard, "version": self.version, "sync": self.sync, "codec": self.codec_name,
                "keys": len(self.keys), "initialized": self.is_initialized(),
                "param_bytes": int(sum(p.nbytes for p in self.params.values())),
                "live_workers": sorted(self.live_members()),
                "members": {w: {"site": m.site, "clock": m.clock, "alive": m.alive} for w, m in self.members.items()},
                "applied_pushes": self.applied_pushes, "rejected_pushes": self.rejected_pushes,
                "skipped_rounds": self.skipped_rounds, "skipped_pushes": self.skipped_pushes,
                "downlink_dense_bytes": self.downlink_dense_bytes,
                "downlink_encoded_bytes": self.downlink_encoded_bytes,
                "delta_log_versions": len(self.delta_log), "delta_log_bytes": self.delta_log_bytes,
                "delta_log_bound_bytes": self.delta_log_bound_bytes,
                "pull_wakeups": self.pull_wakeups, "detached_values": self.detached_values,
                "pull_waiters": sum(len(w) for w in self._pull_waiters.values()),
                **({"secure_aggregation": self.secagg.status()} if self.secagg is not None else {}),
            }

    def snapshot_arrays(self) -> dict[str, np.ndarray]:
        """A copy of the parameters (for tests and snapshots)."""
        with self.cond:
            return {k: v.copy() for k, v in self.params.items()}
