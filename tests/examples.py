"""The shipped example jobs as dicts with absolute paths, for tests that change and run them."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
HYBRID_DEMO = {"torch": "digits-hybrid.yaml", "paddle": "digits-hybrid-paddle.yaml"}


def example_job(example: str) -> dict:
    """``examples/<example>`` with its entrypoint and shipped site datasets as absolute paths."""
    data = yaml.safe_load((REPO / "examples" / example).read_text())
    data["entrypoint"] = str(REPO / data["entrypoint"])
    for site in data["sites"].values():  # packed site datasets ship in the repository
        if (REPO / str(site.get("data"))).exists():
            site["data"] = str(REPO / site["data"])
    return data


def hybrid_demo(framework: str) -> dict:
    """The demo hybrid job of ``framework`` (torch or paddle)."""
    return example_job(HYBRID_DEMO[framework])
