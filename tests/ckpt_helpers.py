"""Stores for checkpoint tests: real file stores with one behaviour changed."""

from __future__ import annotations

import threading

from hybridfleet.store.file import FileStore


class GatedStore(FileStore):
    """A real file store whose writes wait until the test opens the gate (to hold a save in flight)."""

    def __init__(self, root):
        super().__init__(root)
        self.gate = threading.Event()

    def _put_parts(self, path, parts):
        self.gate.wait()
        super()._put_parts(path, parts)
