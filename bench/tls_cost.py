"""What TLS adds to a round of the dense exchange, measured against the cipher's own cost.

    python bench/tls_cost.py            # 64 MB parameter set, 5 timed rounds
    python bench/tls_cost.py --quick    # 16 MB, 3 rounds

The exchange is bench/ps_exchange.py's: two workers push a dense float32 gradient of the
whole parameter set through ONE shard on its bulk data plane and pull the result (BSP,
server-side SGD), once with TLS + tokens (the default security) and once in plaintext.
Each process measures the CPU-seconds (user + system, all threads) of the timed rounds:
every worker its own (``getrusage(RUSAGE_SELF)``) from the end of its warm-up round to the
end of its last round, and rank 0 the shard's (``/proc/PID/stat``) over the same rounds.
Start-up, imports, handshakes and the warm-up round are left out: they are the same few
seconds in both runs and their run-to-run spread (about +-0.5 CPU-s) was larger than what
TLS adds to a round. So

    tls_cpu_s_per_round = (rounds CPU of the TLS run - rounds CPU of the plaintext run) / timed rounds

The whole runs are reported too (``getrusage(RUSAGE_CHILDREN)`` around each: every process
is a child of this one and is waited for), as ``tls_run_cpu_s`` / ``plaintext_run_cpu_s`` and
``whole_run_tls_cpu_s_per_round`` (their difference over the rounds run, warm-up included).
The cipher's own cost for the same
bytes: a round moves 4 x the tensor bytes through TLS (2 pushes in, 2 pulls out), each
byte encrypted once and decrypted once, so this process seals and opens that many bytes
with ``cryptography``'s AES-256-GCM in 16 KiB records (TLS's record size) and times it
with ``time.process_time``. ``tls_cpu_over_cipher`` = tls_cpu_s_per_round / cipher_cpu_s_per_round:
1.0 means TLS costs exactly its cipher; the handshake, record framing and extra copies
make up the rest.

``cryptography`` carries its own OpenSSL, which may be faster than the one the bulk plane's
TLS links (the system's). So the same bytes are also sealed and opened, in the same records,
by the AES-256-GCM of the OpenSSL the native TLS extension links
(``hybridfleet.ps.wire._tls.seal_open``): ``tls_cpu_over_stack_cipher`` is TLS's cost over
the cipher it actually runs, the rest of the first ratio is the two libraries' speeds.

The last line is JSON: tls_cpu_s_per_round, cipher_cpu_s_per_round, tls_cpu_over_cipher,
stack_cipher_cpu_s_per_round, tls_cpu_over_stack_cipher (None without the extension), the
rounds' and the whole runs' CPU-seconds, aes_gcm_gb_s and stack_aes_gcm_gb_s (the two
AES-GCM speeds in the same run), both OpenSSL versions and ``records``: how the bulk
plane's bytes travelled after the handshake, ``sealed`` (the native path's sealed records,
the default) or ``tls`` (TLS records: ``HFLEET_SEALED_RECORDS=0``, ``HFLEET_NATIVE_TLS=0``
or no extension), so the two record layers can be compared in alternating runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ps_exchange import run_ps  # noqa: E402

RECORD_BYTES = 16 << 10


def children_cpu_s() -> float:
    """User + system CPU-seconds of every child process waited for so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_cpu_s(numel: int, rounds: int, plaintext: bool) -> tuple[float, dict]:
    """CPU-seconds of one whole exchange run (shard + workers) and its timings."""
    before = children_cpu_s()
    with tempfile.TemporaryDirectory() as tmp:
        timing = run_ps(numel, rounds, plaintext, Path(tmp))
    return children_cpu_s() - before, timing


