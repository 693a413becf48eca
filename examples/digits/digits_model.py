"""The digits classifiers' model code, for training, export and serving: the MLP (train_torch.py,
train_paddle.py) and the small CNN with BatchNorm (train_cnn_torch.py, train_cnn_paddle.py).

    hfleet registry export digits@prod --format onnx --model examples/digits/digits_model.py:build_torch -o out/digits-onnx
    hfleet registry export digits@prod --format paddle-inference --model examples/digits/digits_model.py:build_paddle -o out/digits-paddle
    hfleet registry export digits-cnn@prod --format onnx --model examples/digits/digits_model.py:build_cnn_torch -o out/digits-cnn-onnx
    hfleet registry export digits-cnn@prod --format paddle-inference --model examples/digits/digits_model.py:build_cnn_paddle -o out/digits-cnn-paddle

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


def build_cnn_torch():
    """The torch CNN of train_cnn_torch.py: (N, 64) pixels -> 8x8 image -> conv + BatchNorm + pool -> (N, 10) logits."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 8, 8)),
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Dropout(0.1), torch.nn.Linear(8 * 4 * 4, 10),
    )


def build_cnn_paddle():
    """The paddle CNN of train_cnn_paddle.py, layer for layer the torch one."""
    import paddle

    return paddle.nn.Sequential(
        paddle.nn.Unflatten(1, (1, 8, 8)),
        paddle.nn.Conv2D(1, 8, 3, padding=1), paddle.nn.BatchNorm2D(8), paddle.nn.ReLU(), paddle.nn.MaxPool2D(2),
        paddle.nn.Flatten(), paddle.nn.Dropout(0.1), paddle.nn.Linear(8 * 4 * 4, 10),
    )


def sample_inputs(rows: int = 256) -> np.ndarray:
    """The first ``rows`` rows of the held-out test set (float32, 64 features)."""
    return load_test()[0][:rows].astype(np.float32)
