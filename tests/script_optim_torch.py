"""torch side of the script-optimizer equivalence tests: models, optimizers, one training loop."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from script_optim_helpers import CLASSES, DIM, SEQ, VOCAB, warmup_cosine


class Trio(nn.Module):
    """An MLP, a small CNN (no BatchNorm) and a small transformer with tied embeddings, trained together."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(36, 16), nn.Tanh(), nn.Linear(16, CLASSES))
        self.cnn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(4 * 2 * 2, CLASSES))
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        # no attention biases: the key bias has a zero gradient in exact arithmetic (softmax is shift
        # invariant), so Adam would turn float noise into full steps and no two summation orders agree
        self.block = nn.TransformerEncoderLayer(DIM, 2, 16, dropout=0.0, batch_first=True, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def loss(self, images, tokens, labels):
        f = nn.functional
        x = torch.from_numpy(images)
        t = torch.from_numpy(tokens)
        y = torch.from_numpy(labels)
        mlp = f.cross_entropy(self.mlp(x.flatten(1)), y)
        cnn = f.cross_entropy(self.cnn(x), y)
        h = self.block(self.emb(t[:, :-1]) + self.pos[:SEQ - 1])
        lm = f.cross_entropy(self.head(h).reshape(-1, VOCAB), t[:, 1:].reshape(-1))
        return mlp + cnn + lm


def model(seed: int = 0) -> Trio:
    torch.manual_seed(seed)
    return Trio()


def two_groups(m: nn.Module):
    decay = [p for n, p in m.named_parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for n, p in m.named_parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 0.02}]


OPTIMIZERS = {
    "sgd_nesterov": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "sgd_dampening": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.8, dampening=0.3, weight_decay=1e-3),
    "adam": lambda g: torch.optim.Adam(g, lr=3e-3, weight_decay=1e-2),
    "adamw_amsgrad": lambda g: torch.optim.AdamW(g, lr=3e-3, betas=(0.8, 0.99), weight_decay=0.1, amsgrad=True),
    "rmsprop": lambda g: torch.optim.RMSprop(g, lr=1e-3, momentum=0.5, centered=True, weight_decay=1e-3),
    "adagrad": lambda g: torch.optim.Adagrad(g, lr=0.05, lr_decay=1e-3, weight_decay=1e-3),
}


def make(name: str, m: nn.Module):
    opt = OPTIMIZERS[name](two_groups(m))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)


def values(m: nn.Module) -> dict:
    return {n: p.detach().numpy().copy() for n, p in m.named_parameters()}


def train(m, opt, sched, data, ps=None, on_step=None, lock=None):
    """The plain script's loop; with ``ps``, ``ps.step()`` replaces ``optimizer.step()``
    (``lock``: held around the forward and backward pass)."""
    for i, (images, tokens, labels) in enumerate(data):
        if on_step is not None:
            on_step(i, m, opt)
        opt.zero_grad(set_to_none=True)
        with lock or contextlib.nullcontext():
            m.loss(images, tokens, labels).backward()
        ps.step() if ps is not None else opt.step()
        sched.step()
