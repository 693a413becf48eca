"""The job file's models. Unknown keys are errors everywhere (``extra="forbid"``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SiteSpec(_Strict):
    """A place where workers run and where their data lives (the data never leaves it)."""

    workers: int = Field(1, ge=1, description="number of worker processes at this site")
    data: str | None = Field(None, description="the site's data: a path, URL or a named example split")
    aggregate: bool = Field(False, description="reduce gradients inside the site first; one leader pushes")
    netns: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$",
                              description="run this site's workers in this network namespace (`hfleet run` only)")
    framework: Literal["torch", "paddle"] | None = Field(
        None, description="this site's own framework (default: the job's); parameters travel in the job's layout")
    entrypoint: str | None = Field(None, description="this site's own training script (default: the job's)")


class OptimizerSpec(_Strict):
    """The server-side optimizer that applies aggregated gradients."""

    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    nesterov: bool = False
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> "OptimizerSpec":
        if self.nesterov and (self.name != "sgd" or self.momentum <= 0):
            raise ValueError("nesterov: needs name: sgd and momentum > 0")
        return self


class CompressionSpec(_Strict):
    """How workers compress what they push (agreed with the server at join)."""

    codec: Literal["none", "fp16", "bf16", "int8", "topk", "randomk", "sign", "int4", "powersgd"] = "none"
    ratio: float = Field(0.01, gt=0, le=1, description="fraction of elements kept by topk/randomk")
    value_dtype: Literal["float32", "float16"] = Field("float32", description="topk/randomk: how kept values travel")
    error_feedback: bool = True
    momentum: float = Field(0.0, ge=0, lt=1, description="topk/randomk: DGC momentum correction on the worker "
                                                         "(use with server-side plain SGD)")
    warmup_steps: int = Field(0, ge=0, description="topk/randomk: density falls from dense to ratio over these steps")
    rank: int = Field(4, ge=1, le=1024, description="powersgd: the rank of each matrix's factors "
                                                   "(min(rank, rows, cols); dense where factors would not save bytes)")

    @model_validator(mode="after")
    def _sparse_only_options(self) -> "CompressionSpec":
        for name in ("momentum", "warmup_steps"):
            if getattr(self, name) and self.codec not in ("topk", "randomk"):
                raise ValueError(f"{name}: only applies to codec topk or randomk (codec is {self.codec!r})")
        if (self.momentum or self.warmup_steps) and not self.error_feedback:
            raise ValueError("error_feedback: momentum correction and warm-up need error_feedback: true")
        if "rank" in self.model_fields_set and self.codec != "powersgd":
            raise ValueError(f"rank: only applies to codec powersgd (codec is {self.codec!r})")
        if self.codec == "powersgd" and not self.error_feedback:
            raise ValueError("error_feedback: powersgd is biased and needs error_feedback: true")
        return self


class AggregateSpec(_Strict):
    """How a shard combines one round's updates (`hybridfleet.ps.aggregate`); a bare rule name is accepted."""

    rule: Literal["mean", "median", "trimmed_mean", "norm_clip"] = "mean"
    trim_fraction: float = Field(0.2, gt=0, lt=0.5, description="trimmed_mean: fraction dropped at each end")
    clip_norm: float | None = Field(None, gt=0, description="norm_clip: each contribution's L2 bound on a shard")

    @model_validator(mode="before")
    @classmethod
    def _bare_rule(cls, data):
        return {"rule": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _clip_needs_norm(self) -> "AggregateSpec":
        if self.rule == "norm_clip" and self.clip_norm is None:
            raise ValueError("clip_norm: rule norm_clip needs clip_norm > 0 (the L2 bound of one contribution)")
        return self


class PrivacySpec(_Strict):
    """Differential privacy of each push: L2 clipping + Gaussian noise, with an accountant (docs/PRIVACY.md)."""

    clip_norm: float = Field(..., gt=0, description="L2 bound of one push's whole update")
    noise_multiplier: float = Field(..., gt=0, description="noise std / clip_norm")
    delta: float = Field(1e-5, gt=0, lt=1)
    epsilon_budget: float | None = Field(None, gt=0, description="stop training before epsilon exceeds this")


class SecureAggregationSpec(_Strict):
    """Masking of every push so a shard recovers only the round's sum (docs/PRIVACY.md); ``true`` takes the defaults."""

    bits: Literal[16, 32] | None = Field(None, description="ring width; default 16 for fp16/bf16/int8, else 32")
    clip: float = Field(1.0, gt=0, description="each pushed coordinate is clipped to [-clip, clip] before "
                                               "quantisation (after DP noise)")
    threshold: int | None = Field(None, ge=2, description="Shamir threshold t: share holders (a pusher and its "
                                                          "neighbours) that must answer to unmask it; default: "
                                                          "floor(2n/3)+1 on the complete graph, else the middle of "
                                                          "the thresholds the bounds admit")
    degree: int | None = Field(None, ge=2, description="neighbours per pusher in the SecAgg+ graph (even; >= n-1: "
                                                       "complete); default: complete below 50 pushers, else the "
                                                       "smallest degree the bounds admit")
    dropout_rate: float = Field(0.1, ge=0, lt=1, description="fraction of a round's pushers that may drop out")
    collusion_fraction: float = Field(0.1, ge=0, lt=1, description="fraction of pushers that may collude with "
                                                                   "a shard")
    security_bits: int = Field(40, ge=1, le=128, description="privacy holds except with probability "
                                                             "2^-security_bits")
    correctness_bits: int = Field(20, ge=1, le=128, description="a round within dropout_rate unmasks except with "
                                                                "probability 2^-correctness_bits")
    malicious_shard: bool = Field(False, description="also bound a shard that tells survivors different stories "
                                                     "about who dropped out (threshold t > (k + 2 + colluders) / 2)")


class PSSpec(_Strict):
    """Parameter-server settings."""

    shards: int = Field(1, ge=1)
    sync: Literal["bsp", "ssp", "asp", "local"] = Field(
        "bsp", description="bsp/ssp/asp: the shards apply `optimizer` to every step's gradients; local: local SGD "
                           "(DiLoCo), workers take `local_steps` steps with the script's own optimizer, then the "
                           "shards apply the averaged pseudo-gradient with `optimizer` as the outer optimizer")
    local_steps: int | None = Field(None, ge=1, description="sync local: inner steps between outer rounds (H; "
                                                            "default 50)")
    staleness_bound: int = Field(2, ge=0, description="SSP: how many steps a worker may run ahead of the slowest")
    optimizer: OptimizerSpec = OptimizerSpec()
    buffers: Literal["average", "local", "broadcast"] = Field(
        "average", description="model buffers (BatchNorm running statistics, counters): average: the round's "
                               "sample-weighted mean (FedAvg over the state dict); local: each site keeps its own "
                               "(FedBN); broadcast: rank 0's (DDP's broadcast_buffers)")
    compression: CompressionSpec = CompressionSpec()
    aggregate: AggregateSpec = Field(AggregateSpec(), description="mean | median | trimmed_mean | norm_clip")
    privacy: PrivacySpec | None = Field(None, description="differential privacy of every push")
    secure_aggregation: SecureAggregationSpec | None = Field(
        None, description="mask pushes so each shard sees only the round's sum (true: defaults)")
    heartbeat_interval_s: float = Field(1.0, gt=0)
    heartbeat_timeout_s: float = Field(10.0, gt=0)
    block_size_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="tensors above this are split across shards")
    max_push_bytes: int = Field(1 << 30, ge=1024)
    host: str = "127.0.0.1"
    base_port: int = Field(0, ge=0, le=65535, description="first shard port; 0 picks free ports")
    transport: Literal["auto", "grpc"] = Field(
        "auto", description="auto: tensor bytes on each shard's bulk TLS socket, control on gRPC; "
                            "grpc: everything on gRPC (one port per shard, e.g. behind a gRPC proxy)")
    overlap: Literal["auto", "on", "off"] = Field(
        "auto", description="on: as each gradient is ready during backward(), a background stage copies it to "
                            "host, cuts it into the plan's blocks and encodes them, where the job's path allows it; "
                            "ps.step() reuses that work unless the gradient changed after backward (then it is "
                            "redone, with the same result); auto: on when the model's parameters live on an "
                            "accelerator, off when they are on the CPU (backward and the stage would share its "
                            "cores); off: everything happens in ps.step()")
    snapshot_every_s: float | None = Field(None, gt=0)
    snapshot_every_steps: int | None = Field(None, ge=1)
    max_tensors: int = Field(10_000, ge=1, description="a Join declaring more tensors is refused")
    max_model_bytes: int = Field(2 << 30, ge=1024, description="a Join declaring a larger model is refused")
    memory_budget_bytes: int = Field(
        2 << 30, ge=1 << 20, description="push bytes a shard holds in flight at once, all peers together, "
                                         "plus its compressed downlink's delta log (at most half of it)")
    init_site: str | None = Field(
        None, description="the site whose first worker pushes the initial values to the shards (default: the "
                          "first site), e.g. the site next to the shards, so they never cross a slow link")

    @model_validator(mode="before")
    @classmethod
    def _outer_optimizer_default(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("sync") == "local":
            from hybridfleet.spec.rules import LOCAL_STEPS_DEFAULT, OUTER_OPTIMIZER_DEFAULT

            data = {"optimizer": dict(OUTER_OPTIMIZER_DEFAULT), **data}
            if data.get("local_steps") is None:
                data["local_steps"] = LOCAL_STEPS_DEFAULT
        return data

    @model_validator(mode="after")
    def _sync_and_optimizer_agree(self) -> "PSSpec":
        from hybridfleet.spec.rules import check_sync_optimizer

        check_sync_optimizer(self)
        return self

    @model_validator(mode="after")
    def _timeout_after_interval(self) -> "PSSpec":
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s: must be greater than heartbeat_interval_s "
                f"({self.heartbeat_timeout_s} <= {self.heartbeat_interval_s})"
            )
        return self

    @field_validator("secure_aggregation", mode="before")
    @classmethod
    def _secagg_flag(cls, value: object) -> object:
        return ({} if value else None) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _secagg_maskable(self) -> "PSSpec":
        if self.secure_aggregation is not None:
            from hybridfleet.ps.secagg.settings import check_ps

            check_ps(self)
        return self

    @model_validator(mode="after")
    def _robust_rules_need_rounds(self) -> "PSSpec":
        if self.aggregate.rule != "mean" and self.sync != "bsp":
            raise ValueError(f"aggregate: rule {self.aggregate.rule} combines the updates of one round; "
                             f"it needs sync: bsp (sync is {self.sync!r})")
        return self


