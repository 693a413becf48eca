"""The generated protobuf/gRPC modules are exactly what `make proto` produces from proto/."""

from __future__ import annotations

from pathlib import Path

from hybridfleet.ps.wire import proto_gen


def test_generated_modules_match_the_proto_file(tmp_path):
    assert proto_gen.main(tmp_path) == 0
    committed = Path(proto_gen.__file__).parent / "_proto"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(p.name for p in committed.iterdir() if p.suffix in (".py", ".pyi"))
    for name in names:
        assert (tmp_path / name).read_text() == (committed / name).read_text(), f"{name}: run `make proto`"
