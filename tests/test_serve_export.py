"""Verified export through `hfleet registry export`: torch -> ONNX and torch.export, paddle -> Paddle
Inference (and a paddle-trained version -> ONNX through the torch model code), each artefact run by
its own runtime against the framework model; and every refusal writing nothing anywhere."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridfleet.cli.app import main as cli_main
from hybridfleet.registry import Registry
from hybridfleet.serve.runtime import MANIFEST_NAME
from tests.registry_helpers import files_under, table_counts
from tests.serve_models import DIGITS_FACTORY, DRIFTING_FACTORY, build_paddle, build_torch, load_test, trained_digits


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(args)
        sys.exit(0)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def export_cli(capsys, reg: Registry, ref: str, fmt: str, out, factory: str) -> tuple[int, str, str]:
    """`hfleet registry export REF --format FMT -o OUT --model FACTORY` on ``reg``."""
    return run_cli(["registry", "export", ref, "--format", fmt, "-o", str(out), "--model", factory, "-r", reg.db_url], capsys)


@pytest.fixture
def reg(tmp_path) -> Registry:
    return Registry(f"sqlite:///{tmp_path}/registry.db")


def _registered(reg: Registry, tmp_path: Path, framework: str) -> str:
    reg.register("digits", trained_digits(tmp_path / f"run-{framework}", framework))
    return f"digits@{reg.list_versions('digits')[-1].version}"


def _framework_logits(reg: Registry, ref: str, framework: str, tmp_path: Path, x: np.ndarray) -> np.ndarray:
    """The registered weights in a fresh framework model (via `hfleet registry pull`), run eagerly."""
    pulled = reg.pull(ref, framework, "safetensors", str(tmp_path / f"pulled-{framework}"))
    from hybridfleet.ckpt import safetensors_io
    from hybridfleet.frameworks.registry import get_adapter

    weights, _ = safetensors_io.decode(Path(pulled["path"]).read_bytes(), "pulled")
    model = build_torch() if framework == "torch" else build_paddle()
    get_adapter(framework).load_model_state(model, weights)
    model.eval()
    if framework == "torch":
        import torch

        with torch.no_grad():
            return model(torch.from_numpy(x)).numpy()
    import paddle

    return model(paddle.to_tensor(x)).numpy()


@pytest.mark.torch
def test_torch_version_exports_to_onnx_in_triton_layout_and_onnxruntime_matches_torch(reg, tmp_path, capsys):
    # Prepare: a digits MLP trained a few steps, registered
    import onnxruntime as ort

    ref = _registered(reg, tmp_path, "torch")
    out = tmp_path / "onnx"
    # Execute
    code, stdout, stderr = export_cli(capsys, reg, ref, "onnx", out, f"{DIGITS_FACTORY}:build_torch")
    # Assert: KServe/Triton layout, figures measured, and an independent onnxruntime run matches torch
    assert code == 0, stderr
    assert "onnx artefact verified on 256 inputs" in stdout
    assert files_under(out) == {MANIFEST_NAME, "digits/config.pbtxt", "digits/1/model.onnx"}
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    v = manifest["verification"]
    assert v["passed"] and v["provenance"] == "measured" and v["samples"] == 256 and 0 <= v["max_abs_diff"] <= 1e-5
    assert 'platform: "onnxruntime_onnx"' in (out / "digits/config.pbtxt").read_text()
    x = load_test()[0][256:320]  # rows the verification did not use
    session = ort.InferenceSession(str(out / "digits/1/model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input": x})[0]
    np.testing.assert_allclose(got, _framework_logits(reg, ref, "torch", tmp_path, x), atol=1e-5, rtol=0)
    tags = reg.get_version(ref).tags
    assert tags["export.onnx.provenance"] == "measured" and float(tags["export.onnx.max_abs_diff"]) == pytest.approx(v["max_abs_diff"], rel=1e-3)
    assert tags["export.onnx.uri"] == manifest["uri"] and reg.store.exists(manifest["uri"].split(reg.store.url + "/")[1] + "/" + MANIFEST_NAME)


@pytest.mark.torch
def test_torch_version_exports_as_a_torch_export_program_that_matches_eager(reg, tmp_path, capsys):
    import torch

    ref = _registered(reg, tmp_path, "torch")
    out = tmp_path / "pt2"
    code, stdout, stderr = export_cli(capsys, reg, ref, "torch-export", out, f"{DIGITS_FACTORY}:build_torch")
    assert code == 0, stderr
    assert files_under(out) == {MANIFEST_NAME, "model.pt2"}
    x = load_test()[0][256:300]
    program = torch.export.load(str(out / "model.pt2")).module()
    np.testing.assert_allclose(program(torch.from_numpy(x)).detach().numpy(),
                               _framework_logits(reg, ref, "torch", tmp_path, x), atol=1e-5, rtol=0)  # fmt: skip


@pytest.mark.paddle
def test_paddle_version_exports_for_paddle_inference_and_its_predictor_matches_paddle(reg, tmp_path, capsys):
    from paddle import inference

    ref = _registered(reg, tmp_path, "paddle")
    out = tmp_path / "pd"
    code, stdout, stderr = export_cli(capsys, reg, ref, "paddle-inference", out, f"{DIGITS_FACTORY}:build_paddle")
    assert code == 0, stderr
    assert files_under(out) == {MANIFEST_NAME, "model.json", "model.pdiparams"}  # one program + one params file (KServe's paddle server)
    config = inference.Config(str(out / "model.json"), str(out / "model.pdiparams"))
    config.disable_gpu()
    predictor = inference.create_predictor(config)
    x = load_test()[0][256:300]
    handle = predictor.get_input_handle(predictor.get_input_names()[0])
    handle.reshape(list(x.shape))
    handle.copy_from_cpu(x)
    predictor.run()
    got = predictor.get_output_handle(predictor.get_output_names()[0]).copy_to_cpu()
    np.testing.assert_allclose(got, _framework_logits(reg, ref, "paddle", tmp_path, x), atol=1e-5, rtol=0)
    assert reg.get_version(ref).tags["export.paddle-inference.provenance"] == "measured"


@pytest.mark.torch
@pytest.mark.paddle
def test_paddle_trained_version_exports_to_onnx_through_the_torch_model_code(reg, tmp_path, capsys):
    ref = _registered(reg, tmp_path, "paddle")
    out = tmp_path / "onnx"
    code, _, stderr = export_cli(capsys, reg, ref, "onnx", out, f"{DIGITS_FACTORY}:build_torch")
    assert code == 0, stderr
    import onnxruntime as ort

    x = load_test()[0][256:300]
    got = ort.InferenceSession(str(out / "digits/1/model.onnx"), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    np.testing.assert_allclose(got, _framework_logits(reg, ref, "paddle", tmp_path, x), atol=1e-5, rtol=0)


@pytest.mark.torch
def test_a_run_model_dir_exports_without_a_registry(tmp_path, capsys):
    from hybridfleet.ckpt.run_model import write_model_card

    root = trained_digits(tmp_path / "model", "torch")
    write_model_card(root, {"job": "digits"})
    out = tmp_path / "pt2"
    code, stdout, stderr = run_cli(["registry", "export", str(tmp_path / "model"), "--format", "torch-export", "-o",
                                    str(out), "--model", f"{DIGITS_FACTORY}:build_torch"], capsys)  # fmt: skip
    assert code == 0, stderr
    assert json.loads((out / MANIFEST_NAME).read_text())["source"]["step"] == 30


@pytest.mark.parametrize("framework,fmt", [pytest.param("torch", "onnx", marks=pytest.mark.torch),
                                           pytest.param("torch", "torch-export", marks=pytest.mark.torch),
                                           pytest.param("paddle", "paddle-inference", marks=pytest.mark.paddle)])  # fmt: skip
def test_an_artefact_whose_outputs_differ_is_refused_and_nothing_is_written(reg, tmp_path, capsys, framework, fmt):
    # Prepare: model code whose Python-side counter the exporter bakes in as a constant
    ref = _registered(reg, tmp_path, framework)
    before_rows, before_tags, before_store = table_counts(reg), reg.get_version(ref).tags, files_under(tmp_path / "artifacts")
    out = tmp_path / "out"
    # Execute
    code, _, stderr = export_cli(capsys, reg, ref, fmt, out, f"{DRIFTING_FACTORY}:build_drifting_{framework}")
    # Assert: the reason with the figures; no folder, no partial, no store file, no tag
    assert code == 27
    assert f"{fmt} artefact refused: its outputs differ from the {framework} model's by up to" in stderr
    assert "(tolerance 1e-05) on 64 real inputs; nothing was written" in stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))) == []
    assert table_counts(reg) == before_rows and reg.get_version(ref).tags == before_tags
    assert files_under(tmp_path / "artifacts") == before_store


@pytest.mark.paddle
def test_paddle_model_to_onnx_is_refused_naming_paddle2onnx_and_writes_nothing(reg, tmp_path, capsys):
    ref = _registered(reg, tmp_path, "paddle")
    before = table_counts(reg), files_under(tmp_path / "artifacts")
    code, _, stderr = export_cli(capsys, reg, ref, "onnx", tmp_path / "out", f"{DIGITS_FACTORY}:build_paddle")
    assert code == 2
    assert "paddle2onnx" in stderr and "--format paddle-inference" in stderr
    assert not (tmp_path / "out").exists() and (table_counts(reg), files_under(tmp_path / "artifacts")) == before


@pytest.mark.torch
def test_export_into_a_non_empty_folder_or_with_a_bad_factory_is_refused(reg, tmp_path, capsys):
    ref = _registered(reg, tmp_path, "torch")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    code, _, stderr = export_cli(capsys, reg, ref, "onnx", full, f"{DIGITS_FACTORY}:build_torch")
    assert code == 2 and "exists and is not an empty folder; exports never overwrite" in stderr
    assert files_under(full) == {"keep.txt"}
    code, _, stderr = export_cli(capsys, reg, ref, "onnx", tmp_path / "o", f"{DIGITS_FACTORY}:no_such")
    assert code == 2 and "has no function no_such" in stderr and not (tmp_path / "o").exists()
