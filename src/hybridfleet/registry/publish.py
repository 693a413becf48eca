"""Publishing a finished run per the job spec's ``registry:`` block.

The gate (``require``) is checked on the run's metrics first (summary.json's, with the
final checkpoint's); only a passing run is registered, and then ``alias`` (if given) is
moved through the same gate. A refusal never fails the run: it is reported and recorded.
"""

from __future__ import annotations

from typing import Any

from hybridfleet.errors import HfleetError
from hybridfleet.obs.log import get_logger
from hybridfleet.registry import evidence, gate

log = get_logger("registry.publish")


def publish_run(spec: Any, card: dict[str, Any]) -> dict[str, Any]:
    """Register the run's model (``registry.model``: final or best) when ``registry.require`` passes.

    Returns ``{"published", "name", "version", "alias", "message", "checks"}`` for summary.json.
    """
    from hybridfleet.registry.client import open_registry

    block = spec.registry
    out: dict[str, Any] = {"published": False, "name": block.publish_as, "version": None, "alias": block.alias}
    try:
        requirements = [gate.parse_requirement(text) for text in block.require]
        metrics = {**card["lineage"].get("metrics", {}), **card["final"].get("metrics", {})}
        checks = gate.evaluate(metrics, requirements, sources={k: {"source": evidence.CHECKPOINT} for k in metrics})
        out["checks"] = [c.to_dict() for c in checks]
        if not all(c.passed for c in checks):
            out["message"] = "not published: " + "; ".join(c.reason for c in checks if not c.passed)
            log.info("publish_refused", job=spec.name, reasons=out["message"])
            return out
        reg = open_registry(block.url)
        info = reg.register_run(block.publish_as, card["url"], block.model, f"run {card['lineage']['run_id']} of job {spec.name}",
                                {"job": spec.name, "run_id": card["lineage"]["run_id"]})  # fmt: skip
        out.update(published=True, name=info.name, version=info.version)
        message = f"registered {info.name} v{info.version}"
        if block.alias:
            reg.promote(info.name, info.version, block.alias, list(block.require), reason=f"published by job {spec.name}")
            message += f" as {block.alias}"
        out["message"] = message + (f" (gate passed: {', '.join(block.require)})" if block.require else "")
    except HfleetError as err:
        out["message"] = f"not published: {err}"
        log.warning("publish_failed", job=spec.name, error=str(err))
    return out
