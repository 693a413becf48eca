"""The charlm example's AdamW and learning-rate schedule, the same recipe in PyTorch and Paddle.

AdamW (betas 0.9, 0.95) decays only the Linear weights: no weight decay on biases,
LayerNorms and embeddings (`charlm_model.decayed`). The learning rate warms up linearly
from 0 over ``warmup_steps``, then follows a cosine down to ``min_lr_ratio`` x ``lr`` at
``steps`` (`lr_factor`; paddle's ``LinearWarmup(CosineAnnealingDecay)`` gives the same values).
The shards apply exactly this optimizer and, at every step, the schedule's current rate.
"""

from __future__ import annotations

import math

from charlm_model import decayed

BETAS = (0.9, 0.95)


def lr_factor(step: int, steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """The fraction of the peak learning rate at 0-based ``step``."""
    if step < warmup_steps:
        return step / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def torch_optimizer(model, lr: float, weight_decay: float):
    """AdamW with two parameter groups: decayed Linear weights, and everything else without decay."""
    import torch

    params = dict(model.named_parameters())  # tok.weight once: the input and the output embedding
    return torch.optim.AdamW([
        {"params": [p for n, p in params.items() if decayed(n)], "weight_decay": weight_decay},
        {"params": [p for n, p in params.items() if not decayed(n)], "weight_decay": 0.0},
    ], lr=lr, betas=BETAS)


def torch_schedule(optimizer, steps: int, warmup_steps: int, min_lr_ratio: float):
    """``LambdaLR`` over `lr_factor`."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, steps, warmup_steps, min_lr_ratio))


def paddle_optimizer(model, lr: float, weight_decay: float):
    """AdamW whose ``apply_decay_param_fun`` decays the Linear weights only (paddle's own way to
    leave biases, norms and embeddings undecayed)."""
    import paddle

    decay = {p.name for n, p in model.named_parameters() if decayed(n)}
    return paddle.optimizer.AdamW(learning_rate=lr, parameters=model.parameters(), beta1=BETAS[0], beta2=BETAS[1],
                                  weight_decay=weight_decay, apply_decay_param_fun=lambda name: name in decay)


def paddle_schedule(lr: float, steps: int, warmup_steps: int, min_lr_ratio: float):
    """``LinearWarmup(CosineAnnealingDecay)``: the values of `lr_factor` x ``lr``."""
    import paddle

    cosine = paddle.optimizer.lr.CosineAnnealingDecay(lr, T_max=max(1, steps - warmup_steps), eta_min=min_lr_ratio * lr)
    return paddle.optimizer.lr.LinearWarmup(cosine, warmup_steps=warmup_steps, start_lr=0.0, end_lr=lr)
