"""The Docker engine: is one answering, and `docker build` when it is."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from hybridfleet.env.probe import last_lines
from hybridfleet.errors import DockerUnavailableError
from hybridfleet.obs.log import get_logger

log = get_logger("env.docker")

DOCKER_INFO_TIMEOUT_S = 20.0


def require_docker_engine(timeout_s: float = DOCKER_INFO_TIMEOUT_S) -> str:
    """The docker CLI path when ``docker info`` succeeds; DockerUnavailableError saying why otherwise."""
    exe = shutil.which("docker")
    if exe is None:
        raise DockerUnavailableError("no docker CLI on PATH, so no Docker engine can answer")
    try:
        out = subprocess.run([exe, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise DockerUnavailableError(f"`docker info` did not answer within {timeout_s:g} s") from None
    if out.returncode != 0:
        reason = last_lines(out.stderr or out.stdout, 1) or f"exit code {out.returncode}"
        raise DockerUnavailableError(f"no Docker engine answers (`docker info` failed: {reason})")
    log.info("docker_engine", server_version=out.stdout.strip())
    return exe


def build_image(dockerfile: str, tag: str, context_dir: str | Path,
                on_line: Callable[[str], None] | None = None, dockerignore: str | None = None) -> None:
    """Build ``dockerfile`` (text) as ``tag`` with ``context_dir`` as the build context.

    Checks the engine first (DockerUnavailableError, nothing written); streams
    build output lines to ``on_line``; raises DockerUnavailableError naming the
    exit code when the build fails.
    """
    context = Path(context_dir)
    if not context.is_dir():
        raise ValueError(f"build context {context} is not a directory")
    exe = require_docker_engine()
    with tempfile.TemporaryDirectory(prefix="hfleet-build-") as tmp:
        path = Path(tmp) / "Dockerfile"
        path.write_text(dockerfile)
        if dockerignore is not None:  # BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile
            Path(f"{path}.dockerignore").write_text(dockerignore)
        proc = subprocess.Popen([exe, "build", "-f", str(path), "-t", tag, str(context)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if on_line:
                on_line(line.rstrip("\n"))
        code = proc.wait()
    if code != 0:
        raise DockerUnavailableError(f"`docker build` of {tag} exited {code}; see its output above")
    log.info("image_built", tag=tag)
