"""The Kubeflow CRD schemas under tests/schemas/kubeflow, for validating rendered jobs offline."""

from __future__ import annotations

import functools
from pathlib import Path

import yaml

SCHEMAS = Path(__file__).parent / "schemas" / "kubeflow"
CRD_FILES = {"PyTorchJob": "kubeflow.org_pytorchjobs.yaml", "PaddleJob": "kubeflow.org_paddlejobs.yaml",
             "TrainJob": "trainer.kubeflow.org_trainjobs.yaml"}


@functools.cache
def crd_schema(kind: str) -> dict:
    """The OpenAPI v3 schema (a JSON Schema) of the CRD's stored version for ``kind``."""
    crd = yaml.safe_load((SCHEMAS / CRD_FILES[kind]).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return version["schema"]["openAPIV3Schema"]
