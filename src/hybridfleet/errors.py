"""The error contract: one exception tree, one exit-code table.

Every error a user can cause is a subclass of `HfleetError` (and of the builtin
that fits, so callers may catch `ValueError` or `ImportError` as usual). The CLI
maps each class to the exit code and the one-line hint kept in `EXIT_CODES`, so
the codes and hints cannot drift apart. An error may carry a ``hint`` written
for its own case (``LaunchError("no such script", hint="check the path")``);
it replaces the table's hint, never the exit code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExitCode:
    code: int
    hint: str


class HfleetError(Exception):
    """Base of every error hybridfleet raises for bad input or a bad environment."""

    kind = "error"

    def __init__(self, *args: object, hint: str | None = None):
        super().__init__(*args)
        self.hint = hint


class SpecError(HfleetError, ValueError):
    """The job file is invalid; the message names each field path and the fix."""

    kind = "spec"


class FrameworkMissingError(HfleetError, ImportError):
    """A framework the command needs is not installed."""

    kind = "framework_missing"


class GpuRequiredError(HfleetError, RuntimeError):
    """The job asks for GPUs and this machine has none visible."""

    kind = "gpu_required"


class CollectiveSmokeError(HfleetError, RuntimeError):
    """The 2-process all-reduce smoke test failed."""

    kind = "collective_smoke"


class EnvDriftError(HfleetError, RuntimeError):
    """Two environment locks differ at error level."""

    kind = "env_drift"


class UnsupportedImageError(HfleetError, ValueError):
    """The framework/version/CUDA combination has no official base image."""

    kind = "unsupported_image"


class DockerUnavailableError(HfleetError, RuntimeError):
    """No Docker engine answers."""

    kind = "docker_unavailable"


class LaunchError(HfleetError, RuntimeError):
    """A launch preflight check failed or a process group died."""

    kind = "launch"


class AuthError(HfleetError, PermissionError):
    """A token or certificate was rejected."""

    kind = "auth"


class ProtocolError(HfleetError, ValueError):
    """A peer sent something the wire protocol does not allow."""

    kind = "protocol"


# a secure round that lost too many pushers to be unmasked (a ProtocolError's exit code, its own hint)
SECURE_ROUND_HINT = ("too few of the round's pushers are left to unmask it: resume the job "
                     "(`hfleet run JOB --resume RUN_DIR`) once enough sites are back, or lower "
                     "ps.secure_aggregation.threshold")


class CheckpointError(HfleetError, ValueError):
    """A checkpoint is missing, corrupt or of an unknown layout."""

    kind = "checkpoint"


class StoreError(HfleetError, OSError):
    """A storage URL could not be read or written."""

    kind = "store"


class UsageError(HfleetError, ValueError):
    """A command-line value is wrong (a flag, a path, a choice)."""

    kind = "usage"


class PortInUseError(HfleetError, OSError):
    """A port this process must bind is held by another process."""

    kind = "port_in_use"


class UnreachableError(HfleetError, ConnectionError):
    """A peer (shard, master, endpoint) does not answer at its address."""

    kind = "unreachable"


class InterruptedByUserError(HfleetError):
    """Ctrl-C or SIGTERM stopped the command (after its processes were stopped)."""

    kind = "interrupted"


class DataError(HfleetError, ValueError):
    """A packed dataset is missing, corrupt, or does not fit its cache; or a worker asked for another site's data."""

    kind = "data"


class ReportError(HfleetError, ValueError):
    """A run directory is missing or is not a run (`hfleet report`, `hfleet ui`)."""

    kind = "report"


class RegistryError(HfleetError, ValueError):
    """A model-registry request is invalid (bad name, reference, gate expression or metric)."""

    kind = "registry"


class RegistryNotFoundError(RegistryError, LookupError):
    """A model, version or alias the request names does not exist."""

    kind = "registry_not_found"


class PermissionDeniedError(HfleetError, PermissionError):
    """The caller lacks a registry permission; the message names it."""

    kind = "permission"


class ConflictError(RegistryError):
    """Someone else changed the same alias first; nothing was written."""

    kind = "conflict"


class GateFailedError(HfleetError, RuntimeError):
    """A promotion gate refused the version; ``reasons`` says why, machine-readably."""

    kind = "gate"

    def __init__(self, message: str, reasons: list[dict] | None = None):
        super().__init__(message)
        self.reasons = reasons or []


class SchemaError(HfleetError, RuntimeError):
    """The registry database has another schema version than this hfleet."""

    kind = "schema"


class ExportError(HfleetError, RuntimeError):
    """An exported artefact does not reproduce the framework model's outputs; nothing was written."""

    kind = "export"


