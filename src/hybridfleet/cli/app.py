"""The `hfleet` command: registers each command module and maps errors to exit codes.

Each module under `hybridfleet.cli` exposes ``register(app)``; nothing else lives here.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import time
import traceback

import typer
from typer.core import TyperArgument

from hybridfleet import __version__
from hybridfleet.errors import EXIT_CODES, HfleetError, print_error, report

# command name -> the module under hybridfleet.cli that registers it
COMMAND_MODULES = ["spec", "env", "image", "certs", "run", "ps", "worker", "launch", "k8s", "ckpt", "data", "report", "ui", "registry", "serve"]


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"hfleet {__version__}")
        raise typer.Exit()


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
    def _group(
        version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                     help="print the hybridfleet version and exit"),
    ) -> None:
        """hybridfleet: train from a laptop to a private cluster and the cloud, PaddlePaddle and PyTorch."""

    for name in COMMAND_MODULES if only is None else [only]:
        importlib.import_module(f"hybridfleet.cli.{name}").register(app)
    # Plain click help: flags read `--dry-run`, not `--dry-run <bool>` (rich help shows a type for every option).
    app.rich_markup_mode = None
    for info in app.registered_groups:
        info.typer_instance.rich_markup_mode = None
    return app


def plain_metavars(command):
    """``command`` (and every subcommand) with argparse-style metavars: `Usage: hfleet k8s quota JOB`,
    `--step STEP`, instead of Typer's `{job}` and `--step <int>`. Flags and choices keep theirs."""
    for param in command.params:
        descriptor = getattr(param, "type_descriptor", None)
        keeps_own = getattr(param, "is_flag", False) or (descriptor is not None and descriptor.is_choice)
        if param.metavar is None and not keeps_own:
            param.metavar = (param.name or "value").upper()
        if isinstance(param, TyperArgument):
            name = (param.metavar or param.name or "value") + ("..." if param.nargs != 1 else "")
            # Typer formats these two itself (`{job}`, `job <path>`); the instance's own answers win
            param._usage_display_name = (lambda shown: lambda: shown)(name if param.required else f"[{name}]")
            param.display_type_rich = lambda ctx: None
    for sub in getattr(command, "commands", {}).values():
        plain_metavars(sub)
    return command


def __getattr__(name: str):
    if name == "app":  # the full app, for tests and tools that introspect it
        return build_app()
    raise AttributeError(name)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app; every failure becomes one line, a hint and an exit code from `EXIT_CODES`.

    An `HfleetError` prints its message and its hint; Ctrl-C prints one line (exit 130);
    any other exception is a bug: one line, and the full traceback goes to a file
    whose path is printed. Returns normally on success (exit 0); raises SystemExit otherwise.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # gRPC's C core would print its own lines next to ours
    try:
        app = build_app(only=args[0] if args and args[0] in COMMAND_MODULES else None)
        command = plain_metavars(typer.main.get_command(app))
        command.main(args=args, prog_name="hfleet")  # standalone mode: usage errors exit 2 with click's message
    except SystemExit as ex:
        if ex.code in (0, None):
            return
        if ex.code in (130, 143):  # Ctrl-C / SIGTERM, turned into an exit by click or by a supervised run
            print_error(f"interrupted by {'Ctrl-C' if ex.code == 130 else 'SIGTERM'}", EXIT_CODES["interrupted"].hint)
        raise
    except HfleetError as err:
        sys.exit(report(err))
    except KeyboardInterrupt:
        code = EXIT_CODES["interrupted"]
        print_error("interrupted (Ctrl-C)", code.hint)
        sys.exit(code.code)
    except Exception as err:  # a bug, not a user mistake: keep the traceback, out of the user's way
        path = _write_traceback(err)
        code = EXIT_CODES["error"]
        print_error(f"internal error: {type(err).__name__}: {err}".rstrip(": "),
                f"the full traceback is in {path}; please report it with that file" if path else code.hint)
        sys.exit(code.code)


def _write_traceback(err: BaseException) -> str | None:
    """Write ``err``'s traceback to a new file under the temp dir; its path (None if it cannot be written)."""
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    try:
        fd, path = tempfile.mkstemp(prefix=time.strftime("hfleet-traceback-%Y%m%d-%H%M%S-"), suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"hfleet {__version__}: {' '.join(sys.argv)}\n{text}")
        return path
    except OSError:
        return None


if __name__ == "__main__":
    main()
