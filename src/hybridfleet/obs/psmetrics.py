"""Scrape-time collectors over the parameter server's own state.

A shard already keeps its version, membership and push counts, and a worker's client
already counts its bytes; these collectors read them when Prometheus scrapes, so the
training hot path pays nothing for them. They read attributes only (duck-typed), so
this module imports nothing from `hybridfleet.ps`.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hybridfleet.obs.metrics import WorkerMetrics, counter, gauge, process_metrics

_DIRECTIONS = {"sent": "uplink", "received": "downlink"}


def worker_families(session: Any, raw_gradient_bytes: int) -> Iterator:
    """Bytes per direction, kind and codec; compression ratio; the worker's clock."""
    client = session.client
    codec = str(session.codec_name)
    moved = CounterMetricFamily("hybridfleet_worker_bytes", "Bytes this worker moved over the WAN, by direction "
                                "(uplink, downlink), kind (gradients, params, control, framing, init) and codec",
                                labels=["direction", "kind", "codec"])
    encoded = 0
    if client is not None:
        with client.bytes.lock:
            counts = {d: dict(getattr(client.bytes, d)) for d in _DIRECTIONS}
        for direction, by_kind in counts.items():
            for kind, n in sorted(by_kind.items()):
                moved.add_metric([_DIRECTIONS[direction], kind, codec], n)
        encoded = counts["sent"].get("gradients", 0)
        yield gauge("hybridfleet_worker_clock", "This worker's push clock (its step count at the shards)",
                    client.clock)
    yield moved
    peer = session.hub or session.link
    if peer is not None:
        yield counter("hybridfleet_worker_site_lan_bytes", "Bytes moved inside the site for site aggregation",
                      peer.lan_bytes)
    yield counter("hybridfleet_worker_gradient_raw_bytes", "float32 gradient bytes before the codec",
                  raw_gradient_bytes)
    if encoded and raw_gradient_bytes:
        yield gauge("hybridfleet_worker_compression_ratio", "float32 gradient bytes per byte pushed (uplink)",
                    raw_gradient_bytes / encoded)


def watch_worker(session: Any) -> None:
    """Export ``session``'s byte counters and clock from this process's metrics."""
    metrics = process_metrics()
    group = metrics.group(WorkerMetrics)
    try:
        metrics.add_collector(lambda: worker_families(session, group.gradient_raw_bytes))
    except ValueError:  # a second session in one process (tests with several workers): the first one is exported
        pass


def shard_families(state: Any) -> Iterator:
    """Rounds, pushes, membership, staleness and downlink compression of one shard."""
    with state.cond:
        version, applied = state.version, state.applied_pushes
        clocks = [m.clock for m in state.members.values() if m.alive]
        members = len(state.members)
        dense, encoded = state.downlink_dense_bytes, state.downlink_encoded_bytes
        secagg = getattr(state, "secagg", None)
        secure = (secagg.unmasked_rounds, secagg.dropped_pushers, len(secagg.roster)) if secagg is not None else None
    yield counter("hybridfleet_shard_rounds", "Versions this shard applied (BSP: rounds; SSP/ASP: pushes)", version)
    yield counter("hybridfleet_shard_applied_pushes", "Pushes this shard accepted", applied)
    live = GaugeMetricFamily("hybridfleet_shard_members", "Workers that joined this shard, live or timed out",
                             labels=["state"])
    live.add_metric(["live"], len(clocks))
    live.add_metric(["lost"], members - len(clocks))
    yield live
    yield gauge("hybridfleet_shard_staleness_steps", "Clock of the fastest live worker minus the slowest's",
                (max(clocks) - min(clocks)) if clocks else 0)
    if secure is not None:
        yield counter("hybridfleet_shard_secagg_rounds", "Rounds this shard unmasked (secure aggregation)", secure[0])
        yield counter("hybridfleet_shard_secagg_dropped", "Pushers a round was unmasked without (dropped before "
                      "pushing)", secure[1])
        yield gauge("hybridfleet_shard_secagg_roster", "Pushers in this shard's secure-aggregation roster", secure[2])
    if dense:
        yield gauge("hybridfleet_shard_downlink_compression_ratio", "Dense delta bytes per encoded byte sent down",
                    dense / max(encoded, 1))


def watch_shard(state: Any) -> None:
    """Export ``state`` from this process's metrics."""
    process_metrics().add_collector(lambda: shard_families(state))
