"""Secure aggregation vs plaintext pushes: one round's wall time, bytes per pusher, a dropout.

    python bench/secagg.py            # N = 3, 10, 30 pushers, median of 5 rounds each
    python bench/secagg.py --quick    # N = 3, 10, median of 3 rounds (under a minute)
    python bench/secagg.py --pushers 100 --ring32-only               # SecAgg+'s sparse graph at N = 100
    python bench/secagg.py --pushers 100 --ring32-only --degree 99   # the same on the complete graph
    python bench/secagg.py --pushers 100 --ring32-only --numel 250000 --rounds 2   # shrunk

Graph and threshold: the job's defaults (the complete graph with floor(2N/3)+1 below 50
pushers, SecAgg+'s sparse graph from the bounds above; ``--degree`` forces one), and
threshold 2 for N = 3. N simulated pushers are in-process `PSClient`s (one thread each) against ONE real
shard in its own process on 127.0.0.1 (gRPC control plane + bulk TLS data plane, tokens on). Each
pushes a 1M-parameter float32 update (one 4 MB tensor) per round and pulls the
result; the shard applies server-side SGD. A round's wall time runs from the
pushes' start to the last pusher's pull of the new version. Pairs compared, each
in its own shard with the same N and update:

- ``ring32``: secure aggregation with the 32-bit ring vs plaintext codec ``none`` (float32);
- ``ring16``: the 16-bit ring vs plaintext ``fp16`` and vs plaintext ``int8``.

Secure rounds include every protocol message: the shares (Shares), the unmask request
and answer (Unmask, Reveal); the one-off key advertisement and roster happen in a
warm-up round not timed. Bytes per pusher are its client's counted bytes for one
timed round (payload, framing, control and secure-aggregation messages).

All N pushers share this machine's cores, so a round runs in two timed parts: each
pusher prepares its push alone, in turn (secure: quantise, N AES-256-CTR masks of the
whole vector, Shamir shares, the Shares call; plaintext: the codec's encode), then all
of them push, answer the unmask (secure) and pull at once. Deployed, pushers prepare on
their own hosts at the same time: ``round_s`` = the slowest preparation + the exchange,
and ``round_ratio`` = secure / plaintext round_s. ``round_ratio_one_host`` charges every
preparation in sequence (sum + exchange), as if all pushers shared one host.
``dropout_overhead``: one pusher sends its shares and leaves before pushing; (that
round's round_s - a normal secure round's) / the normal one.

JSON keys (N = 10, else the largest N): degree, threshold, round_ratio (ring32 vs float32, modelled as above), round_ratio_one_host,
upload_ratio (ring32 vs float32), upload_ratio_16_vs_fp16, upload_ratio_16_vs_int8,
dropout_overhead; per-N figures under ``by_n``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _shards import serve_shards, stop_shards  # noqa: E402

NUMEL = 1_000_000


def start(workdir: Path, n: int, codec: str, secure: bool, degree: int | None = None):
    from hybridfleet.security import TokenIssuer, generate_signing_key, make_dev_pki
    from hybridfleet.spec import parse_spec

    sites = {f"s{i:02d}": {"workers": 1} for i in range(n)}
    ps = {"shards": 1, "sync": "bsp", "optimizer": {"name": "sgd", "lr": 0.1}, "compression": {"codec": codec},
          "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 30.0}
    if secure:
        # the default threshold floor(2n/3)+1, except N=3 (it would be 3: no dropout could be recovered)
        ps["secure_aggregation"] = {"bits": 16 if codec != "none" else 32, "threshold": 2 if n == 3 else None,
                                    **({"degree": degree} if degree is not None else {})}
    data = {"name": "bench-secagg", "framework": "torch", "entrypoint": "t.py", "sites": sites, "ps": ps}
    spec = parse_spec(data)
    certs = workdir / f"certs-{n}-{codec}-{secure}"
    make_dev_pki(certs, clients=["worker"])
    generate_signing_key(certs)
    job = workdir / f"job-{n}-{codec}-{secure}.yaml"
    job.write_text(yaml.safe_dump(data))
    # the shard in its own process, as deployed: it must not share the pushers' interpreter lock
    procs, (address,) = serve_shards(job, 1, workdir, expected_workers=n, certs=certs)
    return spec, certs, procs, address, TokenIssuer.from_dir(certs)


class Pusher:
    def __init__(self, spec, certs, address: str, issuer, site: str, rng, numel: int):
        from hybridfleet.ps.secagg.rounds import SecureRounds
        from hybridfleet.ps.secagg.settings import SecAggSettings
        from hybridfleet.ps.worker.client import ClientSecurity, PSClient
        from hybridfleet.ps.wire.sharding import ParamSpec
        from hybridfleet.security import load_pki

        wid = f"{site}-0"
        sec = ClientSecurity.from_files(str(load_pki(certs).ca_cert),
                                        token=issuer.issue(spec.name, site, "worker", 3600, worker=wid))
        self.client = PSClient([address], sec, wid, site, 0)
        self.client.join([ParamSpec("w", (numel,))], spec.ps.block_size_bytes, spec.ps.compression.codec, "torch")
        self.spec = spec
        self.codec = None
        self.secure = None
        if spec.ps.secure_aggregation is not None:
            self.secure = SecureRounds(self.client, SecAggSettings.resolve(spec.ps, spec.sites), spec.ps)
        else:
            from hybridfleet.codec import codec_for

            self.codec = codec_for(spec.ps.compression)
        self.update = rng.uniform(-0.01, 0.01, numel).astype(np.float32)
        self.mask_s = 0.0

    def prepare(self) -> float:
        """This pusher's own work before sending (mask + shares, or encode); returns its seconds."""
        self.base = list(self.client.versions)
        started = time.perf_counter()
        if self.secure is not None:
            self.payloads = self.secure._mask_one(0, self.base[0], {"w": self.update}, 1)  # includes Shares
        else:
            self.payloads = {"w": self.codec.encode(self.update)}
        return time.perf_counter() - started

    def send(self) -> None:
        """Push, answer the unmask (secure), pull the round's result."""
        codec = self.secure.settings.codec_name if self.secure is not None else self.spec.ps.compression.codec
        self.client.push(self.payloads, codec=codec, base_versions=self.base, contributors=1)
        if self.secure is not None:
            self.secure.unmask(self.base)
        self.client.pull(wait_for_versions=[self.base[0] + 1])

    def sent(self) -> int:
        return sum(self.client.bytes.sent.values())


