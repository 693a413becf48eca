"""What a job's ``ps.secure_aggregation`` resolves to, and the combinations it refuses.

The ring's width and scale depend on how many pushers can add into one sum: one leader
per site that aggregates (``sites.<x>.aggregate: true`` with several workers), every
worker elsewhere. Both the pushers and the shards derive the same settings from the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from hybridfleet.ps.secagg import graph
from hybridfleet.ps.secagg.ring import check_resolution

SIXTEEN_BIT_CODECS = ("fp16", "bf16", "int8", "int4")
MASKABLE_CODECS = ("none", "fp16", "bf16", "int8", "int4", "randomk")
MASKABLE_RULES = ("mean", "norm_clip")
MASKABLE_SYNC = ("bsp", "local")


def default_bits(compression) -> int:
    """16 for the 16-, 8- and 4-bit codecs (and random-k with float16 values), else 32."""
    if compression.codec in SIXTEEN_BIT_CODECS:
        return 16
    if compression.codec == "randomk" and compression.value_dtype == "float16":
        return 16
    return 32


def default_threshold(roster_size: int) -> int:
    """floor(2n/3) + 1 of a roster of n (at most n)."""
    return min(roster_size, (2 * roster_size) // 3 + 1)


def pusher_ids(sites: dict) -> list[str]:
    """The worker ids that push to the shards: site leaders where a site aggregates, every worker elsewhere."""
    ids = []
    for name, site in sites.items():
        ranks = 1 if site.aggregate and site.workers > 1 else site.workers
        ids.extend(f"{name}-{r}" for r in range(ranks))
    return sorted(ids)


def check_ps(ps) -> None:
    """ValueError naming the field when ``ps`` combines secure aggregation with what cannot be masked."""
    c = ps.compression
    if c.codec not in MASKABLE_CODECS:
        raise ValueError(f"secure_aggregation: codec {c.codec!r} keeps different coordinates on each pusher, so "
                         f"pairwise masks cannot cancel; use one of {', '.join(MASKABLE_CODECS)} (randomk keeps "
                         "the same coordinates everywhere)")
    if c.codec == "randomk" and (c.momentum or c.warmup_steps):
        raise ValueError("secure_aggregation: randomk's momentum and warmup_steps are not supported with secure "
                         "aggregation; remove them")
    if ps.aggregate.rule not in MASKABLE_RULES:
        raise ValueError(f"secure_aggregation: aggregate rule {ps.aggregate.rule} needs each pusher's update in the "
                         f"clear; only {' and '.join(MASKABLE_RULES)} compose with masking (norm_clip clips on the "
                         "pusher before masking)")
    if ps.sync not in MASKABLE_SYNC:
        raise ValueError(f"secure_aggregation: needs rounds that close together (sync: bsp or local); sync is "
                         f"{ps.sync!r}")


def check_job(job) -> None:
    """ValueError when the job's pushers cannot share the configured ring (count, threshold, resolution)."""
    sa = job.ps.secure_aggregation
    pushers = len(pusher_ids(job.sites))
    if pushers < 2:
        raise ValueError(f"ps.secure_aggregation: the job has {pushers} pusher; secure aggregation hides one "
                         "update among others and needs at least 2")
    if sa.threshold is not None and sa.threshold > pushers:
        raise ValueError(f"ps.secure_aggregation.threshold: {sa.threshold} exceeds the job's {pushers} pushers")
    try:
        graph.choose(pushers, sa.dropout_rate, sa.collusion_fraction, sa.security_bits, sa.correctness_bits,
                     sa.degree, sa.threshold, sa.malicious_shard)
    except ValueError as err:
        raise ValueError(f"ps.secure_aggregation: {err}") from None
    bits = sa.bits or default_bits(job.ps.compression)
    try:
        check_resolution(bits, pushers)
    except ValueError as err:
        raise ValueError(f"ps.secure_aggregation.bits: {err}") from None


@lru_cache(maxsize=256)
def _graph_for(roster_size: int, dropout_rate: float, collusion_fraction: float, security_bits: int,
               correctness_bits: int, degree: int | None, threshold: int | None,
               malicious_shard: bool) -> graph.GraphParams:
    try:
        return graph.choose(roster_size, dropout_rate, collusion_fraction, security_bits, correctness_bits,
                            degree, threshold, malicious_shard)
    except ValueError:
        t = threshold if threshold is not None else default_threshold(roster_size)
        return graph.GraphParams(roster_size, roster_size - 1, t)


@dataclass(frozen=True)
class SecAggSettings:
    """The resolved ring and threshold rule for one job."""

    bits: int
    clip: float
    limit: int                 # L: the largest integer one pusher sends
    threshold: int | None      # None: default_threshold(roster size)
    pushers: tuple[str, ...]   # the job's pusher ids
    randomk_ratio: float | None = None  # shared-seed random-k: the kept fraction
    degree: int | None = None            # None: graph.choose's default
    dropout_rate: float = 0.1
    collusion_fraction: float = 0.1
    security_bits: int = 40
    correctness_bits: int = 20
    malicious_shard: bool = False

    @classmethod
    def resolve(cls, ps, sites: dict) -> "SecAggSettings":
        sa = ps.secure_aggregation
        ids = tuple(pusher_ids(sites))
        bits = sa.bits or default_bits(ps.compression)
        return cls(bits=bits, clip=sa.clip, limit=check_resolution(bits, len(ids)), threshold=sa.threshold,
                   pushers=ids, randomk_ratio=ps.compression.ratio if ps.compression.codec == "randomk" else None,
                   degree=sa.degree, dropout_rate=sa.dropout_rate, collusion_fraction=sa.collusion_fraction,
                   security_bits=sa.security_bits, correctness_bits=sa.correctness_bits,
                   malicious_shard=sa.malicious_shard)

    def graph_for(self, roster_size: int) -> graph.GraphParams:
        """The neighbour graph's degree and threshold for a roster of ``roster_size`` pushers.

        The job's pushers meet the bounds (`check_job`); a roster shrunk by evictions that no
        longer does falls back to the complete graph with the configured (or default) threshold,
        which never holds fewer shares per pusher."""
        return _graph_for(roster_size, self.dropout_rate, self.collusion_fraction, self.security_bits,
                          self.correctness_bits, self.degree, self.threshold, self.malicious_shard)

    def threshold_for(self, roster_size: int) -> int:
        return self.graph_for(roster_size).threshold

    @property
    def codec_name(self) -> str:
        """What a masked push names as its codec (its payloads are raw ring vectors)."""
        return f"secagg{self.bits}"
