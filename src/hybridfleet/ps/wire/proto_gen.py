"""Regenerate the gRPC/protobuf modules from ``proto/``: ``python -m hybridfleet.ps.wire.proto_gen``.

The generated files under ``hybridfleet/ps/_proto/`` are committed and never
edited by hand; running this again gives the same files for the same
grpcio-tools version.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
PROTO_ROOT = REPO / "proto"
OUT = Path(__file__).resolve().parent / "_proto"


def main(out: Path = OUT) -> int:
    """Generate into ``out`` (default: the package's ``_proto``); returns protoc's exit code."""
    from grpc_tools import protoc  # dev dependency: pip install 'hybridfleet[dev]'

    out.mkdir(exist_ok=True)
    sources = sorted((PROTO_ROOT / "hybridfleet/ps/v1").glob("*.proto"))
    tmp = out / "_gen"
    tmp.mkdir(exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}",
        f"--python_out={tmp}", f"--grpc_python_out={tmp}", f"--pyi_out={tmp}", *map(str, sources),
    ])
    if rc != 0:
        return rc
    gen = tmp / "hybridfleet/ps/v1"
    for f in sorted(gen.iterdir()):
        text = f.read_text()
        # generated imports are absolute from the proto root; make them package-relative
        text = re.sub(r"^from hybridfleet\.ps\.v1 import (\w+_pb2)", r"from hybridfleet.ps.wire._proto import \1", text,
                      flags=re.M)
        (out / f.name).write_text(text)
    for p in sorted(tmp.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    tmp.rmdir()
    (out / "__init__.py").write_text('"""Generated from proto/hybridfleet/ps/v1/*.proto by hybridfleet.ps.wire.proto_gen; do not edit."""\n')
    return 0


if __name__ == "__main__":
    sys.exit(main())
