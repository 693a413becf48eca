"""Answered inference requests, counted per request with one lock and exposed as Prometheus series.

A request answered by `hfleet serve` adds one count (by version and HTTP code) and, when it
succeeded, one latency observation (by version). prometheus_client's Counter and Histogram
children cost three locks and a Python loop over the buckets per request; `RequestStats`
keeps plain counts under one lock, finds the bucket with `bisect`, and builds the counter
and histogram families only when /metrics is scraped. The exposition is the one
prometheus_client writes for the same Counter and Histogram with its `_created` series off
(the project's choice, `hybridfleet.obs.metrics`): these two families carry no `_created`
series (tests/test_serve_stats.py).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class RequestStats:
    """``hybridfleet_serve_requests_total`` {model, version, code} and
    ``hybridfleet_serve_request_duration_seconds`` {model, version} with ``buckets`` (seconds)."""

    def __init__(self, buckets: tuple[float, ...]):
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"histogram buckets must be strictly increasing (got {buckets})")
        self._bounds = tuple(float(b) for b in buckets)
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, str], int] = {}  # (model, version, code) -> requests
        self._buckets: dict[tuple[str, str], list[int]] = {}  # (model, version) -> per-bucket counts, +Inf last
        self._sums: dict[tuple[str, str], float] = {}

    def answered(self, model: str, version: str, code: str, seconds: float | None = None) -> None:
        """Count one request; ``seconds`` (its time in the server) also goes into the latency histogram."""
        key = (model, version, code)
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
            if seconds is not None:
                series = (model, version)
                counts = self._buckets.get(series)
                if counts is None:
                    counts = self._buckets[series] = [0] * (len(self._bounds) + 1)
                    self._sums[series] = 0.0
                counts[bisect_left(self._bounds, seconds)] += 1  # the first bucket whose bound is >= seconds
                self._sums[series] += seconds

    def collect(self) -> Iterator[Metric]:
        """The two families as a prometheus_client collector yields them."""
        with self._lock:
            counts = dict(self._counts)
            buckets = {k: list(v) for k, v in self._buckets.items()}
            sums = dict(self._sums)
        requests = CounterMetricFamily("hybridfleet_serve_requests", "Inference requests answered, by version and HTTP code",
                                       labels=["model", "version", "code"])  # fmt: skip
        for labels, n in counts.items():
            requests.add_metric(list(labels), float(n))
        yield requests
        latency = HistogramMetricFamily("hybridfleet_serve_request_duration_seconds", "Inference request time in the server",
                                        labels=["model", "version"])  # fmt: skip
        for labels, per_bucket in buckets.items():
            cumulative, total = [], 0
            for bound, n in zip((*self._bounds, float("inf")), per_bucket):
                total += n
                cumulative.append((floatToGoString(bound), float(total)))
            latency.add_metric(list(labels), cumulative, sums[labels])
        yield latency
