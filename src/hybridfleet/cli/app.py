"""The `hfleet` command: registers each command module and maps errors to exit codes.

Each module under `hybridfleet.cli` exposes ``register(app)``; nothing else lives here.
"""

from __future__ import annotations

import importlib
import sys

import typer

from hybridfleet.errors import HfleetError, exit_code_for

# command name -> the module under hybridfleet.cli that registers it
COMMAND_MODULES = ["spec", "env", "image", "certs", "run", "ps", "worker", "launch", "k8s", "ckpt", "data", "report", "ui"]


def build_app(only: str | None = None) -> typer.Typer:
    """The `hfleet` app with every command, or with just ``only``.

    `main` builds only the command being run: `hfleet launch` sits on the start-up
    path of every training process, so it must not pay for importing the other
    commands' dependencies (grpc, cryptography, pydantic models).
    """
    app = typer.Typer(
        name="hfleet",
        help="hybridfleet: train from a laptop to a private cluster and the cloud, PaddlePaddle and PyTorch.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )

    @app.callback()
    def _group() -> None:
        """hybridfleet: train from a laptop to a private cluster and the cloud, PaddlePaddle and PyTorch."""

    for name in COMMAND_MODULES if only is None else [only]:
        importlib.import_module(f"hybridfleet.cli.{name}").register(app)
    return app


def __getattr__(name: str):
    if name == "app":  # the full app, for tests and tools that introspect it
        return build_app()
    raise AttributeError(name)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app; an `HfleetError` becomes its message, a hint and its exit code.

    Returns normally on success (exit 0); raises SystemExit with the code otherwise.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    app = build_app(only=args[0] if args and args[0] in COMMAND_MODULES else None)
    try:
        app(args=args, prog_name="hfleet")  # standalone mode: usage errors exit 2 with click's message
    except SystemExit as ex:
        if ex.code in (0, None):
            return
        raise
    except HfleetError as err:
        from rich.console import Console

        code = exit_code_for(err)
        console = Console(stderr=True)
        console.print("[red]error:[/red] ", end="")
        console.print(str(err), markup=False, highlight=False, soft_wrap=True)
        if code.hint:
            console.print(f"hint: {code.hint}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(code.code)


if __name__ == "__main__":
    main()