class CollectiveSpec(_Strict):
    """Collective (AllReduce) data-parallel settings."""

    nproc_per_node: int = Field(1, ge=1)
    nnodes: str = Field("1", pattern=r"^\d+(:\d+)?$", description="N or MIN:MAX for elastic")


class TrainSpec(_Strict):
    """What the entrypoint is asked to do (passed to it as HFLEET_* settings)."""

    steps: int = Field(100, ge=1)
    batch_size: int = Field(32, ge=1)
    seed: int = 0
    eval_every_steps: int = Field(0, ge=0)
    site_baselines: bool = Field(False, description="also train each site alone, for comparison in summary.json")


class CheckpointSpec(_Strict):
    """Checkpoint cadence, retention and where they are stored."""

    every_steps: int | None = Field(None, ge=1)
    every_s: float | None = Field(None, gt=0)
    keep_last: int = Field(3, ge=1)
    keep_best: str | None = Field(None, pattern=r"^[^:\s]+(:(min|max))?$",
                                  description="METRIC (higher is better) or METRIC:min; the best checkpoint by it is kept too")
    store: str = Field("runs/checkpoints", description="a path, file:///abs/dir or s3://bucket/prefix")


class SecuritySpec(_Strict):
    """Transport security and authentication (on by default)."""

    tls: Literal["auto", "off"] | str = Field("auto", description="auto: per-job dev CA; off: plaintext; or a cert dir")
    mutual_tls: bool = False
    tokens: Literal["auto", "off"] = "auto"
    token_ttl_s: float = Field(3600, gt=0, description="token lifetime; `hfleet run` renews at half of it")

    @field_validator("tls", "tokens", mode="before")
    @classmethod
    def _off_is_a_string(cls, value: object, info) -> object:
        if isinstance(value, bool):  # YAML reads an unquoted off/on/no/yes as a boolean
            raise ValueError(f'write {info.field_name}: "off" (quoted); unquoted, YAML reads it as the boolean {value}')
        return value


