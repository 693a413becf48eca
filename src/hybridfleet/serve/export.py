"""Verified export: a version's weights in the job's own model code, exported, run by its runtime, compared.

`export_version` (a registry reference) and `export_checkpoint` (a run's model dir or any
checkpoint root) load the weights into the model a factory builds (`factory`), export it
with the framework's exporter (`exporters`), run the artefact with the runtime that will
serve it (`runtime`) on real inputs, and keep it only when every output is within
``tolerance`` (default 1e-5, absolute) of the framework model's. The artefact is built in
a hidden sibling folder and renamed into place at the end: a refused export leaves
nothing under ``out_dir``. The measured figures go into the artefact's manifest and, for
a registered version, into the version's tags (``export.<format>.*``), with the
artefact copied into the registry's store under ``exports/``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from hybridfleet.ckpt.reader import read_checkpoint
from hybridfleet.ckpt.run_model import read_model_card
from hybridfleet.errors import ExportError, UsageError
from hybridfleet.frameworks.layout import convert_state
from hybridfleet.frameworks.registry import get_adapter
from hybridfleet.registry import artifacts
from hybridfleet.registry.refs import parse_ref
from hybridfleet.serve import exporters
from hybridfleet.serve.factory import build_model, load_factory, load_sample
from hybridfleet.serve.runtime import MANIFEST_NAME, load_runtime
from hybridfleet.store import open_store

DEFAULT_TOLERANCE = 1e-5
DEFAULT_MAX_SAMPLES = 256
TAG_PREFIX = "export"


def export_version(reg: Any, ref: str, fmt: str, out_dir: str | Path, model: str, model_args: dict[str, str] | None = None,
                   sample: str | None = None, tolerance: float = DEFAULT_TOLERANCE, upload: bool = True,
                   max_samples: int = DEFAULT_MAX_SAMPLES) -> dict[str, Any]:  # fmt: skip
    """Export registered version ``ref`` as ``fmt`` under ``out_dir``, verified; its manifest.

    With ``upload`` the artefact is also copied into the registry's store and the version
    gets tags ``export.<fmt>.{uri, manifest_sha256, max_abs_diff, samples, tolerance, provenance}``
    (needs writer on the model). ExportError (nothing written anywhere) when outputs differ.
    """
    _check_format_name(fmt)
    info = reg.resolve_version(ref)
    store = open_store(reg.store_url)
    manifest, state, groups = artifacts.read_version(store, info.manifest_path, info.manifest_sha256)
    source = {"registry_version": f"{info.name}@{info.version}", "manifest_sha256": info.manifest_sha256}
    name = info.name.split("/")[-1]
    result = _export(groups, state, manifest.framework, source, name, fmt, out_dir, model, model_args, sample,
                     tolerance, max_samples, before_publish=(lambda d, m: _upload(reg, store, info, fmt, d, m)) if upload else None)  # fmt: skip
    return result


def export_checkpoint(checkpoint: str, fmt: str, out_dir: str | Path, model: str, model_args: dict[str, str] | None = None,
                      sample: str | None = None, tolerance: float = DEFAULT_TOLERANCE, step: int | None = None,
                      max_samples: int = DEFAULT_MAX_SAMPLES) -> dict[str, Any]:  # fmt: skip
    """Export a run's model dir (its MODEL.json final step) or a checkpoint root's ``step`` (default newest)."""
    _check_format_name(fmt)
    root = open_store(checkpoint)
    if step is None and root.exists("MODEL.json"):
        card = read_model_card(root)
        root, step = open_store(card["url"]), card["final"]["step"]
    elif step is None:
        step = artifacts.newest_step(root)
    manifest, state, groups = read_checkpoint(root, step, check_sha256=True)
    source = {"checkpoint": root.url, "step": step}
    name = Path(checkpoint.rstrip("/")).name if "://" not in checkpoint else checkpoint.rstrip("/").rsplit("/", 1)[-1]
    return _export(groups, state, manifest.framework, source, _model_dir_name(name), fmt, out_dir, model, model_args,
                   sample, tolerance, max_samples, before_publish=None)  # fmt: skip


def _check_format_name(fmt: str) -> None:
    if fmt not in exporters.NEEDS:
        raise UsageError(f"--format must be one of {', '.join(exporters.NEEDS)} (got {fmt!r})")


def _model_dir_name(text: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "-" for c in text.lower()).strip("-.")
    return cleaned or "model"


def _export(groups: dict[str, dict[str, np.ndarray]], state: dict[str, Any], src_framework: str | None,
            source: dict[str, Any], model_name: str, fmt: str, out_dir: str | Path, model_text: str,
            model_args: dict[str, str] | None, sample_path: str | None, tolerance: float, max_samples: int,
            before_publish: Any) -> dict[str, Any]:  # fmt: skip
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"-o {out}: exists and is not an empty folder; exports never overwrite")
    if not tolerance >= 0:
        raise UsageError(f"--tolerance must be >= 0 (got {tolerance})")
    if "model" not in groups:
        raise UsageError("this checkpoint holds raw tensors, not a framework model; nothing to export")
    factory = load_factory(model_text)
    model, framework = build_model(factory, model_args or {})
    exporters.check_format(fmt, framework)
    weights, _ = convert_state(groups["model"], state.get("layouts", {}), src_framework or framework, framework)
    get_adapter(framework).load_model_state(model, weights)
    sample = load_sample(sample_path, factory, max_samples, model_args)
    expected = exporters.reference_outputs(model, framework, sample)
    expected_one = exporters.reference_outputs(model, framework, sample[:1])
    inputs, outputs = exporters.tensor_specs(sample, expected)

    partial = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        started = time.perf_counter()
        if fmt == "onnx":
            files = exporters.export_onnx(model, sample, partial, model_name, inputs, outputs)
        elif fmt == "torch-export":
            files = exporters.export_torch_program(model, sample, partial)
        else:
            files = exporters.export_paddle_inference(model, sample, partial)
        export_s = time.perf_counter() - started
        manifest = {"format": fmt, "model_name": model_name, "framework": framework, "factory": model_text,
                    "factory_args": dict(model_args or {}), "source": source, "inputs": [t.to_dict() for t in inputs],
                    "outputs": [t.to_dict() for t in outputs],
                    "files": [{"role": role, "path": path, "sha256": _sha256(partial / path),
                               "size_bytes": (partial / path).stat().st_size} for role, path in sorted(files.items())]}  # fmt: skip
        (partial / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        verification = verify(partial, {"input": sample}, expected, {"input": sample[:1]}, expected_one, tolerance)
        verification["export_s"] = round(export_s, 3)
        manifest["verification"] = verification
        if not verification["passed"]:
            raise ExportError(f"{fmt} artefact refused: its outputs differ from the {framework} model's by up to "
                              f"{verification['max_abs_diff']:.3g} (tolerance {tolerance:g}) on {verification['samples']} "
                              f"real inputs; nothing was written")  # fmt: skip
        (partial / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if before_publish is not None:
            manifest = before_publish(partial, manifest)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()
        partial.rename(out)
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
    manifest["path"] = str(out)
    return manifest


def verify(directory: Path, batch: dict[str, np.ndarray], expected: np.ndarray, single: dict[str, np.ndarray],
           expected_single: np.ndarray, tolerance: float) -> dict[str, Any]:  # fmt: skip
    """Run the artefact under ``directory`` with its runtime on the sample batch and on one row; the figures."""
    runtime = load_runtime(directory)
    got = runtime.run(batch)[runtime.outputs[0].name]
    got_single = runtime.run(single)[runtime.outputs[0].name]
    diffs = []
    for g, e in ((got, expected), (got_single, expected_single)):
        if g.shape != e.shape:
            return {"passed": False, "runtime": runtime.format, "samples": int(len(expected)), "tolerance": tolerance,
                    "max_abs_diff": float("inf"), "reason": f"output shape {list(g.shape)} != {list(e.shape)}",
                    "provenance": "measured"}  # fmt: skip
        diffs.append(float(np.max(np.abs(g.astype(np.float64) - e.astype(np.float64)))) if g.size else 0.0)
    max_diff = max(diffs)
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    return {"passed": bool(np.isfinite(max_diff) and max_diff <= tolerance), "runtime": runtime.format,
            "samples": int(len(expected)), "batch_sizes": [int(len(expected)), 1], "tolerance": tolerance,
            "max_abs_diff": max_diff, "max_abs_output": scale, "provenance": "measured"}  # fmt: skip


def _upload(reg: Any, store: Any, info: Any, fmt: str, directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Copy the artefact into the registry store (manifest last) and tag the version with the figures."""
    namespace, short = info.name.split("/", 1)
    prefix = f"exports/{namespace}/{short}/v{info.version}/{fmt}-{uuid.uuid4().hex[:8]}"
    uri = f"{store.url}/{prefix}"
    manifest = {**manifest, "uri": uri}
    data = json.dumps(manifest, indent=2, sort_keys=True).encode()
    (directory / MANIFEST_NAME).write_bytes(data)
    for entry in manifest["files"]:
        store.put_bytes(f"{prefix}/{entry['path']}", (directory / entry["path"]).read_bytes())
    store.put_bytes(f"{prefix}/{MANIFEST_NAME}", data)
    v = manifest["verification"]
    reg.set_tags(f"{info.name}@{info.version}", {
        f"{TAG_PREFIX}.{fmt}.uri": uri, f"{TAG_PREFIX}.{fmt}.manifest_sha256": hashlib.sha256(data).hexdigest(),
        f"{TAG_PREFIX}.{fmt}.max_abs_diff": f"{v['max_abs_diff']:.3e}", f"{TAG_PREFIX}.{fmt}.samples": str(v["samples"]),
        f"{TAG_PREFIX}.{fmt}.tolerance": f"{v['tolerance']:g}", f"{TAG_PREFIX}.{fmt}.provenance": "measured"})  # fmt: skip
    return manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_export(reg: Any, ref: str, fmt: str, cache_dir: str | Path) -> tuple[Path, Any]:
    """The verified artefact of ``ref`` (a version, not an alias) as a local folder under ``cache_dir``; (path, info).

    Files come from the registry store at the version's ``export.<fmt>.uri`` and are
    checked against the tagged manifest sha256 and each file's sha256 before use.
    """
    parse_ref(ref)
    info = reg.get_version(ref)
    uri = info.tags.get(f"{TAG_PREFIX}.{fmt}.uri")
    wanted = info.tags.get(f"{TAG_PREFIX}.{fmt}.manifest_sha256")
    if not uri or not wanted:
        raise UsageError(f"{info.name} v{info.version} has no verified {fmt} export; run "
                         f"`hfleet registry export {info.name}@{info.version} --format {fmt} --model ... -o DIR`")  # fmt: skip
    local = Path(cache_dir).expanduser().resolve() / info.name / f"v{info.version}" / wanted[:16]
    if (local / MANIFEST_NAME).exists() and _sha256(local / MANIFEST_NAME) == wanted:
        return local, info
    store = open_store(uri)
    data = store.get_bytes(MANIFEST_NAME)
    if hashlib.sha256(data).hexdigest() != wanted:
        raise ExportError(f"{uri}/{MANIFEST_NAME}: sha256 differs from the one the registry recorded (replaced or corrupt)")
    manifest = json.loads(data)
    partial = local.parent / f".{local.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        for entry in manifest["files"]:
            blob = store.get_bytes(entry["path"])
            if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
                raise ExportError(f"{uri}/{entry['path']}: sha256 differs from the artefact's manifest (corrupt)")
            (partial / entry["path"]).parent.mkdir(parents=True, exist_ok=True)
            (partial / entry["path"]).write_bytes(blob)
        (partial / MANIFEST_NAME).write_bytes(data)
        if local.exists():
            shutil.rmtree(local)
        partial.rename(local)
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
    return local, info