def cipher_cpu_s(total_bytes: int) -> float:
    """CPU-seconds AES-256-GCM takes to seal and then open ``total_bytes`` in 16 KiB records."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(AESGCM.generate_key(bit_length=256))
    record = os.urandom(RECORD_BYTES)
    nonce = os.urandom(12)
    sealed = aead.encrypt(nonce, record, None)
    records = -(-total_bytes // RECORD_BYTES)
    for _ in range(64):  # warm-up: the first records run slower (caches, clock)
        aead.decrypt(nonce, aead.encrypt(nonce, record, None), None)
    started = time.process_time()
    for _ in range(records):
        # one nonce for every record: only the cost is measured here, nothing is kept secret
        aead.encrypt(nonce, record, None)
        aead.decrypt(nonce, sealed, None)
    return time.process_time() - started


def stack_cipher_cpu_s(total_bytes: int) -> float | None:
    """CPU-seconds the native TLS extension's OpenSSL takes to seal and open ``total_bytes`` with
    AES-256-GCM in 16 KiB records; None when the extension is not built."""
    from hybridfleet.ps.wire.tls import native_seal_open

    if not native_seal_open(64 * RECORD_BYTES, RECORD_BYTES):  # warm-up, as for cipher_cpu_s
        return None
    started = time.process_time()
    native_seal_open(total_bytes, RECORD_BYTES)
    return time.process_time() - started


def openssl_versions() -> dict:
    """The OpenSSL of the native TLS extension (None: not built) and the one inside ``cryptography``."""
    from cryptography.hazmat.backends.openssl import backend

    from hybridfleet.ps.wire.tls import native_openssl_version, records_between_native_ends

    # the runs' processes make the same choice (same environment, same install)
    return {"stack_openssl": native_openssl_version(), "cipher_openssl": backend.openssl_version_text(),
            "records": records_between_native_ends()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 MB, 3 rounds")
    ap.add_argument("--mb", type=int, default=None, help="parameter set size in MB (default 64)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per run (default 5)")
    args = ap.parse_args()
    from _anchors import require

    require("bench/tls_cost.py",
            {"cryptography.hazmat.primitives.ciphers.aead": "cryptography (AES-GCM, the cipher's own cost)"})
    mb = args.mb or (16 if args.quick else 64)
    rounds = args.rounds or (3 if args.quick else 5)
    numel = mb * (1 << 20) // 4
    tls_cpu, tls = run_cpu_s(numel, rounds, plaintext=False)
    plain_cpu, plain = run_cpu_s(numel, rounds, plaintext=True)
    rounds_run = rounds + 1  # each worker runs one warm-up round before the timed ones
    tls_per_round = (tls["rounds_cpu_s"] - plain["rounds_cpu_s"]) / rounds
    through_tls = 4 * numel * 4  # bytes through TLS per round: 2 pushes in + 2 pulls out
    cipher = cipher_cpu_s(through_tls)
    stack = stack_cipher_cpu_s(through_tls)
    result = {
        "bench": "tls_cost", "mb": mb, "rounds": rounds_run, "timed_rounds": rounds,
        "tls_rounds_cpu_s": round(tls["rounds_cpu_s"], 3), "plaintext_rounds_cpu_s": round(plain["rounds_cpu_s"], 3),
        "tls_run_cpu_s": round(tls_cpu, 3), "plaintext_run_cpu_s": round(plain_cpu, 3),
        "whole_run_tls_cpu_s_per_round": round((tls_cpu - plain_cpu) / rounds_run, 4),
        "tls_cpu_s_per_round": round(tls_per_round, 4), "cipher_cpu_s_per_round": round(cipher, 4),
        "tls_cpu_over_cipher": round(tls_per_round / cipher, 3),
        "aes_gcm_gb_s": round(2 * through_tls / cipher / 1e9, 3),
        "stack_cipher_cpu_s_per_round": None if stack is None else round(stack, 4),
        "tls_cpu_over_stack_cipher": None if stack is None else round(tls_per_round / stack, 3),
        "stack_aes_gcm_gb_s": None if stack is None else round(2 * through_tls / stack / 1e9, 3),
        **openssl_versions(),
        "ps_s": round(tls["median_s"], 4), "ps_plaintext_s": round(plain["median_s"], 4),
    }
    print(f"{mb} MB exchange, 2 workers, 1 shard, {rounds_run} rounds per run (1 warm-up)")
    print(f"CPU-seconds of every process in the {rounds} timed rounds: TLS {tls['rounds_cpu_s']:.2f}, "
          f"plaintext {plain['rounds_cpu_s']:.2f}; whole runs: TLS {tls_cpu:.2f}, plaintext {plain_cpu:.2f}")
    print(f"TLS adds {tls_per_round:.3f} CPU-s per round; AES-256-GCM of the same "
          f"{2 * through_tls / 1e6:.0f} MB (sealed + opened) takes {cipher:.3f} CPU-s in cryptography's OpenSSL"
          + ("" if stack is None else f", {stack:.3f} CPU-s in the OpenSSL the TLS extension links"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
