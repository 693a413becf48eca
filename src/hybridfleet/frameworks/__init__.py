"""Framework adapters: one narrow interface over PyTorch and PaddlePaddle.

``get_adapter("torch")`` / ``get_adapter("paddle")`` import the framework only
when called; importing this package never imports either framework.
"""

from __future__ import annotations

from hybridfleet.frameworks.base import Adapter
from hybridfleet.frameworks.registry import FRAMEWORKS, detect_framework, get_adapter, import_framework

__all__ = ["Adapter", "FRAMEWORKS", "detect_framework", "get_adapter", "import_framework"]
