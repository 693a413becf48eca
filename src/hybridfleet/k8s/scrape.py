"""Prometheus scrape annotations on every rendered pod template.

Each pod serves its metrics on `METRICS_PORT` (``HFLEET_METRICS_PORT``, bound on all
interfaces inside the pod) and carries the conventional ``prometheus.io/scrape``,
``prometheus.io/port`` and ``prometheus.io/path`` annotations that Prometheus's
Kubernetes service discovery examples relabel on.
"""

from __future__ import annotations

from typing import Any, Iterator

METRICS_PORT = 9464
ANNOTATIONS = {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
               "prometheus.io/path": "/metrics"}


def _pod_templates(node: Any) -> Iterator[dict]:
    """Every pod template (a mapping with ``metadata`` and a ``spec`` holding ``containers``), however nested."""
    if isinstance(node, dict):
        if isinstance(node.get("spec"), dict) and "containers" in node["spec"] and "metadata" in node:
            yield node
        for value in node.values():
            yield from _pod_templates(value)
    elif isinstance(node, list):
        for value in node:
            yield from _pod_templates(value)


def add_scrape_annotations(manifests: list[dict]) -> list[dict]:
    """Annotate every pod template for scraping and tell its containers to serve metrics on `METRICS_PORT`;
    returns ``manifests``. (Pod-level scraping needs no Service port, so Services stay as rendered.)"""
    for manifest in manifests:
        for template in _pod_templates(manifest):
            template["metadata"].setdefault("annotations", {}).update(ANNOTATIONS)
            for c in template["spec"]["containers"]:
                env = c.setdefault("env", [])
                env += [{"name": "HFLEET_METRICS_PORT", "value": str(METRICS_PORT)},
                        {"name": "HFLEET_METRICS_HOST", "value": "0.0.0.0"}]
    return manifests
