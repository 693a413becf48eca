"""Lazy registry of framework adapters, with install hints for missing frameworks."""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType
from typing import Any

from hybridfleet.errors import FrameworkMissingError
from hybridfleet.frameworks.base import Adapter

# name -> (adapter "module:Class", top-level module the adapter needs)
FRAMEWORKS: dict[str, tuple[str, str]] = {
    "torch": ("hybridfleet.frameworks.torch_adapter:TorchAdapter", "torch"),
    "paddle": ("hybridfleet.frameworks.paddle_adapter:PaddleAdapter", "paddle"),
}


def import_framework(module: str) -> ModuleType:
    """Import ``module`` ("torch", "paddle") without framework noise on the terminal.

    Paddle warns "No ccache found" on import when ccache is not installed; that only matters
    to someone compiling Paddle C++ extensions, never to loading or saving tensors.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
        return importlib.import_module(module)


def get_adapter(name: str) -> Adapter:
    """The adapter for framework ``name`` ("torch" or "paddle"), importing it on first use.

    Raises ValueError for an unknown name and FrameworkMissingError (an ImportError)
    with the pip command when the framework is not installed.
    """
    if name not in FRAMEWORKS:
        raise ValueError(f"unknown framework {name!r}; expected one of {sorted(FRAMEWORKS)}")
    target, needed = FRAMEWORKS[name]
    try:
        import_framework(needed)
    except ImportError as err:
        raise FrameworkMissingError(f"pip install 'hybridfleet[{name}]'") from err
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)()  # stateless; imports are cached


def detect_framework(obj: Any) -> str:
    """The framework name ("torch" or "paddle") that owns a model, optimizer or tensor.

    Only frameworks already imported by the caller are considered, so this never
    imports a framework. Raises TypeError when no loaded framework owns ``obj``.
    """
    for name, (_, module) in FRAMEWORKS.items():
        if module in sys.modules and get_adapter(name).owns(obj):
            return name
    raise TypeError(f"{type(obj).__module__}.{type(obj).__qualname__} is neither a torch nor a paddle object")
