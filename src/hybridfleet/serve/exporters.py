"""Write a framework model as an artefact with the framework's own exporter, laid out for its server.

| format | exporter | layout under the artefact directory |
|---|---|---|
| onnx | ``torch.onnx.export`` (dynamo) | ``<model>/config.pbtxt`` + ``<model>/1/model.onnx`` (a Triton model repository: KServe's ONNX runtime) |
| torch-export | ``torch.export.export`` + ``torch.export.save`` | ``model.pt2`` |
| paddle-inference | ``paddle.jit.save`` | ``model.json`` + ``model.pdiparams`` (one of each, as KServe's Paddle server requires) |

The batch dimension is dynamic in every format. Each exporter returns the files it wrote
(role -> path relative to the directory).
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path
from typing import Any

import numpy as np

from hybridfleet.errors import UsageError
from hybridfleet.serve.runtime import OIP_DATATYPES, TensorSpec

INPUT_NAME = "input"
OUTPUT_NAME = "output"
NEEDS = {"onnx": "torch", "torch-export": "torch", "paddle-inference": "paddle"}
PADDLE_ONNX_NOTE = ("paddle -> ONNX would need paddle2onnx, whose newest release (2.1.0) requires onnx<=1.17 "
                    "(the torch exporter needs a newer onnx); export a paddle model with --format paddle-inference, "
                    "or give a torch factory (--model) for the same weights")  # fmt: skip
TRITON_TYPES = {"FP32": "TYPE_FP32", "FP64": "TYPE_FP64", "FP16": "TYPE_FP16", "INT64": "TYPE_INT64",
                "INT32": "TYPE_INT32", "INT8": "TYPE_INT8", "UINT8": "TYPE_UINT8", "BOOL": "TYPE_BOOL"}  # fmt: skip


def check_format(fmt: str, framework: str) -> None:
    """UsageError unless ``fmt`` can be exported from a ``framework`` model."""
    if fmt not in NEEDS:
        raise UsageError(f"--format must be one of {', '.join(NEEDS)} (got {fmt!r})")
    if NEEDS[fmt] != framework:
        if fmt == "onnx":
            raise UsageError(PADDLE_ONNX_NOTE)
        raise UsageError(f"--format {fmt} exports a {NEEDS[fmt]} model; the factory built a {framework} model")


def reference_outputs(model: Any, framework: str, x: np.ndarray) -> np.ndarray:
    """The framework model's own output for ``x`` (eval mode, no gradients)."""
    if framework == "torch":
        import torch

        with torch.no_grad():
            return model(torch.from_numpy(x)).detach().cpu().numpy()
    import paddle

    with paddle.no_grad():
        return model(paddle.to_tensor(x)).numpy()


def tensor_specs(sample: np.ndarray, output: np.ndarray) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The artefact's input and output (batch dimension -1)."""
    def spec(name: str, a: np.ndarray) -> TensorSpec:
        return TensorSpec(name, OIP_DATATYPES[a.dtype.name], (-1, *a.shape[1:]))

    return [spec(INPUT_NAME, sample)], [spec(OUTPUT_NAME, output)]


def export_onnx(model: Any, sample: np.ndarray, out: Path, model_name: str, inputs: list[TensorSpec],
                outputs: list[TensorSpec]) -> dict[str, str]:  # fmt: skip
    """``torch.onnx.export`` into a Triton model repository for ``model_name`` (one file, no external data)."""
    import torch

    version_dir = out / model_name / "1"
    version_dir.mkdir(parents=True)
    batch = torch.export.Dim("batch", min=1)
    with _quiet():
        torch.onnx.export(model, (torch.from_numpy(sample),), str(version_dir / "model.onnx"), input_names=[INPUT_NAME],
                          output_names=[OUTPUT_NAME], dynamic_shapes=({0: batch},), dynamo=True, external_data=False,
                          verbose=False)  # fmt: skip
    (out / model_name / "config.pbtxt").write_text(triton_config(model_name, inputs, outputs))
    return {"model": f"{model_name}/1/model.onnx", "config": f"{model_name}/config.pbtxt"}


def triton_config(model_name: str, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> str:
    """Triton's config.pbtxt for an onnxruntime model whose first dimension is the (dynamic) batch."""
    def block(kind: str, specs: list[TensorSpec]) -> str:
        items = ",\n".join(f'  {{ name: "{s.name}" data_type: {TRITON_TYPES[s.datatype]} dims: [ {", ".join(map(str, s.shape))} ] }}'
                           for s in specs)  # fmt: skip
        return f"{kind} [\n{items}\n]\n"

    return (f'name: "{model_name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
            + block("input", inputs) + block("output", outputs))  # fmt: skip


def export_torch_program(model: Any, sample: np.ndarray, out: Path) -> dict[str, str]:
    """``torch.export.export`` with a dynamic batch, saved as ``model.pt2``."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1)
    with _quiet():
        program = torch.export.export(model, (torch.from_numpy(sample),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(out / "model.pt2"))
    return {"model": "model.pt2"}


def export_paddle_inference(model: Any, sample: np.ndarray, out: Path) -> dict[str, str]:
    """``paddle.jit.save`` with a dynamic batch: ``model.json`` (or ``.pdmodel``) + ``model.pdiparams``."""
    import paddle

    out.mkdir(parents=True, exist_ok=True)
    spec = paddle.static.InputSpec([None, *sample.shape[1:]], str(sample.dtype), INPUT_NAME)
    with _quiet():
        paddle.jit.save(model, str(out / "model"), input_spec=[spec])
    program = "model.json" if (out / "model.json").exists() else "model.pdmodel"
    return {"model": program, "params": "model.pdiparams"}


@contextlib.contextmanager
def _quiet():
    """Exporters print progress and warnings on stdout/logging; hfleet reports the result itself."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(previous)
