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
    """Entry point: run the app; an `HfleetError` becomes its message, a hint and its exit code.

    Returns normally on success (exit 0); raises SystemExit with the code otherwise.
    """
    try:
        app(args=argv, prog_name="hfleet")  # standalone mode: usage errors exit 2 with click's message
    except SystemExit as ex:
        if ex.code in (0, None):
            return
        raise
    except HfleetError as err:
        code = exit_code_for(err)
        console = Console(stderr=True)
        console.print("[red]error:[/red] ", end="")
        console.print(str(err), markup=False, highlight=False, soft_wrap=True)
        if code.hint:
            console.print(f"hint: {code.hint}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(code.code)


if __name__ == "__main__":
    main()