def run_round(pushers: list[Pusher]) -> dict:
    """One round: each pusher prepares in turn (timed alone), then all send at once (timed together)."""
    prep = [p.prepare() for p in pushers]
    errors: list[BaseException] = []

    def go(p):
        try:
            p.send()
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=go, args=(p,)) for p in pushers]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    exchange = time.perf_counter() - started
    # deployed, every pusher prepares on its own host at once; here they took turns
    return {"round_s": max(prep) + exchange, "one_host_s": sum(prep) + exchange, "prepare_max_s": max(prep),
            "prepare_median_s": statistics.median(prep), "exchange_s": exchange}


def measure(workdir: Path, n: int, codec: str, secure: bool, rounds: int, dropout: bool = False,
            numel: int = NUMEL, degree: int | None = None) -> dict:
    spec, certs, shard, address, issuer = start(workdir, n, codec, secure, degree)
    rng = np.random.default_rng(n)
    try:
        pushers = [Pusher(spec, certs, address, issuer, f"s{i:02d}", rng, numel) for i in range(n)]
        pushers[0].client.push({"w": np.zeros(numel, np.float32).tobytes()}, codec="none", kind="INIT")
        for p in pushers:
            p.client.pull(full=True)
        if secure:  # key advertisement and roster: every pusher at once
            setups = [threading.Thread(target=p.secure._setup, args=(0,)) for p in pushers]
            for t in setups:
                t.start()
            for t in setups:
                t.join()
        run_round(pushers)  # warm-up: connections, allocations
        results, sent = [], []
        for _ in range(rounds):
            before = [p.sent() for p in pushers]
            results.append(run_round(pushers))
            sent.append(statistics.mean(p.sent() - b for p, b in zip(pushers, before)))
        i = int(np.argsort([r["round_s"] for r in results])[len(results) // 2])
        out = {**results[i], "sent": sent[i]}
        if secure:
            m = pushers[0].secure.maskers[0]
            out["degree"], out["threshold"] = len(m.secrets), m.threshold  # a pair secret per neighbour
        if dropout:
            leaver, rest = pushers[-1], pushers[:-1]
            leaver.secure._mask_one(0, leaver.client.versions[0], {"w": leaver.update}, 1)  # shares sent ...
            leaver.client.close(leave=True)                                                # ... then gone
            out["dropout_round_s"] = run_round(rest)["round_s"]
            from hybridfleet.ps.worker.status import ShardStatusProbe
            from hybridfleet.security.credentials import issue_admin_token

            probe = ShardStatusProbe(address, certs, issue_admin_token(spec, issuer))
            roster = probe.status()["secure_aggregation"]["roster"]
            probe.close()
            assert leaver.client.worker_id not in roster, roster  # dropped: evicted
        for p in pushers[:-1] if dropout else pushers:
            p.client.close()
        return out
    finally:
        stop_shards(shard)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N = 3 and 10, three timed rounds each (default: 5)")
    ap.add_argument("--n", "--pushers", dest="n", type=int, nargs="*", default=None,
                    help="pusher counts (default 3 10 30)")
    ap.add_argument("--numel", type=int, default=NUMEL, help=f"float32 parameters per pusher (default {NUMEL:,})")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per configuration (default 5, quick 3)")
    ap.add_argument("--degree", type=int, default=None,
                    help="SecAgg+ graph degree (default: the job's; >= N-1: the complete graph)")
    ap.add_argument("--ring32-only", action="store_true",
                    help="only the 32-bit ring vs float32 pair (no 16-bit ring, fp16 or int8 runs)")
    args = ap.parse_args()
    ns = args.n or ([3, 10] if args.quick else [3, 10, 30])
    rounds = args.rounds or (3 if args.quick else 5)
    numel = args.numel
    from hybridfleet.obs.log import configure

    configure(level="error")
    workdir = Path(tempfile.mkdtemp(prefix="hf-bench-secagg-"))
    by_n: dict[int, dict] = {}
    for n in ns:
        r = {
            "plain32": measure(workdir, n, "none", False, rounds, numel=numel),
            "ring32": measure(workdir, n, "none", True, rounds, dropout=True, numel=numel, degree=args.degree),
        }
        if not args.ring32_only:
            r["plain_fp16"] = measure(workdir, n, "fp16", False, rounds, numel=numel)
            r["plain_int8"] = measure(workdir, n, "int8", False, rounds, numel=numel)
            r["ring16"] = measure(workdir, n, "fp16", True, rounds, numel=numel, degree=args.degree)
        s, p = r["ring32"], r["plain32"]
        by_n[n] = {
            "degree": s["degree"], "threshold": s["threshold"],
            "plain32_s": round(p["round_s"], 4), "ring32_s": round(s["round_s"], 4),
            "round_ratio": round(s["round_s"] / p["round_s"], 3),
            "round_ratio_one_host": round(s["one_host_s"] / p["one_host_s"], 3),
            "upload_ratio": round(s["sent"] / p["sent"], 4),
            "dropout_overhead": round((s["dropout_round_s"] - s["round_s"]) / s["round_s"], 3),
            "prepare_max_s": round(s["prepare_max_s"], 4), "prepare_median_s": round(s["prepare_median_s"], 4),
            "exchange_s": round(s["exchange_s"], 4), "plain_exchange_s": round(p["exchange_s"], 4),
            "sent_bytes": {k: int(v["sent"]) for k, v in r.items()},
        }
        if not args.ring32_only:
            by_n[n].update(
                round_ratio_16_vs_fp16=round(r["ring16"]["round_s"] / r["plain_fp16"]["round_s"], 3),
                upload_ratio_16_vs_fp16=round(r["ring16"]["sent"] / r["plain_fp16"]["sent"], 4),
                upload_ratio_16_vs_int8=round(r["ring16"]["sent"] / r["plain_int8"]["sent"], 4))
        print(f"  N={n}: done", file=sys.stderr)

    nan = float("nan")
    print(f"\nsecure aggregation, one shard, {numel:,} float32 parameters per pusher, "
          f"{rounds} timed round(s), in-process pushers")
    head = (f"{'N':>4}{'k':>4}{'t':>4}{'plain32 s':>11}{'ring32 s':>10}{'ratio':>8}{'1-host':>8}{'16/fp16':>9}"
            f"{'up 32':>8}{'up16/fp16':>11}{'up16/int8':>11}{'dropout':>9}{'prep s':>8}")
    print(head)
    for n, b in by_n.items():
        print(f"{n:>4}{b['degree']:>4}{b['threshold']:>4}{b['plain32_s']:>11.3f}{b['ring32_s']:>10.3f}"
              f"{b['round_ratio']:>8.2f}{b['round_ratio_one_host']:>8.2f}{b.get('round_ratio_16_vs_fp16', nan):>9.2f}"
              f"{b['upload_ratio']:>8.3f}{b.get('upload_ratio_16_vs_fp16', nan):>11.3f}"
              f"{b.get('upload_ratio_16_vs_int8', nan):>11.3f}{b['dropout_overhead']:>9.3f}{b['prepare_max_s']:>8.3f}")
    n_key = 10 if 10 in by_n else ns[-1]
    key = by_n[n_key]
    print(json.dumps({
        "bench": "secagg", "n": n_key, "parameters": numel,
        **{k: key[k] for k in ("degree", "threshold", "round_ratio", "round_ratio_one_host", "upload_ratio",
                               "upload_ratio_16_vs_fp16", "upload_ratio_16_vs_int8", "dropout_overhead") if k in key},
        "by_n": {str(n): {k: v for k, v in b.items() if k != "sent_bytes"} for n, b in by_n.items()},
    }))


if __name__ == "__main__":
    main()
