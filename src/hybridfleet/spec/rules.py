"""Cross-field rules of the `ps` section: which optimizer goes with which sync mode and codec.

Kept apart from the models so the reasons (and their measurements) read in one place.
"""

from __future__ import annotations

from typing import Any

# DiLoCo's outer optimizer (Douillard et al. 2023): Nesterov SGD on the averaged pseudo-gradient.
OUTER_OPTIMIZER_DEFAULT = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}
LOCAL_STEPS_DEFAULT = 50

# Codecs whose compressed downlink cannot follow a server-side Adam: Adam moves every
# coordinate every step, so sparse (or sign-only) parameter deltas lag further behind the
# shard's values each step. Measured on the digits job (bench/compression.py --optimizer adam):
# Adam + top-k 1% oscillated between 0.75 and 0.92 test accuracy while dense Adam reached 0.975.
# int4 (15 levels per chunk) and powersgd (rank-r factors) have not been measured with a
# server-side Adam: refused until they are.
ADAPTIVE_UNSAFE_CODECS = ("topk", "randomk", "sign", "int4", "powersgd")
ADAPTIVE_OPTIMIZERS = ("adam", "adamw")


def check_sync_optimizer(ps: Any) -> None:
    """Raise ValueError (``field: problem; fix``) when ``ps``'s sync mode, optimizer and codec do not go together."""
    if ps.local_steps is not None and ps.sync != "local":
        raise ValueError(f"local_steps: only applies to sync: local (sync is {ps.sync!r}); "
                         "remove it or set sync: local")
    name, codec = ps.optimizer.name, ps.compression.codec
    if ps.sync == "local" and name != "sgd":
        raise ValueError(
            f"optimizer: with sync: local it is the outer optimizer on the shards and must be sgd (got {name!r}); "
            "use {name: sgd, lr: 0.7, momentum: 0.9, nesterov: true} (the default when omitted) and build "
            f"{name.capitalize()} in the training script as the inner optimizer: "
            "ps = hf.connect(model, optimizer)")
    if ps.sync != "local" and name in ADAPTIVE_OPTIMIZERS and codec in ADAPTIVE_UNSAFE_CODECS:
        raise ValueError(
            f"optimizer: server-side {name} with compression codec {codec!r} trains a poor model without "
            f"failing ({name} moves every coordinate each step and the compressed parameter deltas lag behind); "
            f"use sync: local (the script's own {name.capitalize()} as the inner optimizer, "
            "hf.connect(model, optimizer); pseudo-gradients go through the codec), "
            "or optimizer {name: sgd} (with compression.momentum for top-k), or codec int8/fp16")


# Sync modes whose pushes are gathered into rounds that close together (one version per round).
ROUND_SYNC_MODES = ("bsp", "local")


def outer_rounds(ps: Any, inner_steps: int) -> int:
    """How many shard versions ``inner_steps`` training steps make: one per step, or per `local_steps` in local mode."""
    return -(-inner_steps // ps.local_steps) if ps.sync == "local" else inner_steps


def check_site_frameworks(job: Any) -> None:
    """A site with its own framework needs its own script; mixing frameworks needs the PS mode."""
    for name, site in job.sites.items():
        if site.framework and site.framework != job.framework:
            if job.mode != "ps":
                raise ValueError(f"sites.{name}.framework: mixing frameworks ({site.framework} at {name}, "
                                 f"{job.framework} for the job) needs mode: ps")
            if not site.entrypoint:
                raise ValueError(f"sites.{name}.entrypoint: site {name} trains with {site.framework}, the job's "
                                 f"entrypoint is for {job.framework}; name the {site.framework} script, "
                                 f"e.g. entrypoint: examples/digits/train_{site.framework}.py")
