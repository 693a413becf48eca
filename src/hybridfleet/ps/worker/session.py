"""Framework-agnostic worker session: numpy gradients in, numpy parameters out.

The torch and paddle adapters (`hybridfleet.torch`, `hybridfleet.paddle`) turn
tensors into numpy arrays and back; everything else happens here, identically for
both frameworks, one role per module:

- `hybridfleet.ps.worker.config`: where the worker sits (``HFLEET_*`` variables);
- this module: joining, initialising, local training and the order of a step
  (checks -> site reduce -> clip/noise -> exchange);
- `hybridfleet.ps.worker.site_path`: the site leader's reduce and a follower's link;
- `hybridfleet.ps.worker.exchange`: encoding with error feedback, pushing, waiting per
  the consistency mode, pulling and applying;
- `hybridfleet.ps.worker.reporting`: byte counters, egress scan, metrics records.

Without servers (``HFLEET_SERVERS`` unset) the session trains locally with the
same optimizer the shards use, so a single-site baseline and a joint run differ
only in where the update is computed.
"""

from __future__ import annotations

import time

import numpy as np

from hybridfleet.codec.advice import sparse_advice
from hybridfleet.codec.base import all_finite
from hybridfleet.errors import install_excepthook
from hybridfleet.obs.log import get_logger
from hybridfleet.obs.metrics import StepTimer
from hybridfleet.ps.wire import buffers
from hybridfleet.ps.wire.sharding import ParamSpec, ShardingPlan
from hybridfleet.ps.worker.client import PSClient
from hybridfleet.ps.worker.config import WorkerConfig, client_security_from_env
from hybridfleet.ps.worker.egress import EgressCapture
from hybridfleet.ps.worker.exchange import DTYPE, ShardExchange
from hybridfleet.ps.worker.replan import current_servers
from hybridfleet.ps.worker.resolve import current_plan, port_file_resolver, shard_retry_s
from hybridfleet.ps.worker.reporting import SessionReporting
from hybridfleet.ps.worker.site_path import SitePath
from hybridfleet.spec.rules import ROUND_SYNC_MODES

__all__ = ["DTYPE", "PSSession", "WorkerConfig", "client_security_from_env"]

log = get_logger("ps.worker")


