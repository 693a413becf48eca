"""The optimizer classes a worker may hand to the shards, shared by both sides of the wire.

The worker refuses another class at connect (`hybridfleet.ps.worker.optim_spec`); the
shard refuses a push naming one (`hybridfleet.ps.server.groups`).
"""

from __future__ import annotations

TORCH_CLASSES = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "Adadelta")
PADDLE_CLASSES = ("SGD", "Momentum", "Adam", "AdamW", "RMSProp", "Adagrad", "Adamax", "Adadelta")
CLASSES = {"torch": TORCH_CLASSES, "paddle": PADDLE_CLASSES}
# optimizers that move every coordinate every step (refused with sparse codecs, see spec.rules)
ADAPTIVE_CLASSES = ("Adam", "AdamW", "RMSprop", "RMSProp", "Adagrad", "Adamax", "NAdam", "RAdam", "Adadelta")
