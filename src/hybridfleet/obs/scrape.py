"""Read the ``/metrics`` of a run's processes (the live view and `hfleet ui` use it)."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from hybridfleet.obs.discovery import Target

SCRAPE_TIMEOUT_S = 1.0


@dataclass
class Sample:
    """One series' value from one target."""

    name: str
    labels: dict[str, str]
    value: float


@dataclass
class Scraped:
    """What one target exported at one moment (``up`` False when it did not answer)."""

    target: Target
    up: bool
    samples: list[Sample] = field(default_factory=list)

    def value(self, name: str, default: float = 0.0, **labels: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``labels``."""
        found = [s.value for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        return sum(found) if found else default


def scrape_one(target: Target, timeout_s: float = SCRAPE_TIMEOUT_S) -> Scraped:
    """GET ``http://<address>/metrics`` and parse it; a target that does not answer is ``up=False``."""
    try:
        with urllib.request.urlopen(f"http://{target.address}/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", "replace")
    except OSError:
        return Scraped(target, up=False)
    samples = [Sample(s.name, dict(s.labels), float(s.value))
               for family in text_string_to_metric_families(text) for s in family.samples]
    return Scraped(target, up=True, samples=samples)


def scrape_all(targets: list[Target], timeout_s: float = SCRAPE_TIMEOUT_S) -> list[Scraped]:
    """Scrape every target in parallel."""
    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        return list(pool.map(lambda t: scrape_one(t, timeout_s), targets))
