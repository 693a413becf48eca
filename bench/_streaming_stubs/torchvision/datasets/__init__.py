"""Names `streaming.vision` imports at module load; see ../__init__.py."""

from torchvision import _unavailable


class VisionDataset:
    def __init__(self, *args, **kwargs):
        _unavailable()


CIFAR10 = VisionDataset
