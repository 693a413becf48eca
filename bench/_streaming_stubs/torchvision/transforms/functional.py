"""Names `streaming.vision` imports at module load; see ../__init__.py."""

from torchvision import _unavailable as to_tensor  # noqa: F401
