"""A real `hfleet run` job (digits-hybrid, torch and paddle: shards and workers as subprocesses,
TLS and per-worker tokens) attacked while it trains, from outside (no or forged credentials) and from inside (a
hospital worker's own token), on gRPC and on the bulk port. Every attack is refused, the job
completes with accuracy >= 0.95, no worker id beyond the job's joins, and each shard's peak
resident memory stays below 2 GiB."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml

from hybridfleet.launch.psjob import run_ps_job
from hybridfleet.spec import load_spec
from tests.ps_attack_helpers import GIB, peak_rss_bytes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _job(tmp_path: Path, example: str) -> Path:
    data = yaml.safe_load((REPO / "examples" / example).read_text())
    data["entrypoint"] = str(REPO / data["entrypoint"])
    data["train"]["site_baselines"] = False
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _attack(layout, report: dict) -> None:
    """Run every attack once against shard 0 and record each answer in ``report``."""
    from hybridfleet.ps.wire._proto import ps_pb2, ps_pb2_grpc
    from hybridfleet.ps.wire.bulk import BulkError
    from hybridfleet.ps.wire.protocol import GRPC_OPTIONS, WIRE_VERSION
    from hybridfleet.ps.worker.bulk_channel import BulkChannel, client_ssl_context
    from hybridfleet.ps.worker.status import ShardStatusProbe
    from hybridfleet.security import TokenIssuer, generate_signing_key, load_pki

    pki = load_pki(layout.certs_dir)
    address = layout.shard_addresses[0]
    host = address.rsplit(":", 1)[0]
    probe = ShardStatusProbe(address, layout.certs_dir, layout.tokens["admin"])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and probe.version() < 20:  # attack while it trains
        time.sleep(0.1)
    bulk_port = probe.status()["bulk_port"]
    creds = grpc.ssl_channel_credentials(root_certificates=pki.ca_cert.read_bytes())
    channel = grpc.secure_channel(address, creds, options=GRPC_OPTIONS)
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    insider = layout.tokens["hospital-0"]
    other_key = layout.run_dir / "attacker-key"
    generate_signing_key(other_key)
    forged = TokenIssuer.from_dir(other_key).issue("digits-hybrid", "hospital", "worker", 600, worker="hospital-0")

    def rpc(name: str, call, token: str | None) -> None:
        md = (("authorization", f"Bearer {token}"),) if token else ()
        try:
            result = call(md)
            if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
                list(result)
            report[name] = ("OK", "")
        except grpc.RpcError as err:
            report[name] = (err.code().name, err.details())

    join = ps_pb2.JoinRequest(wire_version=WIRE_VERSION, worker_id="hospital-5", site="hospital", num_shards=2,
                              block_size_bytes=8, codec="none",
                              params=[ps_pb2.TensorSpec(name="w", shape=[1 << 20, 1 << 20], dtype="float32")])
    # outsiders: no token, a token signed by another key
    rpc("outsider_leave_no_token", lambda md: stub.Leave(ps_pb2.LeaveRequest(worker_id="cloud-0"), metadata=md,
                                                          timeout=5), None)
    rpc("outsider_join_forged", lambda md: stub.Join(join, metadata=md, timeout=5), forged)
    # an insider: the hospital's first worker, acting as others or bending the model
    rpc("insider_leave_other_site", lambda md: stub.Leave(ps_pb2.LeaveRequest(worker_id="cloud-0"), metadata=md,
                                                           timeout=5), insider)
    rpc("insider_heartbeat_other_worker", lambda md: stub.Heartbeat(ps_pb2.HeartbeatRequest(worker_id="hospital-1"),
                                                                     metadata=md, timeout=5), insider)
    rpc("insider_join_extra_id_huge_model", lambda md: stub.Join(join, metadata=md, timeout=5), insider)
    rpc("insider_pull_as_other", lambda md: stub.Pull(ps_pb2.PullRequest(worker_id="cloud-1", timeout_s=1e9),
                                                       metadata=md, timeout=5), insider)
    channel.close()
    # the bulk port: garbage, a HELLO without token, an insider pulling as another worker, a silent flood
    with socket.create_connection((host, bulk_port), timeout=5) as s:
        s.sendall(b"\x16\x03\x01\xff\xff" + b"\0" * 64)  # a bogus TLS record
        try:
            report["outsider_bulk_garbage"] = ("closed", repr(s.recv(64)))
        except OSError as err:
            report["outsider_bulk_garbage"] = ("closed", repr(err))
    ctx = client_ssl_context(str(pki.ca_cert))
    for name, token, request in [("outsider_bulk_no_token", None, "cloud-0"),
                                 ("insider_bulk_pull_as_other", insider, "cloud-0")]:
        chan = BulkChannel(host, bulk_port, ctx, None, token)
        try:
            chan.pull(ps_pb2.PullRequest(worker_id=request), timeout_s=5)
            report[name] = ("OK", "")
        except BulkError as err:
            report[name] = (err.code().name, err.details())
        chan.close()
    flood = []
    for _ in range(100):
        try:
            flood.append(socket.create_connection((host, bulk_port), timeout=5))
        except OSError:
            break
    time.sleep(1.0)
    for s in flood:
        s.close()
    status = probe.status()
    report["members"] = sorted(status["members"])
    probe.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", ["digits-hybrid.yaml", "digits-hybrid-paddle.yaml"])
def test_live_job_attacked_from_outside_and_inside_completes(tmp_path, example):
    job = _job(tmp_path, example)
    spec = load_spec(job)
    report: dict = {}
    watchers: list[threading.Thread] = []
    peaks: dict[str, int] = {}

    def on_started(sup, layout):
        def watch_rss():  # the shards' peak RSS, read until they exit
            while not report.get("done"):
                for i in range(spec.ps.shards):
                    pid = sup.pid(f"shard-{i}")
                    try:
                        peaks[f"shard-{i}"] = max(peaks.get(f"shard-{i}", 0), peak_rss_bytes(pid))
                    except (OSError, TypeError, RuntimeError):
                        pass  # not started, gone, or exited and not yet reaped (no memory lines in its status)
                time.sleep(0.2)

        def attack():
            try:
                _attack(layout, report)
            except Exception as err:  # noqa: BLE001 - reported and asserted below
                report["attack_error"] = repr(err)

        for target in (watch_rss, attack):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            watchers.append(t)

    summary = run_ps_job(spec, job, echo=False, show_progress=False, run_root=tmp_path / "runs", on_started=on_started)
    watchers[1].join(30)
    report["done"] = True
    watchers[0].join(5)
    print(json.dumps({k: v for k, v in report.items() if k != "done"}, indent=1), json.dumps(peaks))
    assert "attack_error" not in report, report.get("attack_error")
    assert summary["status"] == "completed", summary
    assert summary["test_accuracy"] >= 0.95
    expected = {
        "outsider_leave_no_token": ("UNAUTHENTICATED", "missing token"),
        "outsider_join_forged": ("UNAUTHENTICATED", "signature is invalid"),
        "insider_leave_other_site": ("PERMISSION_DENIED", "token is for worker 'hospital-0'"),
        "insider_heartbeat_other_worker": ("PERMISSION_DENIED", "token is for worker 'hospital-0'"),
        "insider_join_extra_id_huge_model": ("PERMISSION_DENIED", "token is for worker 'hospital-0'"),
        "insider_pull_as_other": ("PERMISSION_DENIED", "token is for worker 'hospital-0'"),
        "outsider_bulk_no_token": ("UNAUTHENTICATED", "missing token"),
        "insider_bulk_pull_as_other": ("PERMISSION_DENIED", "token is for worker 'hospital-0'"),
    }
    for name, (code, message) in expected.items():
        assert report[name][0] == code and message in report[name][1], (name, report[name])
    assert report["outsider_bulk_garbage"][0] == "closed"
    # no worker id beyond the job's joined, and every shard stayed small
    assert set(report["members"]) <= {"hospital-0", "hospital-1", "cloud-0", "cloud-1"}
    assert len(peaks) == spec.ps.shards and all(0 < p < 2 * GIB for p in peaks.values()), peaks
