"""Import-time stand-in for torchvision in the MosaicML Streaming venv of bench/data.py.

`streaming/__init__.py` imports its vision datasets, which import torchvision at module
load. PyPI's torchvision wheels are linked against the CUDA build of torch (libtorch_cuda),
which cannot load beside the CPU build installed here, so the bench puts this folder first
on the Streaming subprocess's PYTHONPATH. The measured path (MDSWriter, StreamingDataset,
torch DataLoader) never calls torchvision; anything that does gets this error.
"""


def _unavailable(*args, **kwargs):
    raise RuntimeError("torchvision is a stand-in here (bench/_streaming_stubs); the benchmark must not call it")
