"""Which way a metric is better, read from its name: the one rule for plots, the UI, reports and benches.

* higher is better: a word of the name (split at ``_`` and ``.``) is ``acc``, ``accuracy``, ``f1``,
  ``auc``, ``precision``, ``recall`` or ``iou`` (``test_accuracy``, ``val_f1``);
* lower is better: a word is ``loss``, ``bpc``, ``bpb``, ``perplexity``, ``ppl``, ``error``, ``mse``,
  ``mae``, ``rmse``, ``wer`` or ``cer`` (``loss``, ``test_bpc``); a lower word wins over a higher one.
"""

from __future__ import annotations

import re

HIGHER_IS_BETTER = frozenset({"acc", "accuracy", "f1", "auc", "precision", "recall", "iou"})
LOWER_IS_BETTER = frozenset({"loss", "bpc", "bpb", "perplexity", "ppl", "error", "mse", "mae", "rmse", "wer", "cer"})


def lower_is_better(key: str) -> bool | None:
    """True / False when the name of metric ``key`` says lower / higher is better; None when it says neither."""
    words = set(re.split(r"[_.]", key.lower()))
    if words & LOWER_IS_BETTER:
        return True
    if words & HIGHER_IS_BETTER:
        return False
    return None


def higher_is_better(key: str) -> bool:
    """True when the name of metric ``key`` says higher is better, False when lower; ValueError when neither."""
    lower = lower_is_better(key)
    if lower is None:
        raise ValueError(f"metric {key!r}: its name says neither higher nor lower is better; name it with one of "
                         f"{sorted(HIGHER_IS_BETTER)} (higher) or {sorted(LOWER_IS_BETTER)} (lower)")  # fmt: skip
    return not lower


def reached(key: str, value: float | None, target: float) -> bool:
    """Whether ``value`` of metric ``key`` meets ``target`` in the metric's direction (None never does)."""
    if value is None:
        return False
    return value >= target if higher_is_better(key) else value <= target


def worse_by(key: str, anchor: float, other: float) -> float:
    """How much worse ``other`` is than ``anchor`` for metric ``key`` (positive: worse, negative: better)."""
    return anchor - other if higher_is_better(key) else other - anchor
