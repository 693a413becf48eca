"""summary.json of a parameter-server run: its status, joint and per-site metrics, bytes and restarts.

Read from what the run's processes logged (`MetricsCollector`) and how they exited; no
process is asked anything here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hybridfleet.spec.models import JobSpec

if TYPE_CHECKING:
    from hybridfleet.launch.psjob import MetricsCollector, RunLayout
    from hybridfleet.launch.supervisor import Supervisor


def _datasets_by_site(spec: JobSpec, workers: dict[str, dict]) -> dict[str, dict[str, str]]:
    """Each site's packed datasets (URL -> manifest sha256) as its workers reported reading them."""
    out: dict[str, dict[str, str]] = {s: {} for s in spec.sites}
    for rec in workers.values():
        out.setdefault(rec.get("site", "?"), {}).update(rec.get("datasets") or {})
    return out


def _privacy_by_site(spec: JobSpec, workers: dict[str, dict]) -> dict[str, dict] | None:
    """(epsilon, delta) each site spent, from its workers' final records; None without ps.privacy."""
    if spec.ps.privacy is None:
        return None
    out: dict[str, dict] = {}
    for rec in workers.values():
        if "dp_epsilon" in rec:
            site = out.setdefault(rec["site"], {"epsilon": 0.0, "delta": rec["dp_delta"]})
            site["epsilon"] = max(site["epsilon"], rec["dp_epsilon"])
    return out


def run_status(spec: JobSpec, finished: list[str]) -> tuple[str, list[str]]:
    """(status, the sites that did not train) from the workers that trained to the end.

    ``completed``: every worker finished. ``degraded``: some did not, yet at least
    ``min_sites`` sites (default: every site) each had ``min_workers_per_site`` workers finish,
    which the job declared enough. ``failed`` otherwise: a job whose site never trained does
    not pass for a joint model.
    """
    done = {site: sum(1 for n in finished if n.rsplit("-", 1)[0] == f"worker-{site}") for site in spec.sites}
    untrained = [site for site, n in done.items() if n < min(spec.min_workers_per_site, spec.sites[site].workers)]
    if len(finished) == spec.num_workers:
        return "completed", []
    trained = len(spec.sites) - len(untrained)
    if finished and trained >= (spec.min_sites or len(spec.sites)):
        return "degraded", untrained  # some workers died for good; enough of them trained to the end
    return "failed", untrained


def first_error_line(run_dir: Path, site: str, codes: dict[str, int]) -> str | None:
    """The last line of the first failed worker log of ``site`` that names an error (its cause, usually)."""
    for name in sorted(n for n, c in codes.items() if c != 0 and n.rsplit("-", 1)[0] == f"worker-{site}"):
        path = run_dir / "logs" / f"{name}.log"
        if not path.is_file():
            continue
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        if errors or lines:
            return f"{name} exited {codes[name]}: {(errors or lines)[-1][:300]}"
    return None


def _saved_model_accuracy(workers: dict[str, dict]) -> tuple[float | None, str | None]:
    """The joint metric: the test accuracy global rank 0 measured on the model it saved with the same
    final report (`ParameterServerHandle.report` saves exactly the model it was called on)."""
    for name, rec in sorted(workers.items()):
        if rec.get("rank") == 0 and "test_accuracy" in rec:
            return float(rec["test_accuracy"]), f"the saved model ({name}'s final report)"
    return None, None


def test_metrics(rec: dict) -> dict[str, float]:
    """The held-out metrics of one report: its numeric ``test_*`` values (test_accuracy, test_bpc, ...)."""
    return {k: v for k, v in sorted(rec.items())
            if k.startswith("test_") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def summarize(spec: JobSpec, layout: RunLayout, collector: MetricsCollector, codes: dict[str, int],
              sup: Supervisor, wall_s: float) -> dict:
    """summary.json: joint accuracy, each site's accuracy alone, bytes per site, restarts."""
    workers = {n: r for n, r in collector.final.items() if n.startswith("worker-")}
    baselines = {n[len("baseline-"):]: r for n, r in collector.final.items() if n.startswith("baseline-")}
    by_site_sent: dict[str, int] = {s: 0 for s in spec.sites}
    by_site_received: dict[str, int] = {s: 0 for s in spec.sites}
    by_kind: dict[str, dict[str, int]] = {s: {} for s in spec.sites}
    egress: dict[str, dict] = {}
    for rec in collector.last.values():
        if rec.get("process", "").startswith("worker-"):
            site = rec["site"]
            by_site_sent[site] += int(rec.get("sent", 0))
            by_site_received[site] += int(rec.get("received", 0))
            for key, n in rec.items():
                if key.startswith("sent_"):
                    by_kind[site][key[5:]] = by_kind[site].get(key[5:], 0) + int(n)
    for rec in collector.final.values():
        if rec.get("process", "").startswith("worker-") and isinstance(rec.get("egress"), dict):
            mine = egress.setdefault(rec["site"], {"workers_scanned": 0, "bytes_scanned": 0, "rows_scanned": 0,
                                                  "rows_found": 0})
            mine["workers_scanned"] += 1
            for key in ("bytes_scanned", "rows_scanned", "rows_found"):
                mine[key] += int(rec["egress"].get(key, 0))
    accs = [r["test_accuracy"] for r in workers.values() if "test_accuracy" in r]
    # a worker reports the rows of its own share; the job trained on the sum over its workers
    rows_by_site = {s: sum(int(r["train_rows"]) for r in workers.values() if r.get("site") == s and "train_rows" in r)
                    for s in spec.sites}
    joint, joint_source = _saved_model_accuracy(workers)
    if joint is None and accs:
        joint, joint_source = min(accs), "the worst worker's evaluation (the saving worker reported none)"
    restarts = sum(1 for e in sup.events if e.get("event") == "restart")
    worker_codes = {n: c for n, c in codes.items() if n.startswith("worker-")}
    finished = [n for n, c in worker_codes.items() if c == 0 and n in workers]
    status, untrained = run_status(spec, finished)
    return {
        "job": spec.name, "framework": spec.framework, "sync": spec.ps.sync, "shards": spec.ps.shards,
        "workers": spec.num_workers, "status": status,
        "untrained_sites": {site: first_error_line(layout.run_dir, site, codes) for site in untrained},
        "test_accuracy": round(joint, 5) if joint is not None else None,  # the saved model's
        "test_accuracy_source": joint_source,
        "test_accuracy_by_worker": {n: r["test_accuracy"] for n, r in sorted(workers.items()) if "test_accuracy" in r},
        "site_alone_accuracy": {s: r.get("test_accuracy") for s, r in sorted(baselines.items())},
        # every held-out metric (test_bpc as well as test_accuracy): the saved model's, and each site alone
        "joint_metrics": next((test_metrics(r) for _, r in sorted(workers.items()) if r.get("rank") == 0), {}),
        "site_alone_metrics": {s: test_metrics(r) for s, r in sorted(baselines.items())},
        **({"train_rows": sum(rows_by_site.values()), "train_rows_by_site": rows_by_site}
           if any(rows_by_site.values()) else {}),
        "bytes_sent_by_site": by_site_sent, "bytes_received_by_site": by_site_received,
        "bytes_sent_by_kind": by_kind, **({"egress_scan": egress} if egress else {}),
        "privacy_by_site": _privacy_by_site(spec, workers), "datasets_by_site": _datasets_by_site(spec, workers),
        "restarts": restarts, "exit_codes": codes, "wall_s": round(wall_s, 2),
        "run_dir": str(layout.run_dir), "resumed_from": str(layout.resume_from) if layout.resume_from else None,
    }
