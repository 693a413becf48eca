"""What a site sends, kept and searched for its own training rows (a test mode).

With ``HFLEET_EGRESS_CAPTURE=<file>`` a worker's client appends every byte it hands
to gRPC or to the bulk socket (its plaintext, before TLS) to that file, and
`scan_rows` searches the capture for each training row's bytes in the encodings a
careless program would send them in (float32, float64, float16 and, for integral
data, uint8). `hfleet run --egress-scan` turns it on for every worker and reports
the matches per site in summary.json.

What it proves: no row of the site's data left the site verbatim (or in one of
those encodings) in what the client sent. What it does not: that nothing about
the rows can be inferred from the gradients that did leave (gradient inversion and
membership inference are out of its scope), nor anything about bytes sent by
other code in the worker process, outside the parameter-server client.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CAPTURE_ENV = "HFLEET_EGRESS_CAPTURE"
# Rows shorter than this in an encoding are not searched in it (too likely to match by chance).
MIN_PATTERN_BYTES = 16


class EgressCapture:
    """Appends every sent byte to one file (its owner serializes the calls)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab")
        self.nbytes = 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self._file.write(view)
        self.nbytes += len(view)

    def close(self) -> None:
        self._file.close()


def row_patterns(row: np.ndarray) -> list[bytes]:
    """The byte patterns row ``row`` would have on the wire if it were sent as data."""
    flat = np.asarray(row).reshape(-1)
    pats = [flat.astype("<f4").tobytes(), flat.astype("<f8").tobytes(), flat.astype("<f2").tobytes()]
    if flat.size and np.all(np.equal(np.mod(flat, 1), 0)) and flat.min() >= 0 and flat.max() <= 255:
        pats.append(flat.astype(np.uint8).tobytes())
    return [p for p in pats if len(p) >= MIN_PATTERN_BYTES and len(set(p)) > 1]


def scan_rows(capture: bytes, rows: np.ndarray) -> dict:
    """``{"bytes_scanned", "rows_scanned", "rows_found", "first_found"}``: how many of ``rows`` (one
    per first-axis entry) appear in ``capture`` in any of `row_patterns`."""
    rows = np.asarray(rows)
    found, first = 0, None
    for i, row in enumerate(rows):
        if any(capture.find(p) >= 0 for p in row_patterns(row)):
            found += 1
            first = i if first is None else first
    return {"bytes_scanned": len(capture), "rows_scanned": int(len(rows)), "rows_found": found, "first_found": first}
