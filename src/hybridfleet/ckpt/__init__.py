"""Platform-independent checkpoints: safetensors files + state JSON + a manifest written last.

No pickle anywhere; a checkpoint saved from PyTorch loads into PaddlePaddle and back.
"""

from __future__ import annotations

from hybridfleet.ckpt.async_save import AsyncCheckpointer
from hybridfleet.ckpt.checkpoint import (
    CheckpointInfo,
    VerifyResult,
    list_checkpoints,
    load_checkpoint,
    load_tensors_checkpoint,
    save_checkpoint,
    save_tensors_checkpoint,
    verify,
)
from hybridfleet.ckpt.convert import convert_checkpoint
from hybridfleet.ckpt.retention import GcResult, gc
from hybridfleet.ckpt.view import VerifiedTensors, open_tensors

__all__ = [
    "AsyncCheckpointer",
    "CheckpointInfo",
    "GcResult",
    "VerifiedTensors",
    "VerifyResult",
    "convert_checkpoint",
    "gc",
    "list_checkpoints",
    "load_checkpoint",
    "load_tensors_checkpoint",
    "open_tensors",
    "save_checkpoint",
    "save_tensors_checkpoint",
    "verify",
]
