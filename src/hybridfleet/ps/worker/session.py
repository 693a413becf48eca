"""Framework-agnostic worker session: numpy gradients in, numpy parameters out.

The torch and paddle adapters (`hybridfleet.torch`, `hybridfleet.paddle`) turn
tensors into numpy arrays and back; everything else (joining, initialising,
encoding with error feedback, pushing, waiting per the consistency mode,
pulling, accounting) happens here, identically for both frameworks.

Without servers (``HFLEET_SERVERS`` unset) the session trains locally with the
same optimizer the shards use, so a single-site baseline and a joint run differ
only in where the update is computed.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from hybridfleet.codec.advice import sparse_advice
from hybridfleet.errors import ProtocolError, install_excepthook
from hybridfleet.obs.log import get_logger
from hybridfleet.obs.metrics import StepTimer
from hybridfleet.obs.scalars import record_report
from hybridfleet.ps.worker.egress import CAPTURE_ENV, EgressCapture
from hybridfleet.ps.worker.client import ClientSecurity, PSClient, Pulled, ShardRestarted
from hybridfleet.ps.wire import buffers
from hybridfleet.ps.wire.sharding import ParamSpec, ShardingPlan, matrix_rows
from hybridfleet.spec.models import JobSpec
from hybridfleet.spec.rules import ROUND_SYNC_MODES

log = get_logger("ps.worker")

DTYPE = np.dtype("<f4")


@dataclass
class WorkerConfig:
    """Where this worker sits and how it reaches the shards (read from ``HFLEET_*`` variables)."""

    job: JobSpec
    site: str = "local"
    rank: int = 0
    site_rank: int = 0
    servers: list[str] = field(default_factory=list)
    security: ClientSecurity = field(default_factory=lambda: ClientSecurity(insecure=True))
    site_hub: str | None = None   # host:port of the site leader when the site aggregates
    egress_capture: str | None = None  # test mode: keep every sent byte here (see hybridfleet.ps.worker.egress)

    @property
    def aggregates(self) -> bool:
        """Whether this worker reduces with its site first (only the site leader talks to the shards)."""
        return bool(self.site_hub and self.servers and self.job.sites[self.site].workers > 1)

    @property
    def worker_id(self) -> str:
        return f"{self.site}-{self.site_rank}"

    @property
    def initialises(self) -> bool:
        """Whether this worker pushes the initial values: the first worker of ``ps.init_site`` (default: rank 0),
        the one worker whose INIT the shards accept."""
        from hybridfleet.security.credentials import initialising_worker

        return self.worker_id == initialising_worker(self.job)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "WorkerConfig":
        """Build the config from ``HFLEET_JOB``, ``HFLEET_SITE``, ``HFLEET_RANK``, ``HFLEET_SERVERS``, ..."""
        from hybridfleet.spec import load_spec

        env = dict(os.environ if env is None else env)
        job_path = env.get("HFLEET_JOB")
        if not job_path:
            raise ValueError("HFLEET_JOB is not set: run the script with `hfleet run JOB` or `hfleet worker JOB ...`")
        job = load_spec(job_path)
        servers = [s for s in env.get("HFLEET_SERVERS", "").split(",") if s]
        site = env.get("HFLEET_SITE", next(iter(job.sites)))
        if site not in job.sites:
            raise ValueError(f"HFLEET_SITE={site!r} is not a site of job {job.name!r} ({', '.join(job.sites)})")
        return cls(job=job, site=site, rank=int(env.get("HFLEET_RANK", "0")),
                   site_rank=int(env.get("HFLEET_SITE_RANK", "0")), servers=servers,
                   security=client_security_from_env(env), site_hub=env.get("HFLEET_SITE_HUB") or None,
                   egress_capture=env.get(CAPTURE_ENV) or None)


def client_security_from_env(env: dict[str, str]) -> ClientSecurity:
    """TLS + token from ``HFLEET_CA_CERT``/``HFLEET_CLIENT_CERT``/``HFLEET_CLIENT_KEY``/``HFLEET_TOKEN``
    (or ``HFLEET_TOKEN_FILE``, re-read when it changes);
    plaintext only with ``HFLEET_INSECURE=1``."""
    token, token_file = env.get("HFLEET_TOKEN") or None, env.get("HFLEET_TOKEN_FILE") or None
    if env.get("HFLEET_INSECURE") == "1":
        return ClientSecurity(insecure=True, token=token, token_file=token_file)
    ca = env.get("HFLEET_CA_CERT")
    if not ca:
        return ClientSecurity(insecure=False, token=token, token_file=token_file)
    cert, key = env.get("HFLEET_CLIENT_CERT"), env.get("HFLEET_CLIENT_KEY")
    return ClientSecurity.from_files(ca, cert or None, key or None, token=token, token_file=token_file)


class PSSession:
    """One worker's training session against the parameter server (or locally without one)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], config: WorkerConfig, framework: str):
        self.shapes = {k: tuple(int(d) for d in v) for k, v in shapes.items()}
        self.config = config
        self.framework = framework
        self.step_count = 0
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
        self.client = PSClient(cfg.servers, cfg.security, cfg.worker_id, cfg.site, cfg.rank,
                               retry_timeout_s=float(os.environ.get("HFLEET_SHARD_RETRY_S", "60")),
                               transport=cfg.job.ps.transport)
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
        if not info["initialized"] and cfg.initialises:
            init = {}
            for name, arr in params.items():
                init.update({k: np.ascontiguousarray(v, dtype=DTYPE).tobytes()
                             for k, v in self.plan.split(name, np.asarray(arr, dtype=DTYPE).reshape(-1)).items()})
            self.client.push(init, codec="none", kind="INIT")
        # start from our own values: when they are the job's initial values (workers seeded alike),
        # the first pull brings only what changed since, not every parameter again
        self._flat = {k: np.ascontiguousarray(params[k], dtype=DTYPE).reshape(-1).copy() for k in self.shapes}
        self._apply_pulled(self.client.pull(full=True, init_digests=self._shard_digests()))
        if cfg.aggregates:
            from hybridfleet.ps.worker.site import SiteHub
            from hybridfleet.ps.worker.site_security import HubSecurity

            followers = cfg.job.sites[cfg.site].workers - 1
            self.hub = SiteHub(cfg.site_hub, followers, self._numel(), HubSecurity.from_env(cfg.job, cfg.site))
            joined = self.hub.wait_for_followers()
            log.info("site_leader_ready", site=cfg.site, followers=joined, expected=followers)
        log.info("worker_started", worker=cfg.worker_id, site=cfg.site, rank=cfg.rank, shards=len(cfg.servers),
                 resumed_clock=self.step_count, sync=self.client.sync, site_leader=self.hub is not None,
                 transport=self.client.transport)
        return self.parameters()

    def _shard_digests(self) -> list[str]:
        from hybridfleet.ps.server.shard import values_digest

        return [values_digest(self._flat[b.param][b.start:b.stop] for b in self.plan.blocks_for_shard(i))
                for i in range(self.plan.num_shards)]

    def _numel(self) -> int:
        return sum(int(np.prod(self.shapes[n])) if self.shapes[n] else 1 for n in self._names)

    def _start_follower(self) -> dict[str, np.ndarray]:
        from hybridfleet.ps.worker.site import SiteLink
        from hybridfleet.ps.worker.site_security import LinkSecurity

        cfg = self.config
        self.link = SiteLink(cfg.site_hub, cfg.site_rank, self._numel(), LinkSecurity.from_client(cfg.site, cfg.security))
        self._receive_from_leader()
        log.info("worker_started", worker=cfg.worker_id, site=cfg.site, rank=cfg.rank, site_follower=True,
                 resumed_clock=self.step_count)
        return self.parameters()

    def _receive_from_leader(self) -> None:
        from hybridfleet.ps.worker.site import unflatten

        self.step_count, vector = self.link.receive()
        self._flat = {k: v.reshape(-1).copy() for k, v in unflatten(vector, self.shapes, self._names).items()}

    def _check_names(self, arrays: dict[str, np.ndarray]) -> None:
        if set(arrays) != set(self.shapes):
            missing, extra = sorted(set(self.shapes) - set(arrays)), sorted(set(arrays) - set(self.shapes))
            raise ValueError(f"parameter names differ from the model's: missing {missing[:3]}, unexpected {extra[:3]}")

    def parameters(self) -> dict[str, np.ndarray]:
        """The current parameters, shaped like the model's."""
        return {k: v.reshape(self.shapes[k]) for k, v in self._flat.items()}

    # ------------------------------------------------------------------ step
    def step(self, grads: dict[str, np.ndarray], optimizer_json: str = "") -> dict[str, np.ndarray]:
        """Send this step's gradients and return the parameters to train on next.

        ``grads`` holds the parameters that have a gradient this step; the others are not
        stepped. ``optimizer_json``: the script's optimizer as the shards should apply it
        (`hybridfleet.ps.worker.optim_spec`); empty, the job's ``ps.optimizer`` applies.

        A gradient with a NaN or Inf skips the step as GradScaler does: nothing of it is sent, the
        shards close the round without applying anything for any worker (BSP), the parameters
        stay as they are, and it is logged (``round_skipped_nonfinite``) and counted in the metrics
        (``rounds_skipped_nonfinite``). Where the site's workers reduce together or under secure
        aggregation it raises ValueError instead, having sent nothing."""
        self.timer.begin()
        params = self._step(grads, optimizer_json)
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

    def _step(self, grads: dict[str, np.ndarray], optimizer_json: str = "") -> dict[str, np.ndarray]:
        unknown = sorted(set(grads) - set(self.shapes))
        if unknown:
            raise ValueError(f"gradients of parameters the job does not have: {unknown[:3]}")
        nonfinite = sorted(k for k, g in grads.items() if not np.isfinite(g).all())
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
        if self.link is not None or self.hub is not None or self.secure is not None:
            # the site's reduce and the masks cover every key: a parameter without a gradient sends zeros
            grads = {k: grads[k] if k in grads else np.zeros(self.shapes[k], DTYPE) for k in self._names}
        if self.link is not None:  # site follower: the leader reduces and talks to the shards
            from hybridfleet.ps.worker.site import flatten

            self.link.send(flatten(grads, self._names))
            self._receive_from_leader()
            self.timer.mark("wait")
            return self.parameters()
        assert self.client is not None and self.plan is not None
        contributors = 1
        if self.hub is not None:
            from hybridfleet.ps.worker.site import flatten, unflatten

            self.hub.admit(flatten(self._flat, self._names), self.step_count)
            total, contributors = self.hub.gather(flatten(grads, self._names))
            grads = unflatten(total, self.shapes, self._names)
            self.timer.mark("wait")
        if self.dp is not None and not nonfinite:  # clip and noise what leaves the site, after the site's reduce
            grads = self.dp.apply(grads)
        payloads = self._encode(grads) if self.secure is None else self._blocks_of(grads)
        self.timer.mark("encode")
        base = list(self.client.versions)
        wait_round = self.client.sync in ROUND_SYNC_MODES
        try:
            try:
                if self.secure is not None:  # masked: the shard sees only the round's sum
                    try:
                        self.secure.push(payloads, base, contributors, optimizer_json)
                    except grpc.RpcError as err:
                        if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                            raise  # already pushed (a retried push): the round still needs our answer
                    self.secure.unmask(base)
                else:
                    self.client.push(payloads, codec=self.codec_name, base_versions=base, contributors=contributors,
                                     optimizer_json=optimizer_json, skip_nonfinite=bool(nonfinite))
                self._settle_feedback(applied=True)
            except grpc.RpcError as err:
                # already pushed this round (a retry of this very push): ours is in the round; anything else
                # (a stale round, an error): not applied, so the residual stays as it was before encoding
                self._settle_feedback(applied=err.code() == grpc.StatusCode.ALREADY_EXISTS)
                if err.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
                    raise
                # stale round (after a rejoin): catch up now; already pushed this round: wait for it to close
                wait_round = wait_round and err.code() == grpc.StatusCode.ALREADY_EXISTS
                log.warning("push_skipped", worker=self.config.worker_id, detail=err.details())
            except BaseException:
                self._settle_feedback(applied=False)
                raise
            self.timer.mark("transfer")
            self.step_count = self.client.clock
            wait = None
            if wait_round:
                shards_with_keys = {b.shard for b in self.plan.blocks}
                wait = [v + 1 if i in shards_with_keys else -1 for i, v in enumerate(base)]
            try:
                self._apply_pulled(self.client.pull(wait_for_versions=wait, into=self._pull_target))
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.ABORTED:  # e.g. a secure round that cannot be unmasked
                    raise ProtocolError(err.details()) from None
                raise
        except ShardRestarted as restarted:
            # this step's gradient is dropped; train on from the restored shard's values. A residual
            # committed with a push the restored shard no longer holds is not rolled back (the shard
            # lost the values it was applied to as well); one still staged is discarded.
            self._settle_feedback(applied=False)
            log.warning("shard_restarted", worker=self.config.worker_id, detail=str(restarted))
            self.step_count = self.client.clock
            self._apply_pulled(self.client.pull(full=True))
        self.timer.mark("wait")
        if self.hub is not None:
            from hybridfleet.ps.worker.site import flatten

            self.hub.broadcast(flatten(self._flat, self._names), self.step_count)
        return self.parameters()

    def _encode(self, grads: dict[str, np.ndarray]) -> dict[str, bytes]:
        if self._encoder is None:
            self._encoder = self._make_encoder()
        out = {}
        for name, g in grads.items():
            dense = buffers.is_buffer(name)  # buffers travel dense, without error feedback (see ps.wire.buffers)
            for key, part in self.plan.split(name, np.asarray(g, dtype=DTYPE).reshape(-1)).items():
                out[key] = buffers.dense_codec().encode(part) if dense else self._encoder(key, part)
        return out

    def _blocks_of(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The update cut into the plan's blocks (key -> float32), unencoded: secure aggregation masks them."""
        out = {}
        for name, g in grads.items():
            out.update(self.plan.split(name, np.asarray(g, dtype=DTYPE).reshape(-1)))
        return out

    def _make_encoder(self):
        """``encode(key, block) -> bytes``; with error feedback the residual stays here, on the worker,
        staged until the push is settled (see `_settle_feedback`)."""
        from hybridfleet.codec import codec_for

        c = self.ps.compression
        codec = codec_for(c)
        if c.error_feedback and self.codec_name != "none":
            from hybridfleet.codec.feedback import ErrorFeedback

            self.feedback = ErrorFeedback(codec, momentum=c.momentum, warmup_steps=c.warmup_steps)
            if getattr(codec, "warm_start", False):  # powersgd: each block in its parameter's own rows
                return lambda key, block: self.feedback.encode(key, block, stage=True,
                                                               rows=matrix_rows(self.plan, key))
            return lambda key, block: self.feedback.encode(key, block, stage=True)
        return lambda key, block: codec.encode(block)

    def _settle_feedback(self, applied: bool) -> None:
        """Commit the residuals of this push's encoding when the push was applied, else restore
        them to what they were before it (nothing the codec dropped is lost with a refused push)."""
        for holder in (self.feedback, self.secure):
            if holder is not None:
                holder.commit() if applied else holder.discard()

    def _pull_target(self, key: str, delta_version: int, nbytes: int) -> memoryview | None:
        """Where a pulled block's values can be received in place: its slice of the parameters."""
        b = self._blocks().get(key)
        if b is None or delta_version or nbytes != (b.stop - b.start) * DTYPE.itemsize:
            return None  # checked (and refused) by _apply_pulled
        return memoryview(self._flat[b.param][b.start:b.stop]).cast("B")

    def _blocks(self) -> dict:
        if self._block_index is None or self._block_index[0] is not self.plan:
            self._block_index = (self.plan, {b.key: b for b in self.plan.blocks})
        return self._block_index[1]

    def _apply_pulled(self, pulled: list[Pulled]) -> None:
        """Copy pulled values into place, or add decoded deltas (compressed downlink), in order."""
        blocks = self._blocks()
        for entry in pulled:
            b = blocks.get(entry.key)
            if b is None:
                raise ProtocolError(f"pulled unknown key {entry.key!r}")
            if entry.placed:
                continue  # received straight into its slice (see _pull_target)
            dest = self._flat[b.param]
            if entry.delta_version:
                codec = buffers.dense_codec() if buffers.is_buffer(b.param) else self._downlink_codec()
                delta = codec.decode(entry.payload()).reshape(-1)
                if delta.size != b.stop - b.start:
                    raise ProtocolError(f"pulled a delta of {delta.size} elements for {b.key!r}, "
                                        f"expected {b.stop - b.start}")
                dest[b.start:b.stop] += delta
                continue
            if entry.nbytes != (b.stop - b.start) * DTYPE.itemsize:
                raise ProtocolError(f"pulled {entry.nbytes} bytes for {b.key!r}, "
                                    f"expected {(b.stop - b.start) * DTYPE.itemsize}")
            for offset, piece in entry.pieces:
                start = b.start + offset // DTYPE.itemsize
                arr = np.frombuffer(piece, dtype=DTYPE)
                dest[start:start + arr.size] = arr

    def _downlink_codec(self):
        if self._down_codec is None:
            from hybridfleet.codec import get_codec

            self._down_codec = get_codec(self.codec_name)
        return self._down_codec

    # --------------------------------------------------------------- metrics
    def bytes_moved(self) -> dict[str, int]:
        """Bytes this worker's client sent and received, in total and by kind of message."""
        lan = {"site_lan_bytes": (self.hub or self.link).lan_bytes} if (self.hub or self.link) else {}
        if self.client is None:
            return {"sent": 0, "received": 0, **lan}
        sent, received = dict(self.client.bytes.sent), dict(self.client.bytes.received)
        return {"sent": sum(sent.values()), "received": sum(received.values()),
                **{f"sent_{k}": v for k, v in sent.items()},
                **{f"received_{k}": v for k, v in received.items()}, **lan}

    def scan_egress(self, rows) -> dict | None:
        """In the egress test mode, search everything this worker sent so far for each of ``rows``
        (its training data, one row per first-axis entry); the result also goes into the final
        metrics record. None when the mode is off (or this worker sent nothing to the shards)."""
        if self.client is None:
            return None
        capture, counted = self.client.bytes.stop_capture()
        if capture is None:
            return None
        from hybridfleet.ps.worker.egress import scan_rows

        self._egress = {**scan_rows(capture.path.read_bytes(), np.asarray(rows)), "bytes_counted": counted}
        return self._egress

    def params_digest(self) -> str:
        """sha256 over the parameters (sorted by name): equal digests mean bit-identical models."""
        import hashlib

        h = hashlib.sha256()
        for k in sorted(self._flat):
            h.update(k.encode())
            h.update(self._flat[k].tobytes())
        return h.hexdigest()

    def report(self, step: int | None = None, **metrics) -> None:
        """Log a metrics record (collected into the run's metrics.jsonl by `hfleet run`); a final
        record (``final=True``) also carries the parameters' digest. ``step`` defaults to the pushes made."""
        step = self.step_count if step is None else step
        if self.dp is not None:
            from hybridfleet.privacy import epsilon_spent

            p = self.ps.privacy
            metrics.setdefault("dp_epsilon", round(epsilon_spent(p.noise_multiplier, self.step_count, p.delta), 6))
            metrics.setdefault("dp_delta", p.delta)
        if self.skipped_nonfinite:
            metrics.setdefault("rounds_skipped_nonfinite", self.skipped_nonfinite)
        if metrics.get("final"):
            metrics.setdefault("params_sha256", self.params_digest())
            data = sys.modules.get("hybridfleet.data.dataset")  # only when the script read a packed dataset
            if data is not None and data.opened_digests():
                metrics.setdefault("datasets", data.opened_digests())
                if data.cache_stats():
                    metrics.setdefault("data_cache", data.cache_stats())
            if self._egress is not None:
                metrics.setdefault("egress", self._egress)
        c = self.config
        record_report(step, metrics, self.framework)
        log.info("metrics", worker=c.worker_id, site=c.site, rank=c.rank, step=step,
                 elapsed_s=round(time.monotonic() - self._started, 3), **metrics, **self.bytes_moved(),
                 phase_s=self.timer.phase_totals())

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        for peer in (self.hub, self.link):
            if peer is not None:
                peer.close()
        self.hub = self.link = None