class PSSession(ShardExchange, SitePath, SessionReporting):
    """One worker's training session against the parameter server (or locally without one)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], config: WorkerConfig, framework: str):
        self.shapes = {k: tuple(int(d) for d in v) for k, v in shapes.items()}
        self.config = config
        self.framework = framework
        self.step_count = 0
        self.caught_up = 0  # rounds that closed without this worker after it started (a stale push, then catch-up)
        self.ps = config.job.ps
        self.codec_name = self.ps.compression.codec
        self.client: PSClient | None = None
        self.plan: ShardingPlan | None = None
        self._flat: dict[str, np.ndarray] = {}
        self._encoder = None  # encode(key, block) -> bytes, made on first use
        self._down_codec = None
        self._names = sorted(self.shapes)
        self.hub = None    # site leader's SiteHub, or
        self.link = None   # a follower's SiteLink
        self._local_opt = None
        self._block_index: tuple | None = None  # (plan, key -> block)
        self._started = time.monotonic()
        self.timer = StepTimer()
        self._raw_gradient_bytes: int | None = None
        self.dp = None if self.local or self.ps.privacy is None else self._privacy()
        self._egress: dict | None = None  # the egress scan's result, in the egress test mode
        self.secure = None  # hybridfleet.ps.secagg.rounds.SecureRounds when ps.secure_aggregation is on
        self.feedback = None  # hybridfleet.codec.feedback.ErrorFeedback with compression.error_feedback
        self.skipped_nonfinite = 0  # steps this worker skipped (for every worker) for a non-finite gradient
        self.row_sparse: set[str] = set()  # parameters whose gradient is row-sparse: pushed as rows under codec none

    def _privacy(self):
        """The push's Gaussian mechanism; with a budget, the job's steps end before epsilon exceeds it."""
        from hybridfleet.privacy import GaussianMechanism, budgeted_steps

        p, train = self.ps.privacy, self.config.job.train
        if p.epsilon_budget is not None:  # in sync: local one noised push per outer round of local_steps
            allowed = budgeted_steps(p, train.steps, self.ps.local_steps if self.ps.sync == "local" else None)
            if allowed < train.steps:
                log.warning("privacy_budget_limits_steps", steps=train.steps, allowed=allowed,
                            epsilon_budget=p.epsilon_budget, delta=p.delta)
                train.steps = allowed  # the script's loop reads ps.job.train.steps
        return GaussianMechanism(p.clip_norm, p.noise_multiplier)

    @property
    def local(self) -> bool:
        return not self.config.servers

    # ----------------------------------------------------------------- start
    def start(self, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Join the shards; the first worker's values initialise them. Returns the job's current parameters."""
        self._check_names(params)
        from hybridfleet.obs.metrics import serve_from_env
        from hybridfleet.obs.psmetrics import watch_worker

        serve_from_env()
        watch_worker(self)
        if self.local:
            from hybridfleet.ps.server.optim import make_optimizer

            self._local_opt = make_optimizer(self.ps.optimizer, self.framework)
            self._flat = {k: np.ascontiguousarray(v, dtype=DTYPE).reshape(-1).copy() for k, v in params.items()}
            return self.parameters()
        cfg = self.config
        install_excepthook()  # a refused join or an unreachable shard ends the script with one line, not a traceback
        from hybridfleet.ps.alloc import tune_allocator

        tune_allocator(trim_bytes=256 << 20)  # gradient frames and buffers are reused round after round
        if cfg.aggregates and cfg.site_rank > 0:
            return self._start_follower()
        self.client = self._new_client(current_servers(cfg) or cfg.servers)
        if cfg.egress_capture:
            self.client.bytes.capture = EgressCapture(cfg.egress_capture)
        specs = [ParamSpec(k, self.shapes[k], "float32") for k in sorted(self.shapes)]
        advice = sparse_advice(self.ps.compression, {s.name: s.numel for s in specs if not buffers.is_buffer(s.name)},
                               self.ps.optimizer)
        if advice and cfg.rank == 0:
            log.warning("codec_keeps_too_few", detail=advice)
        info = self.client.join(specs, self.ps.block_size_bytes, self.codec_name, self.framework)
        self.plan = self.client.plan
        if self.ps.secure_aggregation is not None:
            from hybridfleet.ps.secagg.rounds import SecureRounds
            from hybridfleet.ps.secagg.settings import SecAggSettings

            self.secure = SecureRounds(self.client, SecAggSettings.resolve(self.ps, cfg.job.sites), self.ps)
        if self.client.sync in ROUND_SYNC_MODES:
            # a (re)joining worker takes up the open round, not the steps it missed while away
            self.client.clock = max(self.client.clock, max(info["versions"]))
        self.step_count = self.client.clock
        init = None
        if not info["initialized"] and cfg.initialises:
            init = {}  # each block sent from the values' own memory: no copy of the model is made to send it
            for name, arr in params.items():
                init.update({k: memoryview(np.ascontiguousarray(v, dtype=DTYPE)).cast("B")
                             for k, v in self.plan.split(name, np.asarray(arr, dtype=DTYPE).reshape(-1)).items()})
        # start from our own values: when they are the job's initial values (workers seeded alike),
        # the first pull brings only what changed since, not every parameter again
        self._flat = {k: np.ascontiguousarray(params[k], dtype=DTYPE).reshape(-1).copy() for k in self.shapes}
        self._first_values(init)
        if cfg.aggregates:
            self._start_hub()
        log.info("worker_started", worker=cfg.worker_id, site=cfg.site, rank=cfg.rank, shards=len(cfg.servers),
                 resumed_clock=self.step_count, sync=self.client.sync, site_leader=self.hub is not None,
                 transport=self.client.transport)
        return self.parameters()

    def _new_client(self, servers: list[str]) -> PSClient:
        """A client of ``servers``, following moved shards and a changed shard count (port-file folder)."""
        cfg = self.config
        port_dir = cfg.shard_port_dir
        return PSClient(servers, cfg.security, cfg.worker_id, cfg.site, cfg.rank,
                        retry_timeout_s=shard_retry_s(),
                        transport=cfg.job.ps.transport,
                        resolve=port_file_resolver(port_dir) if port_dir else None,
                        watch_plan=(lambda: current_plan(port_dir)) if port_dir else None)

    def _numel(self) -> int:
        return sum(int(np.prod(self.shapes[n])) if self.shapes[n] else 1 for n in self._names)

    def _check_names(self, arrays: dict[str, np.ndarray]) -> None:
        if set(arrays) != set(self.shapes):
            missing, extra = sorted(set(self.shapes) - set(arrays)), sorted(set(arrays) - set(self.shapes))
            raise ValueError(f"parameter names differ from the model's: missing {missing[:3]}, unexpected {extra[:3]}")

    def parameters(self) -> dict[str, np.ndarray]:
        """The current parameters, shaped like the model's."""
        return {k: v.reshape(self.shapes[k]) for k, v in self._flat.items()}

    # ------------------------------------------------------------------ step
    def step(self, grads: dict[str, np.ndarray], optimizer_json: str = "",
             staged: dict[str, tuple[np.ndarray, dict[str, bytes]]] | None = None) -> dict[str, np.ndarray]:
        """Send this step's gradients and return the parameters to train on next.

        ``grads`` holds the parameters that have a gradient this step; the others are not
        stepped. ``optimizer_json``: the script's optimizer as the shards should apply it
        (`hybridfleet.ps.worker.optim_spec`); empty, the job's ``ps.optimizer`` applies.

        A gradient with a NaN or Inf skips the step as GradScaler does: nothing of it is sent, the
        shards close the round without applying anything for any worker (BSP), the parameters
        stay as they are, and it is logged (``round_skipped_nonfinite``) and counted in the metrics
        (``rounds_skipped_nonfinite``). Where the site's workers reduce together or under secure
        aggregation it raises ValueError instead, having sent nothing.

        ``staged``: name -> (array, encoded blocks) made while backward() ran
        (`hybridfleet.ps.worker.overlap`); a gradient in ``grads`` that is that very array is pushed
        as staged, the result is the same as encoding it here."""
        self.timer.begin()
        params = self._step(grads, optimizer_json, staged)
        if self._raw_gradient_bytes is None:
            self._raw_gradient_bytes = 0 if self.local or self.link is not None else self._numel() * DTYPE.itemsize
        self.timer.end(self._raw_gradient_bytes)
        return params

    def note_skipped_nonfinite(self, keys: list[str]) -> None:
        """Log and count a step skipped because the gradients of ``keys`` are not finite."""
        self.skipped_nonfinite += 1
        log.warning("round_skipped_nonfinite", worker=self.config.worker_id, step=self.step_count + 1,
                    keys=keys[:3], nonfinite_keys=len(keys))

    def local_step(self, params: dict[str, np.ndarray]) -> None:
        """Without servers, the script's optimizer stepped the model itself: record its new values."""
        self._check_names(params)
        self._flat = {k: np.ascontiguousarray(v, dtype=DTYPE).reshape(-1).copy() for k, v in params.items()}
        self.step_count += 1

    def _step(self, grads: dict[str, np.ndarray], optimizer_json: str = "",
              staged: dict | None = None) -> dict[str, np.ndarray]:
        unknown = sorted(set(grads) - set(self.shapes))
        if unknown:
            raise ValueError(f"gradients of parameters the job does not have: {unknown[:3]}")
        nonfinite = sorted(k for k, g in grads.items() if not all_finite(g))
        if nonfinite:
            if self.link is not None or self.hub is not None or self.secure is not None:
                raise ValueError(f"gradient of {nonfinite[0]!r} has non-finite values (NaN or Inf) at step "
                                 f"{self.step_count + 1}; a round cannot be skipped when the site's workers reduce "
                                 "together or under secure aggregation; nothing was sent")
            # GradScaler semantics: the step is skipped, on every worker of the round, and training goes on
            self.note_skipped_nonfinite(nonfinite)
            grads = {}
        if self.local:
            if nonfinite:
                self.step_count += 1
                return self.parameters()
            for k, g in grads.items():
                self._local_opt.step(k, self._flat[k], np.asarray(g, dtype=DTYPE).reshape(-1))
            self.step_count += 1
            return self.parameters()
        if self.link is not None:  # site follower: the leader reduces and talks to the shards
            return self._follower_step(grads)
        assert self.client is not None and self.plan is not None
        contributors = 1
        if self.hub is not None:
            grads, contributors = self._leader_gather(grads)
        if self.dp is not None and not nonfinite:  # clip and noise what leaves the site, after the site's reduce
            grads = self.dp.apply(grads)
        present = set(grads)
        if self.secure is not None:
            # the masks cover every key: a parameter without a gradient sends zeros, flagged as absent
            grads = {k: grads[k] if k in grads else np.zeros(self.shapes[k], DTYPE) for k in self._names}
        self._exchange(grads, contributors, nonfinite, optimizer_json, present, staged)
        if self.hub is not None:
            self._leader_broadcast()
        return self.parameters()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        for peer in (self.hub, self.link):
            if peer is not None:
                peer.close()
        self.hub = self.link = None