EXIT_CODES: dict[str, ExitCode] = {
    "ok": ExitCode(0, ""),
    "env_drift": ExitCode(1, "error-level drift between the two locks; rebuild the image from the same lock"),
    "spec": ExitCode(2, "fix the job file at the field paths above; `hfleet spec check FILE` shows the resolved spec"),
    "framework_missing": ExitCode(3, "install the framework: pip install 'hybridfleet[torch]' or 'hybridfleet[paddle]'"),
    "gpu_required": ExitCode(4, "the job asks for GPUs but none is visible; set resources.gpus: 0 or run on a GPU machine"),
    "collective_smoke": ExitCode(5, "the 2-process all-reduce failed; check loopback networking and the backend (gloo/NCCL)"),
    "unsupported_image": ExitCode(6, "choose one of the published base images listed above"),
    "docker_unavailable": ExitCode(7, "start a Docker engine (or use `hfleet image render` and build elsewhere)"),
    "launch": ExitCode(8, "see the failing rank's last log lines above"),
    "auth": ExitCode(9, "check the token (job, site, role, expiry) and the CA certificate"),
    "protocol": ExitCode(10, "client and server disagree on the wire protocol; upgrade the older side"),
    "checkpoint": ExitCode(11, "run `hfleet ckpt verify URL` to find the newest valid checkpoint"),
    "store": ExitCode(12, "check the storage URL, credentials and endpoint"),
    "lock": ExitCode(13, "regenerate the lock with `hfleet env lock -o PATH`"),
    "data": ExitCode(14, "check the dataset URL with `hfleet data verify URL`; pack it with `hfleet data pack SRC DEST`"),
    "report": ExitCode(15, "give a run directory written by `hfleet run` (runs/<job>/<timestamp>)"),
    "usage": ExitCode(2, "see `hfleet COMMAND --help` for the accepted values"),
    "port_in_use": ExitCode(16, "stop the process holding the port, or choose another port (0 takes any free one)"),
    "unreachable": ExitCode(17, "check the address, that the peer is running, and that no firewall blocks the port"),
    "interrupted": ExitCode(130, "interrupted; run the command again to start over"),
    "error": ExitCode(20, "unexpected error; rerun with HFLEET_LOG_LEVEL=debug"),
    "registry": ExitCode(21, "see `hfleet registry --help`; references are NAME@ALIAS or NAME@VERSION"),
    "registry_not_found": ExitCode(22, "list what exists with `hfleet registry ls` or `hfleet registry show NAME`"),
    "permission": ExitCode(23, "ask an admin of the namespace: `hfleet registry grant PRINCIPAL ROLE SCOPE`"),
    "conflict": ExitCode(24, "the alias moved meanwhile; check `hfleet registry history NAME` and retry"),
    "gate": ExitCode(25, "the version does not meet the gate; `--json` gives the reasons"),
    "schema": ExitCode(26, "migrate the database: `hfleet registry migrate --db URL`"),
    "export": ExitCode(27, "the exporter changed the model's behaviour; see the figures above and docs/SERVING.md"),
}


def exit_code_for(exc: BaseException) -> ExitCode:
    """The exit code and hint for an exception (unknown ones map to `error`); an error's own hint wins."""
    kind = getattr(exc, "kind", "error") if isinstance(exc, HfleetError) else "error"
    code = EXIT_CODES.get(kind, EXIT_CODES["error"])
    own_hint = getattr(exc, "hint", None) if isinstance(exc, HfleetError) else None
    return ExitCode(code.code, own_hint) if own_hint else code


def print_error(message: str, hint: str, stream=None) -> None:
    """Print ``error: <message>`` and, when there is one, ``hint: <hint>`` on ``stream`` (stderr)."""
    import sys

    out = stream if stream is not None else sys.stderr
    out.write(f"error: {message}\n")
    if hint:
        out.write(f"hint: {hint}\n")
    out.flush()


def report(exc: BaseException, stream=None) -> int:
    """Print ``exc`` as `print_error` does, with the hint of its kind (or its own); return its exit code."""
    code = exit_code_for(exc)
    print_error(str(exc), code.hint, stream)
    return code.code


def install_excepthook() -> None:
    """Make an uncaught `HfleetError` end this process with one line, its hint and its exit code.

    For processes hybridfleet runs user code in (a PS worker's training script): a
    refused join or an unreachable shard reads like a CLI error, not a traceback.
    Any other exception keeps Python's usual traceback.
    """
    import os
    import sys

    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if isinstance(exc, HfleetError):
            code = report(exc)
            sys.stdout.flush()
            os._exit(code)  # skip interpreter teardown: worker threads may still hold the gRPC channels
        previous(exc_type, exc, tb)

    sys.excepthook = hook
