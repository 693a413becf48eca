"""Cross-framework checkpoints: a torch model's checkpoint drives the equivalent paddle model and back."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from hybridfleet.ckpt import convert_checkpoint, load_checkpoint, save_checkpoint
from hybridfleet.cli.app import app
from hybridfleet.errors import CheckpointError

VOCAB, EMBED, CHANNELS, CLASSES = 20, 8, 6, 4


def torch_model(seed: int):
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, EMBED)
            self.conv = nn.Conv1d(EMBED, CHANNELS, 3, padding=1)
            self.bn = nn.BatchNorm1d(CHANNELS)
            self.ln = nn.LayerNorm(CHANNELS)
            self.fc = nn.Linear(CHANNELS, CLASSES)

        def forward(self, ids):
            x = self.emb(ids).transpose(1, 2)
            x = torch.relu(self.bn(self.conv(x))).transpose(1, 2)
            return self.fc(self.ln(x).mean(dim=1))

    torch.manual_seed(seed)
    return Net()


def paddle_model(seed: int):
    import paddle
    from paddle import nn

    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, EMBED)
            self.conv = nn.Conv1D(EMBED, CHANNELS, 3, padding=1)
            self.bn = nn.BatchNorm1D(CHANNELS)
            self.ln = nn.LayerNorm(CHANNELS)
            self.fc = nn.Linear(CHANNELS, CLASSES)

        def forward(self, ids):
            x = self.emb(ids).transpose([0, 2, 1])
            x = paddle.nn.functional.relu(self.bn(self.conv(x))).transpose([0, 2, 1])
            return self.fc(self.ln(x).mean(axis=1))

    paddle.seed(seed)
    return Net()


IDS = np.random.default_rng(0).integers(0, VOCAB, size=(5, 7))


def trained_torch():
    """A torch model after a few training steps (non-trivial BatchNorm statistics), in eval mode."""
    import torch

    model = torch_model(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.from_numpy(IDS)).pow(2).mean().backward()
        opt.step()
    return model.eval()


def trained_paddle():
    import paddle

    model = paddle_model(1)
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    for _ in range(3):
        model(paddle.to_tensor(IDS)).pow(2).mean().backward()
        opt.step()
        opt.clear_grad()
    model.eval()
    return model


def torch_out(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model.eval()(torch.from_numpy(IDS)).numpy()


def paddle_out(model) -> np.ndarray:
    import paddle

    model.eval()
    return model(paddle.to_tensor(IDS)).numpy()


def test_torch_checkpoint_converted_to_paddle_gives_same_outputs(tmp_path):
    # Prepare
    source = trained_torch()
    save_checkpoint(tmp_path / "torch", 3, source)
    target = paddle_model(seed=7)
    # Execute
    convert_checkpoint(str(tmp_path / "torch"), str(tmp_path / "paddle"), "paddle")
    info = load_checkpoint(tmp_path / "paddle", target)
    # Assert
    assert info.framework == "paddle"
    np.testing.assert_allclose(paddle_out(target), torch_out(source), rtol=0, atol=1e-5)


def test_paddle_checkpoint_loads_directly_into_torch_model(tmp_path):
    source = trained_paddle()
    save_checkpoint(tmp_path, 3, source)
    target = torch_model(seed=7)

    load_checkpoint(tmp_path, target)

    np.testing.assert_allclose(torch_out(target), paddle_out(source), rtol=0, atol=1e-5)


def test_round_trip_torch_paddle_torch_is_bitwise(tmp_path):
    source = trained_torch()
    save_checkpoint(tmp_path / "a", 1, source)
    convert_checkpoint(str(tmp_path / "a"), str(tmp_path / "b"), "paddle")
    convert_checkpoint(str(tmp_path / "b"), str(tmp_path / "c"), "torch")
    target = torch_model(seed=7)

    load_checkpoint(tmp_path / "c", target)

    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        if name.endswith("num_batches_tracked"):
            continue  # paddle has no counterpart; it restarts at 0
        assert a.equal(b), name


@pytest.mark.torch  # trains or probes torch
def test_unknown_layer_layout_fails_naming_the_tensor(tmp_path):
    import torch

    model = torch.nn.Module()
    model.rnn = torch.nn.LSTM(4, 3)
    model.fc = torch.nn.Linear(3, 2)
    save_checkpoint(tmp_path / "src", 1, model)

    with pytest.raises(CheckpointError, match="tensor 'rnn.bias_hh_l0' has an unknown layout"):
        convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "dst"), "paddle")

    assert not (tmp_path / "dst").exists()


@pytest.mark.torch  # trains or probes torch
def test_cli_convert_writes_target_checkpoint_and_reports_bad_target(tmp_path):
    save_checkpoint(tmp_path / "torch", 4, trained_torch())
    runner = CliRunner()

    ok = runner.invoke(app, ["ckpt", "convert", str(tmp_path / "torch"), str(tmp_path / "paddle"), "--to", "paddle"])
    bad = runner.invoke(app, ["ckpt", "convert", str(tmp_path / "torch"), str(tmp_path / "x"), "--to", "jax"])

    assert ok.exit_code == 0, ok.output
    assert "wrote step 4 for paddle" in ok.output
    assert load_checkpoint(tmp_path / "paddle").framework == "paddle"
    assert bad.exit_code == 2 and "--to must be torch or paddle (got 'jax')" in bad.output
