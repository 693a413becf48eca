"""Job spec: pydantic models for the YAML job file, loading and validation messages."""

from hybridfleet.spec.load import load_spec, parse_spec
from hybridfleet.spec.models import JobSpec

__all__ = ["JobSpec", "load_spec", "parse_spec"]
