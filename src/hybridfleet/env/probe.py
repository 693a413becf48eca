"""Framework facts (version, CUDA, cuDNN, NCCL, devices, backends), read in a child process.

The parent never imports torch or paddle: `probe_framework` runs
``python -m hybridfleet.env.probe FRAMEWORK``, which prints one marked JSON line.
A child process keeps a broken or crashing framework install from taking the
checker down with it, and keeps the two frameworks' native libraries apart.
A process keeps what it probed: the same framework, at the same install, for the
same child environment, is not imported again (a run's lineage and `env lock` both ask).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

from hybridfleet.errors import FrameworkMissingError

# framework name -> import name and the distributions that provide it
FRAMEWORKS: dict[str, dict[str, Any]] = {
    "torch": {"module": "torch", "distributions": ["torch"]},
    "paddle": {"module": "paddle", "distributions": ["paddlepaddle", "paddlepaddle-gpu"]},
}
MARKER = "HFLEET_PROBE "
PROBE_TIMEOUT_S = 120.0
_PROBED: dict[tuple, dict[str, Any]] = {}  # (framework, interpreter, install stamp, child env) -> facts


def known_framework(name: str) -> dict[str, Any]:
    """The FRAMEWORKS entry for ``name``; ValueError naming the valid ones otherwise."""
    if name not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {sorted(FRAMEWORKS)} (got {name!r})")
    return FRAMEWORKS[name]


def framework_installed(name: str) -> bool:
    """Whether the framework's module can be found (without importing it)."""
    module = known_framework(name)["module"]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def child_env() -> dict[str, str]:
    """The environment for framework child processes: one intra-op thread unless set."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def last_lines(text: str, count: int = 3) -> str:
    """The last ``count`` non-empty lines of ``text``, joined by ' | '."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-count:])


def probe_framework(name: str, timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """The framework's facts (keys as in `_torch_facts` / `_paddle_facts`).

    Raises FrameworkMissingError when the framework is not installed or fails to
    import, naming the import error.
    """
    if not framework_installed(name):
        raise FrameworkMissingError(f"{name} is not installed (no module {FRAMEWORKS[name]['module']!r})")
    env = child_env()
    key = (name, sys.executable, _install_stamp(name), tuple(sorted(env.items())))
    if key in _PROBED:
        return copy.deepcopy(_PROBED[key])
    try:
        out = subprocess.run(
            [sys.executable, "-m", "hybridfleet.env.probe", name],
            capture_output=True, text=True, timeout=timeout_s, env=env,
        )
    except subprocess.TimeoutExpired:
        raise FrameworkMissingError(f"{name}: importing it took longer than {timeout_s:g} s") from None
    for line in out.stdout.splitlines():
        if line.startswith(MARKER):
            facts = json.loads(line[len(MARKER):])
            if "import_error" in facts:
                raise FrameworkMissingError(f"{name} is installed but fails to import: {facts['import_error']}")
            _PROBED[key] = copy.deepcopy(facts)
            return facts
    raise FrameworkMissingError(
        f"{name}: the probe process exited {out.returncode} without a result: {last_lines(out.stderr)}"
    )


def _install_stamp(name: str) -> tuple[str | None, int | None]:
    """Where the framework's package is and when it last changed: a reinstall probes anew."""
    try:
        origin = importlib.util.find_spec(FRAMEWORKS[name]["module"]).origin
        return origin, os.stat(origin).st_mtime_ns if origin else None
    except (ImportError, ValueError, AttributeError, OSError):
        return None, None


def _version_triple(value: Any) -> str | None:
    if value in (None, "", "False", False, 0, "0"):
        return None
    if isinstance(value, int):  # cuDNN as 90100 -> 9.1.0
        return f"{value // 10000}.{value // 100 % 100}.{value % 100}" if value >= 10000 else str(value)
    if isinstance(value, (tuple, list)):
        return ".".join(str(v) for v in value)
    return str(value)


def _torch_facts() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    cuda_ok = torch.cuda.is_available()
    nccl = None
    if cuda_ok:
        try:
            nccl = _version_triple(torch.cuda.nccl.version())
        except (RuntimeError, AttributeError):
            nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    dist_ok = dist.is_available()
    return {
        "version": torch.__version__,
        "cuda_compiled": torch.version.cuda is not None,
        "cuda": torch.version.cuda,
        "cudnn": _version_triple(cudnn),
        "nccl": nccl,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda_ok else [],
        "backends": {
            "gloo": bool(dist_ok and dist.is_gloo_available()),
            "nccl": bool(dist_ok and dist.is_nccl_available()),
        },
    }


def _paddle_facts() -> dict[str, Any]:
    import paddle
    from paddle.base import core

    compiled = paddle.is_compiled_with_cuda()
    count = paddle.device.cuda.device_count() if compiled else 0
    return {
        "version": paddle.__version__,
        "cuda_compiled": compiled,
        "cuda": _version_triple(paddle.version.cuda()),
        "cudnn": _version_triple(paddle.version.cudnn()),
        "nccl": _version_triple(paddle.version.nccl()) if compiled else None,
        "devices": [paddle.device.cuda.get_device_name(i) for i in range(count)],
        "backends": {
            # Linux builds with distributed support carry gloo for CPU collectives
            "gloo": bool(core.is_compiled_with_distribute()),
            "nccl": bool(core.is_compiled_with_nccl()),
        },
    }


def main(argv: list[str]) -> int:
    """Child entry: print the named framework's facts as one marked JSON line."""
    name = argv[0] if argv else ""
    known_framework(name)
    try:
        facts = _torch_facts() if name == "torch" else _paddle_facts()
    except ImportError as err:
        facts = {"import_error": f"{type(err).__name__}: {err}"}
    sys.stdout.write(MARKER + json.dumps(facts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