class RegistrySpec(_Strict):
    """Publish the run's model to the model registry when the gate passes (`hybridfleet.registry.publish`)."""

    publish_as: str | None = Field(None, description="[NAMESPACE/]NAME to register the model as; unset: no publishing")
    require: list[str] = Field([], description="gate: METRIC OP NUMBER each, e.g. test_accuracy>=0.95")
    url: str | None = Field(None, description="registry: http(s)://server, sqlite:///PATH or postgresql://...; "
                                              "default $HFLEET_REGISTRY or the local registry")
    model: Literal["final", "best"] = Field("final", description="which of the run's models to publish")
    alias: str | None = Field(None, description="also move this alias to the new version through the same gate")


class ResourcesSpec(_Strict):
    """Per-process resources (Kubernetes requests/limits; GPU checks)."""

    cpu: float = Field(1.0, gt=0)
    memory: str = Field("2Gi", pattern=r"^\d+(\.\d+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$")
    gpus: int = Field(0, ge=0)
    shm: str = Field("1Gi", pattern=r"^\d+(\.\d+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$")


class EnvironmentSpec(_Strict):
    """The pinned environment: framework version, device flavour, lock, image."""

    version: str | None = Field(None, description="framework version; default: the one installed")
    device: Literal["cpu", "gpu"] = "cpu"
    cuda: str | None = Field(None, pattern=r"^\d+\.\d+$")
    lock: str | None = Field(None, description="path of an hfleet.lock.json")
    image: str | None = Field(None, description="image reference (repo:tag or repo@sha256:...)")
    registry: str | None = Field(None, description="image repository to tag built images with")


