"""The `hfleet` command: registers each command module and maps errors to exit codes.

Each module under `hybridfleet.cli` exposes ``register(app)``; nothing else lives here.
"""

from __future__ import annotations

import importlib
import sys

import typer
from rich.console import Console

from hybridfleet.errors import HfleetError, exit_code_for

COMMAND_MODULES = ["spec", "env", "image", "certs", "run", "ps", "worker", "launch", "k8s", "ckpt"]

app = typer.Typer(
    name="hfleet",
    help="hybridfleet: train from a laptop to a private cluster and the cloud, PaddlePaddle and PyTorch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for _name in COMMAND_MODULES:
    importlib.import_module(f"hybridfleet.cli.{_name}").register(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app; an `HfleetError` becomes its message, a hint and its exit code."""
    try:
        app(args=argv, standalone_mode=False)
    except HfleetError as err:
        code = exit_code_for(err)
        console = Console(stderr=True)
        console.print(f"[red]error:[/red] {err}", markup=True, highlight=False, soft_wrap=True)
        if code.hint:
            console.print(f"hint: {code.hint}", highlight=False, soft_wrap=True)
        sys.exit(code.code)
    except typer.Exit as ex:
        sys.exit(ex.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as err:  # click usage errors arrive here in non-standalone mode
        import click

        if isinstance(err, click.ClickException):
            err.show()
            sys.exit(err.exit_code)
        raise


if __name__ == "__main__":
    main()
