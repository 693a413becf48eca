"""Fixtures of the serve tests: a registry with two exported digits versions, and a live `hfleet serve`."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from hybridfleet.registry import Registry
from hybridfleet.serve.export import export_version
from tests.serve_models import DIGITS_FACTORY, trained_digits


def exported_registry(tmp_path: Path, framework: str = "torch", fmt: str = "onnx") -> Registry:
    """digits v1 and v2 (two seeds, a few training steps each), both exported as ``fmt``; prod -> v1."""
    reg = Registry(f"sqlite:///{tmp_path}/registry.db")
    factory = f"{DIGITS_FACTORY}:build_{'paddle' if fmt == 'paddle-inference' else 'torch'}"
    for seed in (0, 1):
        info = reg.register("digits", trained_digits(tmp_path / f"run-{seed}", framework, seed=seed))
        export_version(reg, f"digits@{info.version}", fmt, tmp_path / f"export-{info.version}", factory)
    reg.move_alias("digits", "prod", 1)
    return reg


def reader_token(reg: Registry, name: str = "svc") -> str:
    token = reg.add_principal(name, "service")
    reg.grant(name, "reader", "default/digits")
    return token


class LiveServer:
    """An ASGI app on a real uvicorn server in a thread, on a free loopback port."""

    def __init__(self, app, ssl: dict | None = None):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **(ssl or {})))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def exported_template(tmp_path_factory) -> Path:
    """One registry with both exports per test module (training and exporting take seconds)."""
    root = tmp_path_factory.mktemp("exported")
    exported_registry(root)
    return root


@pytest.fixture
def exported(exported_template, tmp_path) -> Registry:
    """A private copy of the template's database (the artefact store is shared, read only)."""
    for part in exported_template.glob("registry.db*"):  # with SQLite's WAL and shared-memory files
        shutil.copy(part, tmp_path / part.name)
    return Registry(f"sqlite:///{tmp_path}/registry.db")


@pytest.fixture
def served(exported, tmp_path):
    """(registry, token, live server, rollout) for digits@prod, polled every 0.1 s."""
    from hybridfleet.serve.run import build

    reg = exported
    token = reader_token(reg)
    app, rollout = build(reg, "digits@prod", cache_dir=str(tmp_path / "cache"), poll_s=0.1)
    with LiveServer(app) as server:
        yield reg, token, server, rollout
    rollout.stop()
