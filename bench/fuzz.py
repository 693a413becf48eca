"""Fuzz every wire parser: fastwire (push and pull), codec frames, tokens, bulk HELLO and frames.

    python bench/fuzz.py             # 100,000 inputs per parser
    python bench/fuzz.py --quick     # 2,000 per parser, seconds

Inputs are random bytes (1 in 10) or a valid seed mutated 1-4 times (bytes flipped,
inserted, deleted, a 32-bit field set to 0 / 2**31 / 2**32-1, truncated, spliced with
another seed). Each input is accepted, refused with the project's error, or a failure:
any other exception, a decoded tensor beyond the plan, a shard answering INTERNAL, or
an input taking longer than ``--hang-s`` (a hang). The targets are those of
tests/fuzz_targets.py, which tests/test_fuzz_parsers.py also drives with Hypothesis.
The last line is JSON: inputs, refused and failures, in total and per parser.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("HFLEET_LOG_LEVEL", "error")  # every refusal is logged as a warning

from tests.fuzz_targets import REFUSED, FuzzFailure, all_targets  # noqa: E402

_INTERESTING = [0, 1, 0x7F, 0xFF, 0xFFFF, 1 << 31, (1 << 32) - 1]


def mutate(rng: random.Random, seeds: list[bytes]) -> bytes:
    if rng.random() < 0.1:
        return rng.randbytes(rng.randint(0, 256))
    data = bytearray(rng.choice(seeds))
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        at = rng.randint(0, len(data))
        if op == 0 and data:
            data[min(at, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            data[at:at] = rng.randbytes(rng.randint(1, 8))
        elif op == 2:
            del data[at:at + rng.randint(1, 16)]
        elif op == 3 and len(data) >= 4:
            at = min(at, len(data) - 4)
            data[at:at + 4] = struct.pack("<I", rng.choice(_INTERESTING))
        elif op == 4:
            del data[at:]
        else:
            other = rng.choice(seeds)
            data[at:] = other[rng.randint(0, len(other)):]
    return bytes(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=100_000, help="inputs per parser")
    ap.add_argument("--quick", action="store_true", help="2,000 inputs per parser")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hang-s", type=float, default=2.0, help="an input taking longer is a hang")
    args = ap.parse_args()
    n = 2_000 if args.quick else args.inputs
    rng = random.Random(args.seed)
    rows, examples = {}, {}
    for target in all_targets():
        refused = failures = 0
        started = time.monotonic()
        for _ in range(n):
            data = mutate(rng, target.seeds)
            t0 = time.monotonic()
            try:
                refused += target.run(data) == REFUSED
                if time.monotonic() - t0 > args.hang_s:
                    raise FuzzFailure(f"took {time.monotonic() - t0:.1f} s")
            except FuzzFailure as err:
                failures += 1
                examples.setdefault(target.name, f"{err} on {data[:80]!r}")
        target.close()
        rows[target.name] = {"inputs": n, "refused": refused, "failures": failures,
                             "s": round(time.monotonic() - started, 1)}
    print(f"{'parser':<24}{'inputs':>10}{'refused':>10}{'accepted':>10}{'failures':>10}{'seconds':>9}")
    for name, r in rows.items():
        print(f"{name:<24}{r['inputs']:>10}{r['refused']:>10}{r['inputs'] - r['refused'] - r['failures']:>10}"
              f"{r['failures']:>10}{r['s']:>9}")
    for name, example in examples.items():
        print(f"first failure of {name}: {example}")
    print(json.dumps({"bench": "fuzz", "inputs": sum(r["inputs"] for r in rows.values()),
                      "refused": sum(r["refused"] for r in rows.values()),
                      "failures": sum(r["failures"] for r in rows.values()),
                      "per_parser": {k: {x: r[x] for x in ("inputs", "refused", "failures")} for k, r in rows.items()}}))


if __name__ == "__main__":
    main()
