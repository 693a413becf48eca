"""A PS job deployed on separate hosts, as docs/DEPLOY.md tells a person to do it.

Every host is a network namespace (tests/netlab.py): a laptop, two shard hosts and
a worker host on the cloud's network, a worker host on the hospital's network,
which reaches the cloud over a 20 Mbit/s tbf link. Names resolve through each
host's own hosts file. The test runs the ``bash`` blocks of docs/DEPLOY.md that
carry ``<!-- on-host: NAME -->``, as written, on that host, in the directory the
laptop staged for it; the paddle run types the same commands with the job file's
framework and entrypoint switched to paddle. Midway, shard 0's host loses every
process to SIGKILL and its command is typed again: the shard restores its snapshot
and the job completes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from netlab import NetLab, unavailable_reason
from tests.needs import skip_outside_ci

pytestmark = [pytest.mark.slow, skip_outside_ci(unavailable_reason() and f"network namespaces: {unavailable_reason()}")]

REPO = Path(__file__).resolve().parents[1]
DEPLOY_MD = REPO / "docs" / "DEPLOY.md"
HOSTS = {"laptop": ("cloud", []), "shard-0": ("cloud", ["shard-0.cloud.example"]),
         "shard-1": ("cloud", ["shard-1.cloud.example"]), "cloud-0": ("cloud", []), "hospital-0": ("hospital", [])}
WAN_MBIT = 20
TIMEOUT_S = 150  # a hang guard for a loaded machine, not a speed claim
# Rounds of the job: 250 take both frameworks to the test accuracy of the example's 400 (tests/test_k8s_pods.py);
# the power cut comes after round 20, with rounds left for the workers to ride it out.
STEPS = 250


def deploy_blocks() -> list[tuple[str, str]]:
    """(host, bash text) of every block in DEPLOY.md marked ``<!-- on-host: NAME -->``, in order."""
    text = DEPLOY_MD.read_text()
    pattern = re.compile(r"<!-- on-host: (\S+) -->\n(?:<!-- docs-test: skip \(.*?\) -->\n)?```bash\n(.*?)```", re.S)
    return [(m.group(1), m.group(2)) for m in pattern.finditer(text)]


def _env() -> dict[str, str]:
    """What a host with hybridfleet installed has: `hfleet` on PATH (this checkout's sources)."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONPATH=str(REPO / "src"),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("HFLEET_TOKEN", None)
    return env


def _laptop(tmp_path: Path, framework: str) -> Path:
    """The laptop's checkout: the deploy example (switched to ``framework``, ``STEPS`` rounds) and the digits code."""
    laptop = tmp_path / "laptop"
    (laptop / "examples").mkdir(parents=True)
    shutil.copytree(REPO / "examples" / "digits", laptop / "examples" / "digits",
                    ignore=shutil.ignore_patterns("__pycache__"))
    job = yaml.safe_load((REPO / "examples" / "digits-deploy.yaml").read_text())
    job["framework"] = framework
    job["entrypoint"] = f"examples/digits/train_{framework}.py"
    job["train"] = {**job["train"], "steps": STEPS}
    (laptop / "examples" / "digits-deploy.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    return laptop


class Hosts:
    """Types DEPLOY.md's blocks on the lab's hosts; each host's output goes to ``<tmp>/logs/<host>-<n>.log``."""

    def __init__(self, lab: NetLab, laptop: Path, logs: Path):
        self.lab, self.laptop, self.logs = lab, laptop, logs
        self.count = 0

    def cwd(self, host: str) -> Path:
        return self.laptop if host == "laptop" else self.laptop / host

    def start(self, host: str, script: str) -> tuple[subprocess.Popen, Path]:
        self.count += 1
        log = self.logs / f"{host}-{self.count}.log"
        out = log.open("w")
        proc = subprocess.Popen([*self.lab.hosts[host].exec_prefix, "bash", "-euo", "pipefail", "-c", script],
                                cwd=self.cwd(host), env=_env(), stdout=out, stderr=subprocess.STDOUT)
        out.close()
        return proc, log

    def run(self, host: str, script: str) -> str:
        proc, log = self.start(host, script)
        rc = proc.wait(timeout=TIMEOUT_S)
        assert rc == 0, f"on {host}: `{script.strip()}` exited {rc}:\n{log.read_text()[-3000:]}"
        return log.read_text()


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _wait_for(what: str, check, procs: dict, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        ended = {name: p.poll() for name, (p, _) in procs.items() if p.poll() is not None}
        if ended or time.monotonic() > deadline:
            logs = "\n".join(f"--- {n}\n{log.read_text()[-2000:]}" for n, (_, log) in procs.items())
            pytest.fail(f"waiting for {what}: {'exited ' + str(ended) if ended else 'timed out'}\n{logs}")
        time.sleep(0.05)


def _snapshots(shard_dir: Path) -> list[int]:
    from hybridfleet.ckpt import list_checkpoints

    store = shard_dir / "runs" / "checkpoints" / "ps" / "shard-0"
    return [c.step for c in list_checkpoints(str(store))] if store.is_dir() else []


def test_deploy_md_marks_every_host_block():
    blocks = deploy_blocks()
    assert [host for host, _ in blocks] == ["laptop", "laptop", "shard-0", "shard-1", "hospital-0", "cloud-0",
                                            "laptop"]


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_job_on_separate_hosts_trains_and_survives_a_shard_host_power_cut(tmp_path, framework):
    # Prepare: the hosts, their names and the hospital's 20 Mbit/s uplink
    certs_block, stage_block, shard0, shard1, hospital, cloud, status_block = (b for _, b in deploy_blocks())
    laptop = _laptop(tmp_path, framework)
    (tmp_path / "logs").mkdir()
    with NetLab() as lab:
        lab.segment("cloud")
        lab.segment("hospital")
        lab.link("hospital", "cloud", rate_mbit=WAN_MBIT)
        for name, (segment, names) in HOSTS.items():
            lab.host(name, segment, names)
        lab.write_hosts()
        hosts = Hosts(lab, laptop, tmp_path / "logs")
        # Execute: the laptop makes and hands out credentials, then each host types its command
        hosts.run("laptop", certs_block)
        hosts.run("laptop", stage_block)
        procs = {"shard-0": hosts.start("shard-0", shard0), "shard-1": hosts.start("shard-1", shard1),
                 "hospital-0": hosts.start("hospital-0", hospital), "cloud-0": hosts.start("cloud-0", cloud)}
        _wait_for("shard 0 to serve", lambda: '"shard_serving"' in procs["shard-0"][1].read_text(), procs)
        status = json.loads(hosts.run("laptop", status_block))
        _wait_for("shard 0's snapshot of round 20", lambda: any(s >= 20 for s in _snapshots(laptop / "shard-0")), procs)
        killed = lab.hosts["shard-0"].kill_all()
        procs["shard-0"][0].wait(timeout=10)
        workers_alive = [procs[w][0].poll() is None for w in ("hospital-0", "cloud-0")]
        procs["shard-0 again"] = hosts.start("shard-0", shard0)
        _wait_for("the workers to finish", lambda: all(procs[w][0].poll() is not None for w in ("hospital-0", "cloud-0")),
                  {k: v for k, v in procs.items() if k not in ("hospital-0", "cloud-0", "shard-0")})
        worker_codes = {w: procs[w][0].wait() for w in ("hospital-0", "cloud-0")}
        wan = lab.link_counters()
        restarted_log = procs["shard-0 again"][1].read_text()
    # Assert: every host held only its files, the job trained through the power cut
    assert sorted(p.name for p in (laptop / "shard-0" / "certs").iterdir()) == [
        "ca.pem", "server.key", "server.pem", "token-signing.pub"]
    for worker in ("hospital-0", "cloud-0"):
        assert [p.name for p in (laptop / worker / "certs").iterdir()] == ["ca.pem"]
        assert not list((laptop / worker).glob("*.key")) and not list((laptop / worker).rglob("server.*"))
    assert status["shard"] == 0
    # the hospital's traffic crossed the capped link, both ways
    assert {rate for rate, _ in wan.values()} == {f"{WAN_MBIT}Mbit"} and all(sent > 5e6 for _, sent in wan.values()), wan
    assert killed and all(workers_alive), "the shard host was killed after the job had finished"
    logs = {w: procs[w][1].read_text() for w in ("hospital-0", "cloud-0")}
    assert worker_codes == {"hospital-0": 0, "cloud-0": 0}, logs
    restored = [r for r in _json_lines(restarted_log) if r.get("event") == "snapshot_restored"]
    assert len(restored) == 1 and restored[0]["version"] >= 20, restarted_log[-2000:]
    finals = {w: [r for r in _json_lines(text) if r.get("event") == "metrics" and r.get("final")]
              for w, text in logs.items()}
    assert all(len(f) == 1 for f in finals.values()), logs
    assert all(f[0]["test_accuracy"] >= 0.95 for f in finals.values()), finals
    assert any(r.get("event") == "shard_unavailable" for r in _json_lines(logs["hospital-0"]))
    assert not any(name.startswith(lab.tag) for name in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
