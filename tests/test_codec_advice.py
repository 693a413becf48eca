"""Sparse-codec advice: a model that keeps too few coordinates a step is warned about, with the fix."""

from __future__ import annotations

import pytest
import yaml

from hybridfleet.cli.app import main
from hybridfleet.codec.advice import MIN_KEPT_PER_STEP, kept_per_step, sparse_advice
from hybridfleet.spec.models import CompressionSpec, OptimizerSpec
from tests.conftest import REPO

# the 14k-parameter CNN of the reported run: conv 8x1x3x3, conv 16x8x3x3, BatchNorm, a 10-way head
SMALL_CNN = {"c1.w": 72, "c1.b": 8, "bn1.w": 8, "bn1.b": 8, "c2.w": 1152, "c2.b": 16, "bn2.w": 16, "bn2.b": 16,
             "fc.w": 12544, "fc.b": 10}
MLP_1M = {"fc1.w": 64 * 2048, "fc1.b": 2048, "fc2.w": 2048 * 512, "fc2.b": 512, "fc3.w": 5120, "fc3.b": 10}


def test_kept_per_step_counts_at_least_one_coordinate_per_tensor():
    assert kept_per_step(0.01, {"w": 1000, "b": 10}) == 10 + 1
    assert kept_per_step(0.5, {"one": 1}) == 1


def test_small_model_at_one_percent_is_warned_naming_a_ratio_that_keeps_enough_and_dgc():
    advice = sparse_advice(CompressionSpec(codec="topk", ratio=0.01), SMALL_CNN)
    assert advice is not None
    assert f"keeps {kept_per_step(0.01, SMALL_CNN)} of this model's {sum(SMALL_CNN.values())} coordinates" in advice
    ratio = float(advice.split("ps.compression.ratio: ")[1].split()[0])
    assert kept_per_step(ratio, SMALL_CNN) >= MIN_KEPT_PER_STEP and ratio <= 0.1
    assert "compression.momentum: 0.9" in advice and "slower" in advice
    assert sparse_advice(CompressionSpec(codec="topk", ratio=ratio), SMALL_CNN) is None
    with_momentum = sparse_advice(CompressionSpec(codec="topk", ratio=0.01), SMALL_CNN,
                                  OptimizerSpec(name="sgd", lr=0.03, momentum=0.9))
    assert "with server-side momentum such a model trains below either site alone" in with_momentum


def test_large_model_dense_codecs_and_dgc_are_not_misadvised():
    assert sparse_advice(CompressionSpec(codec="topk", ratio=0.01), MLP_1M) is None
    assert sparse_advice(CompressionSpec(codec="int8"), SMALL_CNN) is None
    with_dgc = sparse_advice(CompressionSpec(codec="randomk", ratio=0.01, momentum=0.9), SMALL_CNN)
    assert with_dgc is not None and "momentum" not in with_dgc.split("use ")[1]


def test_spec_check_notes_the_smallest_model_a_sparse_ratio_trains(tmp_path, capsys, monkeypatch):
    data = yaml.safe_load((REPO / "examples" / "digits-hybrid.yaml").read_text())
    data["entrypoint"] = str(REPO / data["entrypoint"])
    data["ps"]["optimizer"] = {"name": "sgd", "lr": 0.3}
    data["ps"]["compression"] = {"codec": "topk", "ratio": 0.01}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        main(["spec", "check", str(path)])
    except SystemExit as done:
        assert done.code in (0, None)
    assert "note: ps.compression: topk at ratio 0.01 keeps 1000 coordinates a step only for models of at least " \
           "100,000 parameters" in capsys.readouterr().err
