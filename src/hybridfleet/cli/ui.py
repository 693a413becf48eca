"""`hfleet ui`: runs (and models, with the registry installed) in a browser, read-only."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from hybridfleet.errors import LaunchError


def ui(
    runs: Path = typer.Option(Path("runs"), help="the run root (what `hfleet run` writes under)"),
    host: str = typer.Option("127.0.0.1", help="address to bind; anything but loopback needs --token"),
    port: int = typer.Option(8765, help="port to bind (0: a free port, printed)"),
    token: Optional[str] = typer.Option(None, envvar="HFLEET_UI_TOKEN", help="required when --host is not loopback"),
    registry: Optional[str] = typer.Option(None, "--registry", "--registry-db",
                                           help="an existing registry for the models pages: sqlite:///PATH, "
                                                "postgresql://... or http(s)://server (default: $HFLEET_REGISTRY); "
                                                "never created"),
    registry_token: Optional[str] = typer.Option(None, "--registry-token", envvar="HFLEET_UI_REGISTRY_TOKEN",
                                                 help="read the registry as this principal for every viewer "
                                                      "(default: each viewer signs in with their own token)"),
) -> None:
    """Serve the read-only web UI until Ctrl-C."""
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise LaunchError("hfleet ui needs FastAPI and uvicorn: pip install 'hybridfleet[ui]'") from None
    from hybridfleet.ui.app import bind, check_exposure, create_app
    from hybridfleet.ui.registry_view import open_access

    check_exposure(host, token)
    access, why_not = open_access(registry, registry_token)
    sock = bind(host, port)
    app = create_app(runs, token=token, registry=access, no_registry_reason=why_not)
    shown = f"[{host}]" if ":" in host else host
    typer.echo(f"hfleet ui: http://{shown}:{sock.getsockname()[1]}/ (runs under {runs.resolve()})", err=True)
    if access is None:
        typer.echo(f"hfleet ui: models pages: {why_not}", err=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.run(sockets=[sock])


def register(app: typer.Typer) -> None:
    app.command("ui")(ui)
