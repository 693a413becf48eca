"""bfloat16 and float16 tensors in checkpoints: bit-exact, and the files open with the real safetensors library."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from hybridfleet.ckpt import load_checkpoint, safetensors_io, save_checkpoint


def _model_files(root: Path) -> list[Path]:
    """The model's safetensors files of a checkpoint, by its manifest."""
    manifest = json.loads(next(root.rglob("MANIFEST.json")).read_text())
    return [root / f["path"] for f in manifest["files"] if f["role"] == "model"]


def test_bf16_and_f16_arrays_encode_as_safetensors_and_decode_bit_exact():
    import ml_dtypes
    from safetensors.numpy import load

    bf = np.array([[1.5, -2.25], [3e38, -1e-38]], dtype=ml_dtypes.bfloat16)
    f16 = np.array([0.5, -65504.0], dtype=np.float16)
    raw = b"".join(bytes(p) for p in safetensors_io.encode({"bf": bf, "half": f16}))
    back, _ = safetensors_io.decode(raw)
    assert back["bf"].dtype == bf.dtype and (back["bf"].view(np.uint16) == bf.view(np.uint16)).all()
    assert back["half"].dtype == np.float16 and (back["half"] == f16).all()
    # the reference library reads the F16 tensor as we wrote it (its numpy loader has no BF16)
    assert (load(b"".join(bytes(p) for p in safetensors_io.encode({"half": f16})))["half"] == f16).all()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert header["bf"]["dtype"] == "BF16" and header["half"]["dtype"] == "F16"


@pytest.mark.torch
def test_a_bf16_torch_model_saves_loads_bit_exact_and_its_file_opens_with_safetensors_torch(tmp_path):
    import torch
    from safetensors.torch import load_file

    # Prepare: a bfloat16 model (and a float16 buffer) with values bf16 cannot hold exactly in fp16
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    with torch.no_grad():
        model[0].weight[0, 0] = 1e30  # beyond float16's range: only a real bf16 path keeps it
    model.register_buffer("scale", torch.tensor([0.1, -3.0], dtype=torch.float16))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    # Execute
    save_checkpoint(tmp_path, 1, model)
    target = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    target.register_buffer("scale", torch.zeros(2, dtype=torch.float16))
    load_checkpoint(tmp_path, target, restore_rng=False)
    # Assert: bit for bit, dtypes kept
    for k, v in target.state_dict().items():
        assert v.dtype == want[k].dtype, k
        assert torch.equal(v.view(torch.int16), want[k].view(torch.int16)), k
    # and the real library reads the same values from the file
    found = {}
    for path in _model_files(tmp_path):
        found.update(load_file(str(path)))
    for k, v in want.items():
        assert found[k].dtype == v.dtype and torch.equal(found[k], v), k


@pytest.mark.paddle
def test_a_bf16_paddle_model_saves_and_loads_bit_exact(tmp_path):
    import paddle

    paddle.seed(0)
    model = paddle.nn.Linear(4, 3)
    model.to(dtype="bfloat16")
    want = {k: v.numpy().copy() for k, v in model.state_dict().items()}  # paddle gives bf16 bits as uint16
    save_checkpoint(tmp_path, 1, model)
    paddle.seed(1)
    target = paddle.nn.Linear(4, 3)
    target.to(dtype="bfloat16")
    load_checkpoint(tmp_path, target, restore_rng=False)
    for k, v in target.state_dict().items():
        assert str(v.dtype).endswith("bfloat16"), k
        assert (v.numpy() == want[k]).all(), k
    assert any(not (v == 0).all() for v in want.values())
