"""Property-based fuzzing of the registry's REST API from its own OpenAPI schema (Schemathesis).

    OMP_NUM_THREADS=1 python bench/fuzz_rest.py [--quick] [--requests 10000] [--deadline-s 10] [--seed 0]

A live server (`hfleet registry serve` in its own process: uvicorn on 127.0.0.1, SQLite, an
``--allow-path`` folder) with a registered model ``ci/digits`` (alias ``prod``) and three
principals: ``admin`` (admin on ``*``), ``ci`` (writer on ``ci``, releaser on ``ci/digits``)
and ``eve`` (no role). Schemathesis reads ``/openapi.json`` and generates requests for every
operation, valid by the schema and not (its positive and negative modes); each request goes
with one of: the three tokens, no token, a malformed header. Counted: every request sent,
``server_errors`` (any 5xx), ``hangs`` (no answer within ``--deadline-s``); the server
process's RSS is sampled every 50 ms (``max_rss_mb``). The last line is JSON:
``{"bench": "fuzz_rest", "requests", "server_errors", "hangs", "max_rss_mb", ...}``; the first
few 5xx requests are printed to stderr to reproduce them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _checkpoint(root: Path) -> str:
    """A small model checkpoint of whichever framework is installed (torch first)."""
    from hybridfleet.ckpt.run_model import ModelCheckpointer

    try:
        import torch

        torch.manual_seed(0)
        model, framework = torch.nn.Sequential(torch.nn.Linear(8, 4)), "torch"
    except ImportError:
        import paddle

        model, framework = paddle.nn.Sequential(paddle.nn.Linear(8, 4)), "paddle"
    ckpt = ModelCheckpointer(str(root), framework, keep_last=1)
    ckpt.final(10, model, {"test_accuracy": 0.97})
    return ckpt.store.url


def _prepare(work: Path) -> dict[str, str]:
    from hybridfleet.registry import Registry

    owner = Registry(f"sqlite:///{work / 'reg.db'}", store=str(work / "artifacts"))
    tokens = {name: owner.add_principal(name) for name in ("admin", "ci", "eve")}
    owner.grant("admin", "admin", "*")
    owner.grant("ci", "writer", "ci")
    owner.grant("ci", "releaser", "ci/digits")
    (work / "allowed").mkdir()
    owner.register("ci/digits", _checkpoint(work / "allowed" / "run"), tags={"commit": "abc"})
    owner.move_alias("ci/digits", "prod", 1)
    return tokens


def _serve(work: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-m", "hybridfleet", "registry", "serve", "--db", str(work / "reg.db"),
                             "--port", str(port), "--allow-path", str(work / "allowed")],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(work / "server.log", "wb"))  # fmt: skip


class RssSampler(threading.Thread):
    def __init__(self, pid: int):
        import psutil

        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.max_rss = self.process.memory_info().rss
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            try:
                self.max_rss = max(self.max_rss, self.process.memory_info().rss)
            except Exception:  # the process ended: the last sample stands
                return


def fuzz(requests_wanted: int, deadline_s: float, seed: int) -> dict:
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation import GenerationMode

    from hybridfleet.launch.preflight import free_port

    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="hfleet-fuzz-"))
    tokens = _prepare(work)
    port = free_port("127.0.0.1")
    base = f"http://127.0.0.1:{port}"
    proc = _serve(work, port)
    try:
        for _ in range(600):
            try:
                if requests.get(f"{base}/openapi.json", timeout=2).ok:
                    break
            except requests.RequestException:
                time.sleep(0.1)
        sampler = RssSampler(proc.pid)
        sampler.start()
        schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        headers_choices = [{"Authorization": f"Bearer {t}"} for t in tokens.values()] + [
            {}, {"Authorization": "Bearer "}, {"Authorization": "Bearer hfr_unknown"}, {"Authorization": "Basic eDp5"}]
        counts = collections.Counter()
        statuses = collections.Counter()
        examples: list[str] = []
        session = requests.Session()
        per_round = max(8, -(-requests_wanted // (len(operations) * 2)))  # each operation and mode once per round
        started = time.monotonic()
        round_no = 0
        while counts["requests"] < requests_wanted:
            round_no += 1
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                for op in operations:
                    if counts["requests"] >= requests_wanted:
                        break
                    strategy = op.as_strategy(generation_mode=mode)

                    @hypothesis_seed(rng.randrange(2**32))
                    @settings(max_examples=per_round, deadline=None, database=None, phases=[Phase.generate],
                              suppress_health_check=list(HealthCheck), derandomize=False)  # fmt: skip
                    @given(case=strategy)
                    def one(case) -> None:
                        if counts["requests"] >= requests_wanted:
                            return
                        headers = dict(rng.choice(headers_choices))
                        counts["requests"] += 1
                        try:
                            response = case.call(base_url=base, session=session, headers=headers, timeout=deadline_s)
                        except requests.Timeout:
                            counts["hangs"] += 1
                            return
                        except requests.RequestException as err:
                            counts["transport_errors"] += 1
                            if len(examples) < 10:
                                examples.append(f"transport error {err!r} for {case.method} {case.formatted_path}")
                            return
                        statuses[response.status_code] += 1
                        if response.status_code >= 500:
                            counts["server_errors"] += 1
                            if len(examples) < 10:
                                examples.append(f"{response.status_code} {case.method} {case.formatted_path} "
                                                f"query={case.query!r} body={str(case.body)[:300]!r} -> {response.text[:300]}")

                    try:
                        one()
                    except Unsatisfiable:  # no request of this mode exists (a negative case of a parameterless GET)
                        counts["unsatisfiable_operations"] += 1
        elapsed = time.monotonic() - started
        sampler.stop.set()
        sampler.join(1)
        alive = proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    for line in examples:
        print(line, file=sys.stderr)
    return {"bench": "fuzz_rest", "requests": counts["requests"], "server_errors": counts["server_errors"],
            "hangs": counts["hangs"], "transport_errors": counts["transport_errors"],
            "max_rss_mb": round(sampler.max_rss / 2**20, 1), "operations": len(operations), "rounds": round_no,
            "server_alive": alive, "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "requests_per_s": round(counts["requests"] / elapsed, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000, help="generated requests to send")
    parser.add_argument("--quick", action="store_true", help="a few hundred requests")
    parser.add_argument("--deadline-s", type=float, default=10.0, help="a request without an answer by then is a hang")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = fuzz(300 if args.quick else args.requests, args.deadline_s, args.seed)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
