"""The Fashion-MNIST classifier: a small ResNet with BatchNorm, the same for PyTorch and Paddle.

    input  per-image standardization (zero mean, unit variance per image)
    stem   conv3x3(1 -> w) + BN + ReLU                      28 x 28
    stage  basic block w -> 2w, stride 2 (1x1 projection)  14 x 14
    stage  basic block 2w -> 4w, stride 2                   7 x 7
    stage  basic block 4w -> 8w, stride 2                   4 x 4
    head   global average pool + linear 8w -> 10

A basic block is conv3x3 + BN + ReLU + conv3x3 + BN, plus the shortcut, then ReLU
(He et al., 2016).

Why the standardization: each worker's BatchNorm normalizes a batch of one site's images in
training (statistics of one scanner and five classes), while the averaged running statistics
serve both sites at test time. A site's affine brightness/contrast shift is undone per image
before the first convolution, so the two no longer disagree. Measured in one process on a
short run (1,500 rows per site, 150 steps, width 4, each step one batch per site through
BatchNorm separately, as the joint job's workers do): without it 0.32 test accuracy against
0.67 for the same model on batches mixed from both sites; with it 0.77 against 0.78. Width ``w`` = 16 (the default) gives 0.30M parameters, 24 gives 0.68M;
tests shrink it with ``--width 4``. Convolutions carry no bias (BatchNorm follows each).

    hfleet registry export fashion@prod --format onnx --model examples/fashion/fashion_model.py:build_torch -o out/fashion-onnx
    hfleet registry export fashion@prod --format paddle-inference --model examples/fashion/fashion_model.py:build_paddle -o out/fashion-paddle

(add ``--model-arg width=N`` when the model was trained with ``--width N``).
"""

from __future__ import annotations

import argparse

import numpy as np

DEFAULT_WIDTH = 16


EPS = 1e-6


def _torch_standardize():
    import torch

    class Standardize(torch.nn.Module):
        """Each image to zero mean and unit variance (undoes a scanner's brightness and contrast)."""

        def forward(self, x):
            mean = x.mean(dim=(1, 2, 3), keepdim=True)
            var = ((x - mean) ** 2).mean(dim=(1, 2, 3), keepdim=True)
            return (x - mean) / torch.sqrt(var + EPS)

    return Standardize()


def _torch_block(c_in: int, c_out: int, stride: int):
    import torch

    class BasicBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = torch.nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
            self.bn1 = torch.nn.BatchNorm2d(c_out)
            self.conv2 = torch.nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
            self.bn2 = torch.nn.BatchNorm2d(c_out)
            self.shortcut = torch.nn.Sequential(torch.nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                                torch.nn.BatchNorm2d(c_out))

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))

    return BasicBlock()


def build_torch(width: int = DEFAULT_WIDTH):
    """The torch ResNet of train_torch.py: (N, 1, 28, 28) images in [0, 1] -> (N, 10) logits."""
    import torch

    w = int(width)
    return torch.nn.Sequential(
        _torch_standardize(), torch.nn.Conv2d(1, w, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(w), torch.nn.ReLU(),
        _torch_block(w, 2 * w, 2), _torch_block(2 * w, 4 * w, 2), _torch_block(4 * w, 8 * w, 2),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8 * w, 10),
    )


def _paddle_standardize():
    import paddle

    class Standardize(paddle.nn.Layer):
        """Each image to zero mean and unit variance (undoes a scanner's brightness and contrast)."""

        def forward(self, x):
            mean = x.mean(axis=[1, 2, 3], keepdim=True)
            var = ((x - mean) ** 2).mean(axis=[1, 2, 3], keepdim=True)
            return (x - mean) / paddle.sqrt(var + EPS)

    return Standardize()


def _paddle_block(c_in: int, c_out: int, stride: int):
    import paddle
    import paddle.nn.functional as F

    class BasicBlock(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = paddle.nn.Conv2D(c_in, c_out, 3, stride, 1, bias_attr=False)
            self.bn1 = paddle.nn.BatchNorm2D(c_out)
            self.conv2 = paddle.nn.Conv2D(c_out, c_out, 3, 1, 1, bias_attr=False)
            self.bn2 = paddle.nn.BatchNorm2D(c_out)
            self.shortcut = paddle.nn.Sequential(paddle.nn.Conv2D(c_in, c_out, 1, stride, bias_attr=False),
                                                 paddle.nn.BatchNorm2D(c_out))

        def forward(self, x):
            out = F.relu(self.bn1(self.conv1(x)))
            return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))

    return BasicBlock()


def build_paddle(width: int = DEFAULT_WIDTH):
    """The paddle ResNet of train_paddle.py, layer for layer the torch one."""
    import paddle

    w = int(width)
    return paddle.nn.Sequential(
        _paddle_standardize(), paddle.nn.Conv2D(1, w, 3, 1, 1, bias_attr=False), paddle.nn.BatchNorm2D(w), paddle.nn.ReLU(),
        _paddle_block(w, 2 * w, 2), _paddle_block(2 * w, 4 * w, 2), _paddle_block(4 * w, 8 * w, 2),
        paddle.nn.AdaptiveAvgPool2D(1), paddle.nn.Flatten(), paddle.nn.Linear(8 * w, 10),
    )


def train_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The training scripts' options (the job's ``args:``): model width and the optimizer's settings."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="channels of the stem (16: 0.30M parameters)")
    parser.add_argument("--lr", type=float, default=0.05, help="peak learning rate (cosine to 0 over the steps)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4, help="L2 weight decay of every parameter")
    parser.add_argument("--test-rows", type=int, default=None, help="evaluate on the first N test images (default all)")
    return parser.parse_args(argv)


def sample_inputs(rows: int = 256) -> np.ndarray:
    """The first ``rows`` rows of the shared test set (float32, N x 1 x 28 x 28), to verify an export on."""
    from fashion_data import load_test

    return load_test(rows)[0]
