"""The Grafana dashboard's every panel query returns data for the demo job from the real Prometheus,
and the provisioning files point Grafana at that dashboard and datasource."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

GRAFANA = Path(__file__).resolve().parents[1] / "deploy" / "grafana"


def _panels() -> list[dict]:
    return json.loads((GRAFANA / "dashboards" / "hybridfleet.json").read_text())["panels"]


def test_every_panel_query_returns_data_for_the_demo_job(demo_run):
    # Prepare
    job = demo_run.summary["job"]
    start, end = demo_run.started, demo_run.finished
    empty = []
    for panel in _panels():
        for target in panel["targets"]:
            expr = target["expr"].replace("$job", job).replace("$__rate_interval", "5s")
            # Execute
            series = demo_run.prometheus.query_range(expr, start, end, step_s=1)
            # Assert (collected, so one failure names every empty panel)
            values = [float(v) for s in series for _, v in s["values"] if v not in ("NaN", "+Inf", "-Inf")]
            if not values:
                empty.append(panel["title"])
    assert not empty, f"panels without data for {job}: {empty}"


def test_provisioning_names_the_dashboard_uid_and_datasource_the_panels_use():
    # Prepare
    dashboard = json.loads((GRAFANA / "dashboards" / "hybridfleet.json").read_text())
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "hybridfleet.yaml").read_text())
    # Execute
    uids = {p["datasource"]["uid"] for p in dashboard["panels"]}
    # Assert
    assert uids == {d["uid"] for d in datasources["datasources"]} == {"hybridfleet-prometheus"}
    assert datasources["datasources"][0]["type"] == "prometheus"
    assert providers["providers"][0]["type"] == "file"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert dashboard["templating"]["list"][0]["name"] == "job"
