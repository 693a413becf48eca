"""The character-level transformer of the charlm example, built the same way in PyTorch and Paddle.

A GPT-style decoder over bytes: token and position embeddings, ``layers`` pre-LayerNorm
blocks (causal multi-head self-attention, then a GELU MLP of width 4 x ``d_model``), a
final LayerNorm, and logits from the token embedding itself (tied input/output
embeddings: one parameter, ``tok.weight``, used twice). Both frameworks use the same
parameter names; a Linear weight is [out, in] in torch and [in, out] in paddle, as the
checkpoint converter expects (`hybridfleet.frameworks.layout`). Both start from the same
values: `initial_values` draws them with numpy from one seed.

    hfleet registry export charlm@prod --format onnx --model examples/charlm/charlm_model.py:build_torch -o out/charlm-onnx
    hfleet registry export charlm@prod --format paddle-inference --model examples/charlm/charlm_model.py:build_paddle -o out/charlm-paddle

(add ``--model-arg layers=N --model-arg d_model=N --model-arg context=N --model-arg heads=N`` for a model
trained with other sizes; the export's input is int64 token ids ``[batch, context]``).

Defaults: 4 layers, d_model 256, context 128, 4 heads (about 3.3M parameters);
``--layers --d-model --context --heads`` on the training scripts shrink it.
"""

from __future__ import annotations

import math

import numpy as np

VOCAB = 256
INIT_STD = 0.02


def shapes(layers: int = 4, d_model: int = 256, context: int = 128) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and torch shape, in model order."""
    d = d_model
    out: dict[str, tuple[int, ...]] = {"tok.weight": (VOCAB, d), "pos.weight": (context, d)}
    for i in range(layers):
        b = f"blocks.{i}."
        out.update({b + "ln1.weight": (d,), b + "ln1.bias": (d,), b + "qkv.weight": (3 * d, d), b + "qkv.bias": (3 * d,),
                    b + "proj.weight": (d, d), b + "proj.bias": (d,), b + "ln2.weight": (d,), b + "ln2.bias": (d,),
                    b + "fc.weight": (4 * d, d), b + "fc.bias": (4 * d,), b + "out.weight": (d, 4 * d),
                    b + "out.bias": (d,)})
    out.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    return out


def decayed(name: str) -> bool:
    """Whether AdamW decays the parameter ``name``: Linear weights only (no biases, norms or embeddings)."""
    return name.endswith(("qkv.weight", "proj.weight", "fc.weight", "out.weight"))


def initial_values(layers: int = 4, d_model: int = 256, context: int = 128, seed: int = 0) -> dict[str, np.ndarray]:
    """The initial parameters (torch layout, float32): normal(0, 0.02) weights and embeddings, the residual
    projections scaled by 1/sqrt(2 * layers) (GPT-2), zero biases, unit LayerNorm scales."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes(layers, d_model, context).items():
        if name.endswith("bias"):
            value = np.zeros(shape)
        elif ".ln" in name or name.startswith("ln_f"):
            value = np.ones(shape)
        else:
            std = INIT_STD / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else INIT_STD
            value = rng.normal(0.0, std, shape)
        out[name] = value.astype(np.float32)
    return out


def _sizes(layers, d_model, context, heads, seed) -> tuple[int, int, int, int, int]:
    """The sizes as integers (``hfleet registry export --model-arg`` passes text), d_model checked against heads."""
    layers, d_model, context, heads, seed = (int(v) for v in (layers, d_model, context, heads, seed))
    if d_model % heads:
        raise ValueError(f"--d-model ({d_model}) must be a multiple of --heads ({heads})")
    return layers, d_model, context, heads, seed


def build_torch(layers: int = 4, d_model: int = 256, context: int = 128, heads: int = 4, seed: int = 0):
    """The torch model: ``model(tokens [batch, time] int64) -> logits [batch, time, 256]``."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    layers, d_model, context, heads, seed = _sizes(layers, d_model, context, heads, seed)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
            self.fc, self.out = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

        def forward(self, x, mask):
            b, t, _ = x.shape
            q, k, v = (a.reshape(b, t, heads, -1).transpose(1, 2) for a in self.qkv(self.ln1(x)).chunk(3, dim=-1))
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask[:t, :t], dim=-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d_model))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class CharLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, d_model), nn.Embedding(context, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d_model)
            self.register_buffer("mask", torch.full((context, context), float("-inf")).triu(1), persistent=False)

        def forward(self, tokens):
            x = self.tok(tokens) + self.pos.weight[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x, self.mask)
            return F.linear(self.ln_f(x), self.tok.weight)  # tied: the token embedding is the output layer

    model = CharLM()
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, value in initial_values(layers, d_model, context, seed).items():
            params[name].copy_(torch.from_numpy(value))
    return model


def build_paddle(layers: int = 4, d_model: int = 256, context: int = 128, heads: int = 4, seed: int = 0):
    """The paddle model: ``model(tokens [batch, time] int64) -> logits [batch, time, 256]``."""
    import paddle
    from paddle import nn
    from paddle.nn import functional as F

    layers, d_model, context, heads, seed = _sizes(layers, d_model, context, heads, seed)
    head_dim = d_model // heads

    class Block(nn.Layer):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
            self.fc, self.out = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

        def forward(self, x, mask):
            b, t = x.shape[0], x.shape[1]
            q, k, v = (a.reshape([b, t, heads, head_dim]).transpose([0, 2, 1, 3])
                       for a in paddle.chunk(self.qkv(self.ln1(x)), 3, axis=-1))
            att = F.softmax(paddle.matmul(q, k, transpose_y=True) / math.sqrt(head_dim) + mask[:t, :t], axis=-1)
            x = x + self.proj(paddle.matmul(att, v).transpose([0, 2, 1, 3]).reshape([b, t, d_model]))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class CharLM(nn.Layer):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, d_model), nn.Embedding(context, d_model)
            self.blocks = nn.LayerList([Block() for _ in range(layers)])
            self.ln_f = nn.LayerNorm(d_model)
            self.register_buffer("mask", paddle.triu(paddle.full([context, context], float("-inf")), 1),
                                 persistable=False)

        def forward(self, tokens):
            x = self.tok(tokens) + self.pos.weight[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x, self.mask)
            # tied: the token embedding is the output layer
            return paddle.matmul(self.ln_f(x), self.tok.weight, transpose_y=True)

    model = CharLM()
    params = dict(model.named_parameters())
    for name, value in initial_values(layers, d_model, context, seed).items():
        linear = decayed(name)  # the Linear weights, [in, out] in paddle
        params[name].set_value(np.ascontiguousarray(value.T) if linear else value)
    return model


def sample_inputs(rows: int = 32, context: int = 128) -> np.ndarray:
    """``rows`` windows of ``context`` bytes of the held-out test text (int64), on which an export is verified
    (``context`` follows ``--model-arg context=N`` of the export)."""
    from charlm_data import load_test

    rows, context = int(rows), int(context)
    return load_test(context, (context + 1) * rows)[:, :context].astype(np.int64)
