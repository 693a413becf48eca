"""Model factories for the serve tests: the digits MLP trained a few steps, and models an exporter gets wrong.

The "drifting" models add a Python-side call counter to their output: the exporter bakes
the value it saw while tracing into the artefact, so the artefact's outputs differ from the
eager model's. That is a real class of export bug (Python state is not part of the graph),
used here to prove a mismatching artefact is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"
DIGITS_FACTORY = str(DIGITS / "digits_model.py")
DRIFTING_FACTORY = str(Path(__file__).resolve())
if str(DIGITS) not in sys.path:
    sys.path.insert(0, str(DIGITS))

from digits_data import load_site, load_test  # noqa: E402
from digits_model import build_paddle, build_torch  # noqa: E402


def sample_inputs() -> np.ndarray:
    return load_test()[0][:64].astype(np.float32)


def trained_digits(root: Path | str, framework: str, steps: int = 30, seed: int = 0, hidden: str = "128") -> str:
    """A run-style checkpoint of the digits MLP after ``steps`` Adam steps on site-a rows; its URL."""
    from hybridfleet.ckpt.run_model import ModelCheckpointer

    x, y = load_site("digits:site-a")
    rng = np.random.default_rng(seed)
    if framework == "torch":
        import torch
        import torch.nn.functional as F

        torch.manual_seed(seed)
        model = build_torch(hidden)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        for _ in range(steps):
            batch = rng.integers(0, len(x), 64)
            loss = F.cross_entropy(model(torch.from_numpy(x[batch])), torch.from_numpy(y[batch]).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
    else:
        import paddle
        import paddle.nn.functional as F

        paddle.seed(seed)
        model = build_paddle(hidden)
        opt = paddle.optimizer.Adam(learning_rate=3e-3, parameters=model.parameters())
        for _ in range(steps):
            batch = rng.integers(0, len(x), 64)
            loss = F.cross_entropy(model(paddle.to_tensor(x[batch])), paddle.to_tensor(y[batch].astype("int64")))
            opt.clear_grad()
            loss.backward()
            opt.step()
    ckpt = ModelCheckpointer(str(root), framework, keep_last=2)
    ckpt.final(steps, model, {"test_accuracy": 0.9})
    return ckpt.store.url


def build_drifting_torch():
    """The digits MLP plus a call counter in its output (same tensors as build_torch)."""
    import torch

    class Drifting(torch.nn.Sequential):
        def forward(self, x):
            self.calls = getattr(self, "calls", 0) + 1
            return super().forward(x) + 0.01 * self.calls

    return Drifting(*build_torch())


def build_drifting_paddle():
    """The paddle digits MLP plus a call counter in its output."""
    import paddle

    class Drifting(paddle.nn.Sequential):
        def forward(self, x):
            self.calls = getattr(self, "calls", 0) + 1
            return super().forward(x) + 0.01 * self.calls

    return Drifting(*build_paddle())
