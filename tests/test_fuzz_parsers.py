"""Property tests of every wire parser (see `tests/fuzz_targets.py`): on any input each one
accepts or refuses with the project's own error; it never crashes, hangs or decodes beyond
the plan. `bench/fuzz.py` runs the same targets on >= 100,000 inputs each."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz_targets import ACCEPTED, FACTORIES, REFUSED, all_targets

@pytest.fixture(scope="module")
def targets():
    # built here, not at import: the bulk target changes the shard's pull-wait ceiling until closed
    made = {t.name: t for t in all_targets()}
    yield made
    for t in made.values():
        t.close()


def _inputs(target):
    """Random bytes, and valid seeds with a slice replaced, truncated or extended."""
    seeds = st.sampled_from(target.seeds)

    @st.composite
    def mutated(draw):
        seed = draw(seeds)
        at = draw(st.integers(0, len(seed)))
        cut = draw(st.integers(0, max(0, len(seed) - at)))
        return seed[:at] + draw(st.binary(max_size=16)) + seed[at + cut:]

    return st.one_of(st.binary(max_size=512), mutated(), seeds)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_parser_accepts_or_refuses_with_the_projects_error(targets, name):
    target = targets[name]
    outcomes = set()

    @settings(max_examples=200, deadline=2000, suppress_health_check=list(HealthCheck), database=None)
    @given(_inputs(target))
    def check(data: bytes) -> None:
        outcomes.add(target.run(data))  # FuzzFailure (an AssertionError) fails the test

    check()
    assert outcomes <= {ACCEPTED, REFUSED}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_seed_is_accepted(name):
    # the fuzzed parsers do accept valid input: a parser refusing everything would pass above
    target = FACTORIES[name]()  # fresh: fuzzing may have moved the shard on
    try:
        assert [target.run(seed) for seed in target.seeds] == [ACCEPTED] * len(target.seeds)
    finally:
        target.close()


@pytest.mark.slow
def test_fuzz_bench_quick_ends_with_its_json_line():
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "bench" / "fuzz.py"), "--quick"], capture_output=True,
                          text=True, timeout=110, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["inputs"] == 2000 * len(FACTORIES)
    assert 0 < result["refused"] < result["inputs"]
    assert result["failures"] == 0, proc.stdout
