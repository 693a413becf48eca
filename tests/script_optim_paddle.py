"""paddle side of the script-optimizer equivalence tests: models, optimizers, one training loop."""

from __future__ import annotations

import contextlib

import paddle
from paddle import nn

from script_optim_helpers import CLASSES, DIM, SEQ, TOTAL, VOCAB, WARMUP


class Trio(nn.Layer):
    """An MLP, a small CNN (no BatchNorm) and a small transformer with tied embeddings, trained together."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(36, 16), nn.Tanh(), nn.Linear(16, CLASSES))
        self.cnn = nn.Sequential(nn.Conv2D(1, 4, 3), nn.ReLU(), nn.Conv2D(4, 4, 3), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(4 * 2 * 2, CLASSES))
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = self.create_parameter([SEQ, DIM], default_initializer=nn.initializer.Constant(0.0))
        # no biases: the key bias has a zero gradient in exact arithmetic (softmax is shift invariant),
        # so float noise of one summation order or another would be all that trains it
        self.block = nn.TransformerEncoderLayer(DIM, 2, 16, dropout=0.0, attn_dropout=0.0, act_dropout=0.0,
                                                bias_attr=False)

    def loss(self, images, tokens, labels):
        f = nn.functional
        x, t, y = paddle.to_tensor(images), paddle.to_tensor(tokens), paddle.to_tensor(labels)
        mlp = f.cross_entropy(self.mlp(x.flatten(1)), y)
        cnn = f.cross_entropy(self.cnn(x), y)
        h = self.block(self.emb(t[:, :-1]) + self.pos[:SEQ - 1])
        logits = paddle.matmul(h, self.emb.weight, transpose_y=True)  # tied with the embedding
        lm = f.cross_entropy(logits.reshape([-1, VOCAB]), t[:, 1:].reshape([-1]))
        return mlp + cnn + lm


def model(seed: int = 0) -> Trio:
    paddle.seed(seed)
    return Trio()


def schedule(lr: float):
    cosine = paddle.optimizer.lr.CosineAnnealingDecay(lr, T_max=TOTAL - WARMUP)
    return paddle.optimizer.lr.LinearWarmup(cosine, warmup_steps=WARMUP, start_lr=lr / WARMUP, end_lr=lr)


def two_groups(m: nn.Layer, **rest):
    decay = [p for p in m.parameters() if len(p.shape) >= 2]
    others = [p for p in m.parameters() if len(p.shape) < 2]
    return [{"params": decay}, {"params": others, "learning_rate": 0.5, **rest}]


def _adamw(m, s):
    no_decay = {p.name for p in m.parameters() if len(p.shape) < 2}
    return paddle.optimizer.AdamW(s, parameters=two_groups(m), beta1=0.8, weight_decay=0.1,
                                  apply_decay_param_fun=lambda n: n not in no_decay,
                                  grad_clip=nn.ClipGradByGlobalNorm(1.0))


OPTIMIZERS = {
    "sgd": lambda m, s: paddle.optimizer.SGD(s, parameters=two_groups(m, weight_decay=0.0), weight_decay=1e-2,
                                             grad_clip=nn.ClipGradByValue(0.5)),
    "momentum_nesterov": lambda m, s: paddle.optimizer.Momentum(s, momentum=0.9, use_nesterov=True,
                                                                parameters=two_groups(m), weight_decay=1e-3),
    "adam": lambda m, s: paddle.optimizer.Adam(s, parameters=two_groups(m), weight_decay=1e-2,
                                               grad_clip=nn.ClipGradByNorm(0.5)),
    "adamw_decay_fun": _adamw,
    "rmsprop": lambda m, s: paddle.optimizer.RMSProp(s, rho=0.9, momentum=0.5, centered=True,
                                                     parameters=two_groups(m)),
    "adagrad": lambda m, s: paddle.optimizer.Adagrad(s, parameters=two_groups(m), initial_accumulator_value=0.1),
}
LR = {"sgd": 0.05, "momentum_nesterov": 0.05, "adam": 3e-3, "adamw_decay_fun": 3e-3, "rmsprop": 1e-3,
      "adagrad": 0.05}


def make(name: str, m: nn.Layer):
    sched = schedule(LR[name])
    return OPTIMIZERS[name](m, sched), sched


def values(m: nn.Layer) -> dict:
    return {n: p.numpy().copy() for n, p in m.named_parameters()}


def train(m, opt, sched, data, ps=None, on_step=None, lock=None):
    """The plain script's loop; with ``ps``, ``ps.step()`` replaces ``optimizer.step()``.

    ``lock``: held around the forward and backward pass, for workers that are threads of one
    process (paddle's eager autograd keeps per-process state)."""
    for i, (images, tokens, labels) in enumerate(data):
        if on_step is not None:
            on_step(i, m, opt)
        with lock or contextlib.nullcontext():
            m.loss(images, tokens, labels).backward()
        ps.step() if ps is not None else opt.step()
        opt.clear_grad()
        sched.step()
