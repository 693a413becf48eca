"""`RequestStats` writes the exposition prometheus_client writes for the same Counter and Histogram
(with `_created` series off, as `hybridfleet.obs.metrics` runs prometheus_client)."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

import hybridfleet.obs.metrics  # noqa: F401 - turns prometheus_client's _created series off, as the project runs
from hybridfleet.serve.server import LATENCY_BUCKETS_S, ServeMetrics
from hybridfleet.serve.stats import RequestStats

# (version, code, seconds or None): bucket bounds hit exactly, between them, past the last one, and refusals
OBSERVED = [("1", "200", 0.0005), ("1", "200", 0.00051), ("1", "200", 0.0031), ("2", "200", 7.5), ("1", "400", None),
            ("2", "503", None), ("1", "200", 0.0), ("2", "200", 0.02), ("1", "200", 1.0), ("", "400", None)]


def _reference(observed) -> str:
    registry = CollectorRegistry()
    requests = Counter("hybridfleet_serve_requests_total", "Inference requests answered, by version and HTTP code",
                       ["model", "version", "code"], registry=registry)
    latency = Histogram("hybridfleet_serve_request_duration_seconds", "Inference request time in the server",
                        ["model", "version"], buckets=LATENCY_BUCKETS_S, registry=registry)
    for version, code, seconds in observed:
        requests.labels("digits", version, code).inc()
        if seconds is not None:
            latency.labels("digits", version).observe(seconds)
    return generate_latest(registry).decode()


def _ours(observed) -> str:
    registry = CollectorRegistry()
    stats = RequestStats(LATENCY_BUCKETS_S)
    registry.register(stats)
    for version, code, seconds in observed:
        stats.answered("digits", version, code, seconds)
    return generate_latest(registry).decode()


def test_the_exposition_equals_prometheus_clients_counter_and_histogram():
    ours, reference = _ours(OBSERVED), _reference(OBSERVED)
    assert ours == reference
    assert "_created" not in ours
    assert 'hybridfleet_serve_request_duration_seconds_bucket{le="0.0005",model="digits",version="1"} 2.0' in ours
    assert 'hybridfleet_serve_request_duration_seconds_bucket{le="+Inf",model="digits",version="2"} 2.0' in ours


def test_counts_from_many_threads_add_up():
    stats = RequestStats(LATENCY_BUCKETS_S)

    def hammer():
        for _ in range(2000):
            stats.answered("digits", "1", "200", 0.001)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    registry = CollectorRegistry()
    registry.register(stats)
    text = generate_latest(registry).decode()
    assert 'hybridfleet_serve_requests_total{code="200",model="digits",version="1"} 8000.0' in text
    assert 'hybridfleet_serve_request_duration_seconds_count{model="digits",version="1"} 8000.0' in text


def test_buckets_that_do_not_increase_are_refused():
    with pytest.raises(ValueError, match=r"strictly increasing \(got \(0.1, 0.1\)\)"):
        RequestStats((0.1, 0.1))


def test_the_server_registry_exposes_the_request_series():
    metrics = ServeMetrics()
    metrics.requests.answered("digits", "3", "200", 0.004)
    text = generate_latest(metrics.registry).decode()
    assert 'hybridfleet_serve_requests_total{code="200",model="digits",version="3"} 1.0' in text
    assert 'hybridfleet_serve_request_duration_seconds_bucket{le="0.005",model="digits",version="3"} 1.0' in text
