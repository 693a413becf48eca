"""The digits classifier's model code, for export and serving (the same MLP the training scripts build).

    hfleet registry export digits@prod --format onnx --model examples/digits/digits_model.py:build_torch -o out/digits-onnx
    hfleet registry export digits@prod --format paddle-inference --model examples/digits/digits_model.py:build_paddle -o out/digits-paddle

``--model-arg hidden=2048,512`` builds the larger model (`train_torch.py --hidden 2048,512`).
``sample_inputs()`` gives real test rows on which an export is verified.
"""

import numpy as np
from digits_data import load_test


def _widths(hidden: str) -> list[int]:
    return [64, *(int(w) for w in str(hidden).split(",")), 10]


def build_torch(hidden: str = "128"):
    """The torch MLP of train_torch.py: Linear + ReLU layers, logits out."""
    import torch

    layers = []
    for d_in, d_out in zip(_widths(hidden), _widths(hidden)[1:]):
        layers += [torch.nn.Linear(d_in, d_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def build_paddle(hidden: str = "128"):
    """The paddle MLP of train_paddle.py: Linear + ReLU layers, logits out."""
    import paddle

    layers = []
    for d_in, d_out in zip(_widths(hidden), _widths(hidden)[1:]):
        layers += [paddle.nn.Linear(d_in, d_out), paddle.nn.ReLU()]
    return paddle.nn.Sequential(*layers[:-1])


def sample_inputs(rows: int = 256) -> np.ndarray:
    """The first ``rows`` rows of the held-out test set (float32, 64 features)."""
    return load_test()[0][:rows].astype(np.float32)