class JobSpec(_Strict):
    """A whole job: what to train, where, and how."""

    name: str = Field(..., pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=53)
    framework: Literal["torch", "paddle"]
    entrypoint: str
    args: list[str] = []
    mode: Literal["ps", "collective"] = "ps"
    sites: dict[str, SiteSpec] = {"local": SiteSpec()}
    ps: PSSpec = PSSpec()
    collective: CollectiveSpec = CollectiveSpec()
    train: TrainSpec = TrainSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    security: SecuritySpec = SecuritySpec()
    registry: RegistrySpec = RegistrySpec()
    resources: ResourcesSpec = ResourcesSpec()
    environment: EnvironmentSpec = EnvironmentSpec()
    max_restarts: int = Field(0, ge=0)
    min_sites: int | None = Field(None, ge=1, description="sites that must train to the end for a run with lost "
                                  "workers to count as degraded rather than failed (default: every site)")
    min_workers_per_site: int = Field(1, ge=1, description="workers of a site that must train to the end for "
                                      "the site to count as trained")
    run_dir: str = "runs"

    @model_validator(mode="after")
    def _sites_named_and_present(self) -> "JobSpec":
        if not self.sites:
            raise ValueError("sites: needs at least one site, e.g. {local: {workers: 1}}")
        for site in self.sites:
            if not site.replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"sites.{site}: site names use letters, digits, - and _ only")
        from hybridfleet.spec.rules import check_site_frameworks

        check_site_frameworks(self)
        if self.min_sites is not None and self.min_sites > len(self.sites):
            raise ValueError(f"min_sites: must be at most the number of sites ({len(self.sites)}; got {self.min_sites})")
        if self.ps.init_site is not None and self.ps.init_site not in self.sites:
            raise ValueError(f"ps.init_site: {self.ps.init_site!r} is not a site of this job "
                             f"(sites: {', '.join(self.sites)})")
        if self.environment.cuda and self.environment.device != "gpu":
            raise ValueError("environment.cuda: set environment.device: gpu too (or drop cuda)")
        if self.ps.secure_aggregation is not None:
            from hybridfleet.ps.secagg.settings import check_job

            check_job(self)
        return self

    def site_entrypoint(self, site: str) -> str:
        """The training script the workers of ``site`` run."""
        return self.sites[site].entrypoint or self.entrypoint

    @property
    def num_workers(self) -> int:
        """Workers over all sites."""
        return sum(s.workers for s in self.sites.values())
