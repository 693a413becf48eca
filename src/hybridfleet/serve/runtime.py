"""Run an exported artefact with the runtime that serves it: onnxruntime, Paddle Inference, torch.export.

Every runtime offers the same narrow surface: the tensors it takes and gives
(`TensorSpec`) and `run(inputs) -> outputs` on numpy arrays. Export verification and
`hfleet serve` use the same loaders, so what was verified is what is served.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybridfleet.errors import CheckpointError, FrameworkMissingError

MANIFEST_NAME = "EXPORT.manifest"  # JSON; not *.json, which KServe's Paddle server would take for the model file
FORMATS = ("onnx", "torch-export", "paddle-inference")
PLATFORMS = {"onnx": "onnx_onnxv1", "torch-export": "pytorch_torchexport", "paddle-inference": "paddle_inference"}

# numpy dtype name <-> Open Inference Protocol datatype
OIP_DATATYPES = {"bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
                 "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64", "float16": "FP16",
                 "float32": "FP32", "float64": "FP64"}  # fmt: skip
NUMPY_DTYPES = {v: k for k, v in OIP_DATATYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: name, OIP datatype, shape (-1 = any size)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(str(d["name"]), str(d["datatype"]), tuple(int(s) for s in d["shape"]))


class Runtime(ABC):
    """A loaded artefact; `run` is safe to call from several threads."""

    format: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    inline_ok = False  # a small request may run on the server's event loop (no lock, no thread pool of its own)

    @property
    def platform(self) -> str:
        return PLATFORMS[self.format]

    @abstractmethod
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Outputs by name for inputs by name (every input given, dtypes as `inputs` declares)."""


class OnnxRuntime(Runtime):
    format = "onnx"
    inline_ok = True  # one session serves concurrent run() calls without a lock

    def __init__(self, path: Path, inputs: list[TensorSpec], outputs: list[TensorSpec], threads: int = 1):
        try:
            import onnxruntime as ort
        except ImportError as err:
            raise FrameworkMissingError("ONNX artefacts run on onnxruntime: pip install 'hybridfleet[serve]'") from err
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.inputs, self.outputs = inputs, outputs
        self._names = [o.name for o in outputs]

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self._names, self.session.run(self._names, inputs)))


class PaddleInferenceRuntime(Runtime):
    format = "paddle-inference"

    def __init__(self, model_file: Path, params_file: Path, inputs: list[TensorSpec], outputs: list[TensorSpec],
                 threads: int = 1):  # fmt: skip
        try:
            from paddle import inference
        except ImportError as err:
            raise FrameworkMissingError("Paddle Inference artefacts need paddle: pip install 'hybridfleet[paddle]'") from err
        config = inference.Config(str(model_file), str(params_file))
        config.disable_gpu()
        config.disable_glog_info()
        # oneDNN's convolutions sum in another order than eager paddle: up to 3e-5 apart on the fashion
        # ResNet's logits, over the export's 1e-5; the served predictor is the verified one, without it
        config.disable_mkldnn()
        config.set_cpu_math_library_num_threads(threads)
        self.predictor = inference.create_predictor(config)
        self.inputs, self.outputs = inputs, outputs
        self._lock = threading.Lock()  # one predictor holds one set of input/output handles

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            for spec, name in zip(self.inputs, self.predictor.get_input_names()):
                handle = self.predictor.get_input_handle(name)
                handle.reshape(list(inputs[spec.name].shape))
                handle.copy_from_cpu(np.ascontiguousarray(inputs[spec.name]))
            self.predictor.run()
            names = self.predictor.get_output_names()
            return {spec.name: self.predictor.get_output_handle(n).copy_to_cpu() for spec, n in zip(self.outputs, names)}


class TorchExportRuntime(Runtime):
    format = "torch-export"

    def __init__(self, path: Path, inputs: list[TensorSpec], outputs: list[TensorSpec]):
        try:
            import torch
        except ImportError as err:
            raise FrameworkMissingError("torch.export artefacts need torch: pip install 'hybridfleet[torch]'") from err
        self._torch = torch
        self.module = torch.export.load(str(path)).module()
        self.inputs, self.outputs = inputs, outputs

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        with torch.no_grad():
            out = self.module(*(torch.from_numpy(np.ascontiguousarray(inputs[s.name])) for s in self.inputs))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return {s.name: o.detach().numpy() for s, o in zip(self.outputs, outs)}


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The artefact's manifest (format, files with sha256, tensors, verification); CheckpointError if absent."""
    path = Path(directory) / MANIFEST_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{directory}: no readable {MANIFEST_NAME}; export it with `hfleet registry export`") from err


def load_runtime(directory: str | Path, threads: int = 1) -> Runtime:
    """The runtime for the artefact exported under ``directory`` (its manifest says which)."""
    root = Path(directory)
    manifest = read_manifest(root)
    inputs = [TensorSpec.from_dict(t) for t in manifest["inputs"]]
    outputs = [TensorSpec.from_dict(t) for t in manifest["outputs"]]
    files = {f["role"]: root / f["path"] for f in manifest["files"]}
    fmt = manifest["format"]
    if fmt == "onnx":
        return OnnxRuntime(files["model"], inputs, outputs, threads)
    if fmt == "paddle-inference":
        return PaddleInferenceRuntime(files["model"], files["params"], inputs, outputs, threads)
    if fmt == "torch-export":
        return TorchExportRuntime(files["model"], inputs, outputs)
    raise CheckpointError(f"{root}: unknown artefact format {fmt!r} (known: {', '.join(FORMATS)})")
