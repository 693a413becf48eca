"""A catalogue of common mistakes, for every command group: each ends in one line and a hint, never a traceback,
and changes nothing. The catalogue is the "Documented mistakes" table of docs/errors.md: every entry there has a
row here with the same exit code and message, and every row here is documented.

For each mistake: the exit code is the one `errors.EXIT_CODES` gives its kind (2 for
command-line usage), the output has no "Traceback", and the hint (or click's usage
error) names the thing to change. Real processes where the mistake involves one: a
real shard with TLS and tokens for the status, certificate and port cases, a real
worker against dead addresses, a real `hfleet launch` interrupted with SIGINT.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import yaml

from hybridfleet.ckpt import save_tensors_checkpoint
from hybridfleet.cli.app import main
from hybridfleet.errors import EXIT_CODES
from hybridfleet.registry.client import open_registry

pytestmark = pytest.mark.torch  # the catalogue's job is the torch example

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "examples" / "digits-hybrid.yaml"
TABLE_CODES = {c.code for c in EXIT_CODES.values()}
USAGE, SPEC, LAUNCH, AUTH, CKPT, LOCK = 2, 2, 8, 9, 11, 13
PORT, UNREACHABLE = EXIT_CODES["port_in_use"].code, EXIT_CODES["unreachable"].code


@dataclass(frozen=True)
class Mistake:
    name: str
    argv: Callable[[dict], list[str]]
    code: int
    names: str  # the fix the output must name
    untouched: Callable[[dict], Path] | None = None  # a path the refusal must not create


def _job_variant(tmp: Path, name: str, **changes) -> Path:
    data = yaml.safe_load(JOB.read_text())
    data["entrypoint"] = str(REPO / data["entrypoint"])
    data.update(changes)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> dict:
    """Paths the mistakes refer to: a PKI, a second PKI, job variants, checkpoints, a running shard."""
    tmp = tmp_path_factory.mktemp("mistakes")
    for name in ("pki", "other-pki"):
        assert subprocess.run([sys.executable, "-m", "hybridfleet", "certs", "init", str(tmp / name)],
                              capture_output=True).returncode == 0
    ctx = {"tmp": tmp, "pki": tmp / "pki", "other_pki": tmp / "other-pki", "job": str(JOB)}
    ctx["tls_off_unquoted"] = tmp / "tls-off.yaml"
    ctx["tls_off_unquoted"].write_text(JOB.read_text().replace("{tls: auto, tokens: auto}", "{tls: off, tokens: off}"))
    ctx["no_entry"] = _job_variant(tmp, "no-entry", entrypoint=str(tmp / "nope.py"))
    ctx["unknown_key"] = _job_variant(tmp, "unknown-key", shardz=2)
    ctx["bad_data"] = _job_variant(tmp, "bad-data", sites={"hospital": {"workers": 1, "data": str(REPO / "examples/digits/data/site-a")},
                                                          "cloud": {"workers": 1, "data": str(REPO / "examples/digits/data/site-c")}})
    ctx["swapped"] = _job_variant(tmp, "swapped", entrypoint=str(REPO / "examples/digits/train_paddle.py"))
    ctx["zero_workers"] = _job_variant(tmp, "zero", sites={"a": {"workers": 0}})
    ctx["collective"] = _job_variant(tmp, "collective", mode="collective")
    ctx["bad_yaml"] = tmp / "bad.yaml"
    ctx["bad_yaml"].write_text("name: [unclosed\n")
    ctx["script"] = tmp / "train.py"
    ctx["script"].write_text("pass\n")
    ckpt = tmp / "ckpt"
    info = save_tensors_checkpoint(str(ckpt), 1, {"w": np.ones(4, np.float32)})
    (ckpt / next(f.path for f in info.files if f.role == "tensors")).write_bytes(b"flipped")
    ctx["corrupt_ckpt"] = ckpt
    ctx["raw_ckpt"] = tmp / "raw"
    save_tensors_checkpoint(str(ctx["raw_ckpt"]), 1, {"w": np.ones(4, np.float32)})
    ctx["token"] = subprocess.run([sys.executable, "-m", "hybridfleet", "certs", "token", str(tmp / "pki"), "--job",
                                   "digits-hybrid", "--site", "cloud", "--role", "worker"],
                                  capture_output=True, text=True).stdout.strip()
    # a real shard (TLS + tokens) on 0.0.0.0, so it is reachable at 127.0.0.2 too, where its certificate does not name it
    port_file = tmp / "shard.port"
    shard = subprocess.Popen([sys.executable, "-m", "hybridfleet", "ps", "serve", str(JOB), "--shard", "0", "--host",
                              "0.0.0.0", "--port", "0", "--port-file", str(port_file), "--certs", str(tmp / "pki")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not port_file.exists() and time.monotonic() < deadline and shard.poll() is None:
        time.sleep(0.1)
    assert port_file.exists(), "the shard did not start"
    ctx["shard_port"] = int(port_file.read_text().strip().rsplit(":", 1)[1])
    held = socket.create_server(("127.0.0.1", 0))
    ctx["held_port"] = held.getsockname()[1]
    yield ctx
    held.close()
    shard.terminate()
    shard.wait(10)


def status(address_key: str, *extra: str) -> Callable[[dict], list[str]]:
    return lambda c: ["ps", "status", address_key.format(port=c["shard_port"]), *[e.format(**c) for e in extra]]


MISTAKES = [
    # spec
    Mistake("spec: job file missing", lambda c: ["spec", "check", str(c["tmp"] / "nope.yaml")], SPEC, "check the path"),
    Mistake("spec: not YAML", lambda c: ["spec", "check", str(c["bad_yaml"])], SPEC, "YAML syntax"),
    Mistake("spec: not a mapping", lambda c: ["spec", "check", str(c["script"])], SPEC, "pass the job file"),
    Mistake("spec: tls: off unquoted", lambda c: ["spec", "check", str(c["tls_off_unquoted"])], SPEC, 'write tls: "off" (quoted)'),
    Mistake("spec: entrypoint missing", lambda c: ["spec", "check", str(c["no_entry"])], SPEC, "fix entrypoint"),
    Mistake("spec: a site's data missing", lambda c: ["spec", "check", str(c["bad_data"])], SPEC, "fix sites.cloud.data"),
    Mistake("spec: torch job with the paddle script", lambda c: ["spec", "check", str(c["swapped"])], SPEC,
            "set framework: paddle"),
    Mistake("spec: --site that is no site", lambda c: ["spec", "check", c["job"], "--site", "mars"], SPEC,
            "name one of the job's sites"),
    Mistake("spec: unknown key", lambda c: ["spec", "check", str(c["unknown_key"])], SPEC, "shardz"),
    Mistake("spec: zero workers", lambda c: ["spec", "check", str(c["zero_workers"])], SPEC, "sites.a.workers"),
    # env
    Mistake("env: diff of missing locks", lambda c: ["env", "diff", str(c["tmp"] / "a.json"), str(c["tmp"] / "b.json")],
            LOCK, "hfleet env lock -o"),
    Mistake("env: diff of a file that is not a lock", lambda c: ["env", "diff", c["job"], c["job"]], LOCK,
            "not a valid lock file"),
    Mistake("env: lock into a missing folder", lambda c: ["env", "lock", "-o", str(c["tmp"] / "no" / "dir" / "l.json")],
            USAGE, "create the folder", lambda c: c["tmp"] / "no"),
    # image
    Mistake("image: job file missing", lambda c: ["image", "render", str(c["tmp"] / "nope.yaml")], SPEC, "check the path"),
    # certs
    Mistake("certs: init over an existing PKI", lambda c: ["certs", "init", str(c["pki"])], AUTH, "--force"),
    Mistake("certs: unknown role", lambda c: ["certs", "token", str(c["pki"]), "--job", "j", "--site", "s", "--role", "wizard"],
            USAGE, "--role"),
    Mistake("certs: token from a missing folder", lambda c: ["certs", "token", str(c["tmp"] / "none"), "--job", "j",
                                                             "--site", "s", "--role", "worker"], AUTH, "hfleet certs init"),
    Mistake("certs: show of a missing folder", lambda c: ["certs", "show", str(c["tmp"] / "none")], AUTH, "hfleet certs init"),
    Mistake("certs: negative ttl", lambda c: ["certs", "token", str(c["pki"]), "--job", "j", "--site", "s", "--role",
                                              "worker", "--ttl-s", "-1"], USAGE, "ttl_s"),
    Mistake("certs: bad host name", lambda c: ["certs", "init", str(c["tmp"] / "p3"), "--host", "bad_host!"], USAGE,
            "bad_host!", lambda c: c["tmp"] / "p3" / "ca.pem"),
    # run
    Mistake("run: job file missing", lambda c: ["run", str(c["tmp"] / "nope.yaml")], SPEC, "check the path"),
    Mistake("run: collective job", lambda c: ["run", str(c["collective"])], LAUNCH, "hfleet launch"),
    Mistake("run: entrypoint missing", lambda c: ["run", str(c["no_entry"]), "--run-root", str(c["tmp"] / "runs")],
            SPEC, "fix entrypoint", lambda c: c["tmp"] / "runs"),
    Mistake("run: a site's data missing", lambda c: ["run", str(c["bad_data"]), "--run-root", str(c["tmp"] / "runs")],
            SPEC, "fix sites.cloud.data", lambda c: c["tmp"] / "runs"),
    Mistake("run: torch job with the paddle script", lambda c: ["run", str(c["swapped"]), "--run-root",
                                                                str(c["tmp"] / "runs")],
            SPEC, "point entrypoint at the torch script", lambda c: c["tmp"] / "runs"),
    Mistake("run: a value after a flag", lambda c: ["run", c["job"], "-q", "true"], USAGE, "unexpected extra argument"),
    # ps serve
    Mistake("ps serve: no --certs", lambda c: ["ps", "serve", c["job"], "--shard", "0", "--port", "0"], USAGE,
            "hfleet certs init"),
    Mistake("ps serve: shard out of range", lambda c: ["ps", "serve", c["job"], "--shard", "5", "--port", "0", "--certs",
                                                       str(c["pki"])], USAGE, "--shard 0..1"),
    Mistake("ps serve: port in use", lambda c: ["ps", "serve", c["job"], "--shard", "0", "--port", str(c["held_port"]),
                                                "--certs", str(c["pki"])], PORT, "choose another port"),
    Mistake("ps serve: bulk port in use", lambda c: ["ps", "serve", c["job"], "--shard", "0", "--port", "0",
                                                     "--bulk-port", str(c["held_port"]), "--certs", str(c["pki"])],
            PORT, "choose another port"),
    Mistake("ps serve: certs folder missing", lambda c: ["ps", "serve", c["job"], "--shard", "0", "--port", "0",
                                                         "--certs", str(c["tmp"] / "none")], AUTH, "hfleet certs init"),
    Mistake("ps serve: flag given a value", lambda c: ["ps", "serve", c["job"], "--shard", "0", "--insecure-plaintext",
                                                       "true"], USAGE, "unexpected extra argument"),
    # ps status
    Mistake("ps status: no --certs", status("127.0.0.1:{port}"), USAGE, "--certs DIR"),
    Mistake("ps status: no token", status("127.0.0.1:{port}", "--certs", "{pki}"), AUTH, "HFLEET_TOKEN"),
    Mistake("ps status: malformed token", status("127.0.0.1:{port}", "--certs", "{pki}", "--token", "garbage"), AUTH,
            "token"),
    Mistake("ps status: dead address", lambda c: ["ps", "status", f"127.0.0.1:{c['held_port']}", "--certs", str(c["pki"]),
                                                  "--timeout-s", "1"], UNREACHABLE, "hfleet ps serve"),
    Mistake("ps status: certificate does not name the host", status("127.0.0.2:{port}", "--certs", "{pki}"), AUTH,
            "--host 127.0.0.2"),
    Mistake("ps status: CA of another PKI", status("127.0.0.1:{port}", "--certs", "{other_pki}"), AUTH, "pass --certs"),
    Mistake("ps status: plaintext against TLS", status("127.0.0.1:{port}", "--insecure-plaintext"), UNREACHABLE,
            "drop --insecure-plaintext"),
    # ps scale
    Mistake("ps scale: not a run folder", lambda c: ["ps", "scale", str(c["tmp"]), "--shards", "3"], USAGE,
            "pass the RUN_DIR", untouched=lambda c: c["tmp"] / "scale-request.json"),
    Mistake("ps scale: shards below 1", lambda c: ["ps", "scale", str(c["tmp"]), "--shards", "0"], USAGE,
            "must be an integer >= 1", untouched=lambda c: c["tmp"] / "scale-request.json"),
    # worker
    Mistake("worker: unknown site", lambda c: ["worker", c["job"], "--site", "moon", "--servers", "a:1,b:2"], USAGE,
            "--site"),
    Mistake("worker: site rank out of range", lambda c: ["worker", c["job"], "--site", "cloud", "--site-rank", "9",
                                                         "--servers", "a:1,b:2"], USAGE, "--site-rank"),
    Mistake("worker: one address for two shards", lambda c: ["worker", c["job"], "--site", "cloud", "--servers",
                                                             "127.0.0.1:1"], USAGE, "give all 2 shard addresses"),
    Mistake("worker: no --certs", lambda c: ["worker", c["job"], "--site", "cloud", "--servers", "a:1,b:2"], USAGE,
            "--certs DIR"),
    Mistake("worker: no token", lambda c: ["worker", c["job"], "--site", "cloud", "--servers", "a:1,b:2", "--certs",
                                           str(c["pki"])], USAGE, "--role worker"),
    # launch
    Mistake("launch: script missing", lambda c: ["launch", "--framework", "torch", "--log-dir", str(c["tmp"] / "l1"),
                                                 str(c["tmp"] / "nope.py")], LAUNCH, "check the script path",
            lambda c: c["tmp"] / "l1"),
    Mistake("launch: unknown framework", lambda c: ["launch", "--framework", "jax", str(c["script"])], LAUNCH,
            "--framework torch"),
    Mistake("launch: bad --master", lambda c: ["launch", "--framework", "torch", "--master", "nohost", str(c["script"])],
            LAUNCH, "host:port"),
    Mistake("launch: bad --nnodes", lambda c: ["launch", "--framework", "torch", "--nnodes", "0", str(c["script"])],
            LAUNCH, "--nnodes 2"),
    Mistake("launch: zero processes", lambda c: ["launch", "--framework", "torch", "--nproc-per-node", "0",
                                                 str(c["script"])], LAUNCH, "--nproc-per-node 1"),
    Mistake("launch: unknown device", lambda c: ["launch", "--framework", "torch", "--device", "tpu", str(c["script"])],
            LAUNCH, "--device auto, cpu or gpu"),
    Mistake("launch: two nodes without a node rank", lambda c: ["launch", "--framework", "torch", "--nnodes", "2",
                                                                "--master", "127.0.0.1:29999", str(c["script"])],
            LAUNCH, "--node-rank 0"),
    Mistake("launch: non-numeric process count", lambda c: ["launch", "--framework", "torch", "--nproc-per-node", "two",
                                                             str(c["script"])], USAGE, "--nproc-per-node"),
    # k8s
    Mistake("k8s: tls: off unquoted", lambda c: ["k8s", "render", str(c["tls_off_unquoted"]), "-o", str(c["tmp"] / "k8s")],
            SPEC, 'write tls: "off" (quoted)', lambda c: c["tmp"] / "k8s"),
    Mistake("k8s: render without --certs", lambda c: ["k8s", "render", c["job"], "-o", str(c["tmp"] / "k8s-nocerts")],
            USAGE, "pass --certs DIR", lambda c: c["tmp"] / "k8s-nocerts"),
    Mistake("k8s: render-serving of an unknown model", lambda c: ["k8s", "render-serving", "nosuch@prod", "-o",
                                                                  str(c["tmp"] / "k8s-serving")],
            EXIT_CODES["registry_not_found"].code, "hfleet registry ls", lambda c: c["tmp"] / "k8s-serving"),
    # ckpt
    Mistake("ckpt: ls of a missing folder", lambda c: ["ckpt", "ls", str(c["tmp"] / "no-ckpt")], CKPT, "check the path",
            lambda c: c["tmp"] / "no-ckpt"),
    Mistake("ckpt: verify of a missing folder", lambda c: ["ckpt", "verify", str(c["tmp"] / "no-ckpt")], CKPT,
            "check the path"),
    Mistake("ckpt: verify finds corruption", lambda c: ["ckpt", "verify", str(c["corrupt_ckpt"])], CKPT, "hfleet ckpt gc"),
    Mistake("ckpt: convert to an unknown framework", lambda c: ["ckpt", "convert", str(c["raw_ckpt"]),
                                                                str(c["tmp"] / "out"), "--to", "jax"], USAGE, "--to"),
    Mistake("ckpt: convert raw tensors", lambda c: ["ckpt", "convert", str(c["raw_ckpt"]), str(c["tmp"] / "out2"),
                                                    "--to", "paddle"], CKPT, "model", lambda c: c["tmp"] / "out2"),
    Mistake("ckpt: gc keeping zero", lambda c: ["ckpt", "gc", str(c["raw_ckpt"]), "--keep-last", "0"], USAGE,
            "keep_last"),
    Mistake("ckpt: gc with an unknown mode", lambda c: ["ckpt", "gc", str(c["raw_ckpt"]), "--mode", "median"], USAGE,
            "best_mode"),
    Mistake("ckpt: show of a missing folder", lambda c: ["ckpt", "show", str(c["tmp"] / "no-ckpt")], CKPT,
            "hfleet ckpt verify URL", lambda c: c["tmp"] / "no-ckpt"),
    # data
    Mistake("data: ls of a missing dataset", lambda c: ["data", "ls", str(c["tmp"] / "no-data")],
            EXIT_CODES["data"].code, "hfleet data pack"),
    Mistake("data: verify of a missing dataset", lambda c: ["data", "verify", str(c["tmp"] / "no-data")],
            EXIT_CODES["data"].code, "hfleet data pack", lambda c: c["tmp"] / "no-data"),
    Mistake("data: pack of a missing source", lambda c: ["data", "pack", str(c["tmp"] / "no-src"),
                                                         str(c["tmp"] / "packed")],
            EXIT_CODES["data"].code, "does not exist", lambda c: c["tmp"] / "packed"),
    # report, ui
    Mistake("report: run directory missing", lambda c: ["report", str(c["tmp"] / "no-run")], EXIT_CODES["report"].code,
            "hfleet run"),
    Mistake("report: a folder that is not a run", lambda c: ["report", str(c["pki"])], EXIT_CODES["report"].code,
            "hfleet run", lambda c: c["pki"] / "report.html"),
    Mistake("ui: beyond loopback without a token", lambda c: ["ui", "--host", "0.0.0.0", "--port", "0"], LAUNCH,
            "--token TOKEN"),
    Mistake("ui: port in use", lambda c: ["ui", "--runs", str(c["tmp"]), "--port", str(c["held_port"])], PORT,
            "choose another with --port"),
    Mistake("registry serve: port in use", lambda c: ["registry", "serve", "--db", str(c["tmp"] / "srv.db"), "--port",
                                                      str(c["held_port"])], PORT, "choose another with --port",
            lambda c: c["tmp"] / "srv.db"),
    # registry (the session's private registry: see tests/conftest.py)
    Mistake("registry: unknown model", lambda c: ["registry", "show", "nosuch"], EXIT_CODES["registry_not_found"].code,
            "hfleet registry ls"),
    Mistake("registry: a gate that does not parse",
            lambda c: ["registry", "promote", "m", "1", "--alias", "prod", "--require", "acc>>0.9"],
            EXIT_CODES["registry"].code, "METRIC OP NUMBER"),
    Mistake("registry: pull of an unknown model", lambda c: ["registry", "pull", "nosuch@1", "-o", str(c["tmp"] / "pulled")],
            EXIT_CODES["registry_not_found"].code, "hfleet registry ls", lambda c: c["tmp"] / "pulled"),
    Mistake("registry: promote of an unknown model", lambda c: ["registry", "promote", "nosuch", "1", "--alias", "staging"],
            EXIT_CODES["registry_not_found"].code, "hfleet registry ls"),
    Mistake("registry: history of an unknown model", lambda c: ["registry", "history", "nosuch"],
            EXIT_CODES["registry_not_found"].code, "hfleet registry ls"),
    # serve
    Mistake("serve: neither TLS nor an explicit plaintext flag", lambda c: ["serve", "digits@prod"], USAGE,
            "--certs DIR is required", untouched=lambda c: c["tmp"] / "serve-cache"),
    Mistake("serve: a reference that does not parse", lambda c: ["serve", "Digits@prod", "--insecure-plaintext"],
            EXIT_CODES["registry"].code, "use lowercase letters"),
    Mistake("registry export: an unknown format", lambda c: ["registry", "export", "digits@1", "--format", "tflite",
            "-o", str(c["tmp"] / "export-out"), "--model", "x.py:f"], USAGE, "--format must be one of onnx", untouched=lambda c: c["tmp"] / "export-out"),
    # top level
    Mistake("unknown command", lambda c: ["trian", "job.yaml"], USAGE, "No such command"),
]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
        sys.exit(0)
    out = capsys.readouterr()
    return exit_info.value.code, out.out + out.err


ERRORS_DOC = REPO / "docs" / "errors.md"


def documented_mistakes() -> dict[str, tuple[int, str]]:
    """The "Documented mistakes" table of docs/errors.md: mistake -> (exit code, phrase the output says)."""
    section = ERRORS_DOC.read_text().split("## Documented mistakes", 1)[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].isdigit():
            rows[cells[0]] = (int(cells[1]), cells[2].strip("`"))
    return rows


def test_every_documented_mistake_has_a_row_here_and_every_row_is_documented():
    # Execute
    documented = documented_mistakes()
    rows = {m.name: (m.code, m.names) for m in MISTAKES}
    # Assert: a doc entry without a test fails, and so does a row the doc does not list, or lists otherwise
    assert sorted(set(documented) - set(rows)) == [], "documented in docs/errors.md but not run here"
    assert sorted(set(rows) - set(documented)) == [], "run here but not documented in docs/errors.md"
    assert {name: documented[name] for name in rows if documented[name] != rows[name]} == {}


def _state(ctx: dict) -> dict[str, object]:
    """Every file and folder under the mistakes' folder (size, mtime) and every row of the session's registry."""
    tmp = ctx["tmp"]
    found: dict[str, object] = {str(p.relative_to(tmp)): (p.stat().st_size if p.is_file() else -1, p.stat().st_mtime_ns)
                                for p in tmp.rglob("*")}
    open_registry().list_models()  # the session's registry (tests/conftest.py) exists, so an added row shows
    with sqlite3.connect(os.environ["HFLEET_REGISTRY"]) as db:
        found["registry rows"] = [line for line in db.iterdump() if line.startswith("INSERT")]
    return found


def test_the_catalogue_covers_every_command_group_with_at_least_40_mistakes():
    from hybridfleet.cli.app import COMMAND_MODULES

    groups = {m.name.split(":")[0] for m in MISTAKES}
    assert len(MISTAKES) + 2 >= 40  # + the interrupted launch and the unreachable worker below
    assert {g.split()[0] for g in groups} >= set(COMMAND_MODULES)


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda m: m.name)
def test_mistake_ends_in_one_line_and_a_hint_naming_the_fix(mistake, ctx, capsys):
    # Prepare
    before = _state(ctx)
    # Execute
    code, output = run_cli(mistake.argv(ctx), capsys)
    # Assert
    assert "Traceback" not in output, output
    assert code == mistake.code and code in TABLE_CODES, output
    assert mistake.names in output, output
    assert "hint: " in output or "Try 'hfleet" in output, output  # our hint, or click's usage line
    assert "internal error" not in output, output
    if mistake.untouched is not None:
        assert not mistake.untouched(ctx).exists()
    assert _state(ctx) == before  # nothing written, no registry row


@pytest.mark.slow
def test_worker_with_unreachable_shards_names_the_address_since_when_and_what_to_check(ctx):
    # Prepare: an address nothing listens on (a port bound, so no one else takes it, but not listening: connections
    # are refused), for both shards; a 1 s retry window
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{bound.getsockname()[1]}"
        argv = [sys.executable, "-m", "hybridfleet", "worker", ctx["job"], "--site", "cloud", "--servers",
                f"{dead},{dead}", "--certs", str(ctx["pki"]), "--token", ctx["token"], "--retry-s", "1"]
        # Execute
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    # Assert
    assert proc.returncode == UNREACHABLE, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"no shard answers join at {dead} since " in proc.stderr
    assert "hint: check that `hfleet ps serve` runs" in proc.stderr


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("signum, said", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")],
                         ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_during_launch_is_one_hfleet_line_no_tracebacks_and_no_rank_left(tmp_path, signum, said):
    # Prepare: a rank that runs until interrupted
    script = tmp_path / "forever.py"
    script.write_text("import time, torch.distributed as dist\ndist.init_process_group('gloo')\nprint('ready', flush=True)\n"
                      "time.sleep(600)\n")
    # hfleet starts as a shell starts a foreground job: SIGINT at its default, even where this process ignores it
    # (a test run started in the background by a non-interactive shell inherits SIGINT ignored)
    proc = subprocess.Popen([sys.executable, "-m", "hybridfleet", "launch", "--framework", "torch", "--nproc-per-node",
                             "2", "--device", "cpu", "--log-dir", str(tmp_path / "logs"), str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    survivors: list[int] = []
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.endswith(":ready\n"):  # a rank's line, as the launcher prefixes it
                break
        # Execute: Ctrl-C reaches the hfleet process (the terminal's foreground group), or a SIGTERM (kill, a scheduler)
        os.kill(proc.pid, signum)
        rest, _ = proc.communicate(timeout=60)
    finally:  # a launch that outlived the test would hold its ranks and port
        survivors = [int(p.name) for p in Path("/proc").glob("[0-9]*") if _runs(p, str(script))]
        for pid in survivors:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Assert
    output = "".join(seen) + rest
    assert proc.returncode == EXIT_CODES["interrupted"].code, output[-3000:]
    assert "Traceback" not in output and "SignalException" not in output, output[-3000:]
    assert f"error: {said}; every rank was stopped" in output
    assert not survivors  # every rank ended with the launch


def _runs(proc_dir: Path, needle: str) -> bool:
    try:
        return needle.encode() in (proc_dir / "cmdline").read_bytes()
    except OSError:
        return False
