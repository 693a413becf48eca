"""A small CNN with BatchNorm in torch and paddle, and the plain-script pieces the buffer tests compare with."""

from __future__ import annotations

import numpy as np


def make_model(framework: str, seed: int = 0, extra_buffer: int | None = None):
    """Conv(1->4, 3x3) -> BatchNorm -> ReLU -> Linear(144 -> 3); ``extra_buffer``: a registered buffer of that size."""
    if framework == "torch":
        import torch

        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                    torch.nn.Flatten(), torch.nn.Linear(144, 3))
        if extra_buffer is not None:
            model.register_buffer("scale", torch.ones(extra_buffer))
        return model
    import paddle

    paddle.seed(seed)
    model = paddle.nn.Sequential(paddle.nn.Conv2D(1, 4, 3), paddle.nn.BatchNorm2D(4), paddle.nn.ReLU(),
                                 paddle.nn.Flatten(), paddle.nn.Linear(144, 3))
    if extra_buffer is not None:
        model.register_buffer("scale", paddle.ones([extra_buffer]))
    return model


def batch(seed: int, n: int, shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, 1, 8, 8)) * (1 + shift) + shift).astype(np.float32)
    return x, rng.integers(0, 3, n).astype(np.int64)


def loss(framework: str, model, x: np.ndarray, y: np.ndarray):
    if framework == "torch":
        import torch

        return torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
    import paddle

    return paddle.nn.functional.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y))


def sgd(framework: str, model, lr: float):
    if framework == "torch":
        import torch

        return torch.optim.SGD(model.parameters(), lr=lr)
    import paddle

    return paddle.optimizer.SGD(learning_rate=lr, parameters=model.parameters())


def state(framework: str, model) -> dict[str, np.ndarray]:
    """Every tensor of the state dict as numpy (parameters and buffers)."""
    if framework == "torch":
        return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return {k: np.array(v.numpy()) for k, v in model.state_dict().items()}


def buffer_names(framework: str) -> list[str]:
    if framework == "torch":
        return ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    return ["1._mean", "1._variance"]


def copy_model(framework: str, model):
    """A fresh model holding ``model``'s state (a deepcopy would copy the connected handle's hook)."""
    twin = make_model(framework, seed=1)
    if framework == "torch":
        twin.load_state_dict(model.state_dict())
    else:
        twin.set_state_dict(model.state_dict())
    return twin
