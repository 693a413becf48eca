"""One job, two frameworks: a worker whose site trains with another framework than the job's.

Parameters travel under the job framework's names and layouts (the canonical ones), so
the shards, their optimizer and every other worker see one model. A worker of the other
framework maps its trainable tensors on join and on every push and pull with the table
the checkpoint converter uses (`hybridfleet.frameworks.layout`): a Linear weight is
transposed (torch [out, in], paddle [in, out]); conv, embedding and norm weights share
one layout. A tensor of a layer with no known mapping (LSTM, fused attention, custom
layers) is refused before joining, naming it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridfleet.errors import CheckpointError, SpecError


class CanonicalLayout:
    """Maps one worker's native tensors to the job's canonical names and layouts and back."""

    def __init__(self, mapping: dict[str, tuple[str, bool]]):
        self.mapping = mapping  # native name -> (canonical name, transpose)
        self.native = {canon: (name, transpose) for name, (canon, transpose) in mapping.items()}

    @classmethod
    def for_model(cls, model: Any, names: list[str], framework: str, canonical: str,
                  site: str) -> "CanonicalLayout | None":
        """The mapping of ``model``'s trainable tensors ``names``; None when ``framework`` is the canonical one."""
        if framework == canonical:
            return None
        from hybridfleet.frameworks import get_adapter
        from hybridfleet.frameworks.layout import param_layout

        kinds = get_adapter(framework).module_kinds(model)
        try:
            return cls(param_layout(names, kinds, framework, canonical))
        except CheckpointError as err:
            raise SpecError(f"sites.{site}.framework: this {framework} model cannot join a {canonical} job: {err}; "
                            f"use one framework for this model, or layers with a known mapping") from None

    def shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        out = {}
        for name, shape in shapes.items():
            canon, transpose = self.mapping[name]
            out[canon] = tuple(reversed(shape)) if transpose else tuple(shape)
        return out

    def to_canonical(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for name, arr in arrays.items():
            canon, transpose = self.mapping[name]
            out[canon] = np.ascontiguousarray(arr.T) if transpose else arr
        return out

    def to_native(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for canon, arr in arrays.items():
            name, transpose = self.native[canon]
            out[name] = np.ascontiguousarray(arr.T) if transpose else arr
        return out
