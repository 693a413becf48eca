"""KServe's InferenceService CRD (tests/schemas/kserve, copied from kserve/kserve; SOURCE.md) for offline validation.

`validate` runs the CRD's OpenAPI v3 schema as a JSON Schema and, as the API server
does for a structural schema, refuses any field the schema does not declare (a typo like
``canaryTraficPercent`` would otherwise pass silently).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMAS = Path(__file__).parent / "schemas" / "kserve"


@functools.cache
def inference_service_schema() -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD is 2 MB of YAML
    crd = yaml.load((SCHEMAS / "serving.kserve.io_inferenceservices.yaml").read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return version["schema"]["openAPIV3Schema"]


def unknown_fields(obj: Any, schema: dict, path: str = "") -> list[str]:
    """Paths of fields in ``obj`` that ``schema`` does not declare."""
    out: list[str] = []
    if isinstance(obj, dict) and schema.get("type") == "object" and not schema.get("x-kubernetes-preserve-unknown-fields"):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            if props is not None and key in props:
                out += unknown_fields(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                out += unknown_fields(value, extra, f"{path}.{key}")
            elif props is not None and path not in (".metadata",):
                out.append(f"{path}.{key}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            out += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return out


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    schema = inference_service_schema()
    # KServe's own CRD: checking the 2 MB schema itself (as jsonschema.validate does on every call) takes
    # seconds and tests nothing of ours
    return jsonschema.validators.validator_for(schema)(schema)


def validate(isvc: dict) -> None:
    """jsonschema.ValidationError or AssertionError (unknown fields) unless ``isvc`` fits the CRD."""
    schema = inference_service_schema()
    _validator().validate(isvc)
    assert unknown_fields(isvc, schema) == [], unknown_fields(isvc, schema)
