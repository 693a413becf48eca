"""Preflight checks of `hfleet launch`: ports, master reachability, devices, frameworks, flags."""

from __future__ import annotations

import socket
import time

import pytest

from hybridfleet.cli.app import main
from hybridfleet.errors import FrameworkMissingError, GpuRequiredError, LaunchError
from hybridfleet.launch import preflight
from hybridfleet.launch.collective import LaunchConfig, build_command, launch


@pytest.fixture
def listening_port():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    yield sock.getsockname()[1]
    sock.close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_single_node_busy_master_port_is_replaced_by_a_free_one(listening_port):
    # Execute
    resolved = preflight.resolve_master(f"127.0.0.1:{listening_port}", "1", 0, connect_timeout_s=1)

    # Assert
    host, port = preflight.parse_master(resolved)
    assert host == "127.0.0.1"
    assert port != listening_port
    assert not preflight.port_in_use(host, port)


def test_multi_node_rank0_busy_master_port_is_an_error_naming_the_port(listening_port):
    with pytest.raises(LaunchError, match=f"master port {listening_port} on 127.0.0.1 is already in use"):
        preflight.resolve_master(f"127.0.0.1:{listening_port}", "2", 0, connect_timeout_s=1)


def test_unreachable_master_fails_within_the_timeout_naming_host_and_port():
    # Prepare
    port = _closed_port()
    timeout_s = 0.5

    # Execute
    started = time.monotonic()
    with pytest.raises(LaunchError, match=f"master 127.0.0.1:{port} is unreachable after 0.5s"):
        preflight.resolve_master(f"127.0.0.1:{port}", "2", 1, connect_timeout_s=timeout_s)

    # Assert: bounded (generous margin; this is a bound, not a timing measurement)
    assert time.monotonic() - started < timeout_s + 10


def test_reachable_master_passes_for_a_worker_node(listening_port):
    assert preflight.resolve_master(f"127.0.0.1:{listening_port}", "2", 1, 1) == f"127.0.0.1:{listening_port}"


@pytest.mark.parametrize("bad", ["nohost", "host:", ":29500", "host:0", "host:70000", "host:abc"])
def test_bad_master_address_is_an_error_naming_it(bad):
    with pytest.raises(LaunchError, match=f"--master must be host:port.*got {bad!r}"):
        preflight.parse_master(bad)


@pytest.mark.parametrize("bad", ["0", "3:2", "a", "1:2:3", ""])
def test_bad_nnodes_is_an_error_naming_it(bad):
    with pytest.raises(LaunchError, match="--nnodes"):
        preflight.parse_nnodes(bad)


def test_elastic_nnodes_parse_to_min_and_max():
    assert preflight.parse_nnodes("2:4") == (2, 4)
    assert preflight.parse_nnodes("3") == (3, 3)


def test_more_processes_than_gpus_is_an_error():
    # The GPU count is passed in: no GPU on this machine, so the count stands in for one.
    with pytest.raises(LaunchError, match="--nproc-per-node 4 is more than the 2 visible GPU"):
        preflight.check_devices("gpu", nproc_per_node=4, visible_gpus=2)


def test_gpu_requested_without_any_gpu_is_gpu_required_error():
    with pytest.raises(GpuRequiredError, match="no GPU is visible"):
        preflight.check_devices("gpu", nproc_per_node=1, visible_gpus=0)


def test_cpu_run_needs_no_device_and_unknown_device_is_rejected():
    preflight.check_devices("cpu", nproc_per_node=8, visible_gpus=0)
    with pytest.raises(LaunchError, match="--device must be auto, cpu or gpu"):
        preflight.check_devices("tpu", nproc_per_node=1, visible_gpus=0)


def test_cuda_visible_devices_bounds_the_gpu_count(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,3")
    assert preflight.count_visible_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert preflight.count_visible_gpus() == 0


def test_missing_framework_raises_with_install_hint(monkeypatch):
    # Both frameworks are installed here, so the import name is pointed at a missing module.
    monkeypatch.setitem(preflight.FRAMEWORK_MODULES, "paddle", "hfleet_no_such_module")
    with pytest.raises(FrameworkMissingError, match=r"pip install 'hybridfleet\[paddle\]'"):
        preflight.check_framework("paddle")


def test_missing_framework_exits_3_from_the_cli(monkeypatch, tmp_path, capsys):
    # Prepare
    monkeypatch.setitem(preflight.FRAMEWORK_MODULES, "torch", "hfleet_no_such_module")
    script = tmp_path / "train.py"
    script.write_text("pass\n")

    # Execute
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--framework", "torch", "--log-dir", str(tmp_path / "logs"), str(script)])

    # Assert
    assert exit_info.value.code == 3
    assert "framework 'torch' is not installed" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


@pytest.mark.torch  # trains or probes torch
def test_missing_script_is_an_error_and_creates_no_log_dir(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--framework", "torch", "--log-dir", str(tmp_path / "logs"), str(tmp_path / "nope.py")])
    assert exit_info.value.code == 8
    assert "nope.py' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


@pytest.mark.torch  # trains or probes torch
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"framework": "jax"}, "--framework must be one of"),
        ({"nproc_per_node": 0}, "--nproc-per-node must be >= 1"),
        ({"max_restarts": -1}, "--max-restarts must be >= 0"),
        ({"nnodes": "2", "node_rank": 2, "master": "127.0.0.1:1"}, r"--node-rank must be in 0..1"),
        ({"nnodes": "2", "node_rank": 0}, "--nnodes > 1 needs --master"),
        ({"nnodes": "2", "master": "127.0.0.1:1"}, "torch with --nnodes > 1 needs --node-rank"),
        ({"framework": "paddle", "nnodes": "1:2", "master": "h:1"}, "needs an etcd master"),
    ],
)
def test_bad_launch_flags_are_errors_naming_the_flag(tmp_path, changes, message):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    config = LaunchConfig(**{"framework": "torch", "script": str(script), "log_dir": tmp_path / "logs", **changes})
    with pytest.raises(LaunchError, match=message):
        launch(config)
    assert not (tmp_path / "logs").exists()


def test_torch_and_paddle_commands_carry_the_same_settings(tmp_path):
    # Prepare
    common = dict(script="train.py", script_args=("--epochs", "3", "--log-dir", "x"), nproc_per_node=4,
                  nnodes="2", node_rank=1, log_dir=tmp_path)

    # Execute
    torch_cmd = build_command(LaunchConfig(framework="torch", **common), "10.0.0.1:1234", tmp_path / "a0")
    paddle_cmd = build_command(LaunchConfig(framework="paddle", **common), "10.0.0.1:1234", tmp_path / "a0")

    # Assert
    assert torch_cmd[1:3] == ["-m", "torch.distributed.run"]
    assert {"--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1",
            "--master-port=1234", "--max-restarts=0"} <= set(torch_cmd)
    assert paddle_cmd[1:3] == ["-m", "paddle.distributed.launch"]
    assert {"--nproc_per_node=4", "--nnodes=2", "--rank=1", "--master=10.0.0.1:1234",
            "--max_restart=0"} <= set(paddle_cmd)
    for cmd in (torch_cmd, paddle_cmd):
        assert cmd[-5:] == ["train.py", "--epochs", "3", "--log-dir", "x"]


def test_elastic_torch_launch_uses_c10d_rendezvous(tmp_path):
    cmd = build_command(LaunchConfig(framework="torch", script="t.py", nnodes="1:3"), "h:5", tmp_path)
    assert {"--nnodes=1:3", "--rdzv-backend=c10d", "--rdzv-endpoint=h:5"} <= set(cmd)


@pytest.mark.torch  # trains or probes torch
def test_unreachable_master_stops_the_launch_before_any_log_dir_exists(tmp_path):
    # Prepare
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    port = _closed_port()
    config = LaunchConfig(framework="torch", script=str(script), nnodes="2", node_rank=1,
                          master=f"127.0.0.1:{port}", connect_timeout_s=0.3, log_dir=tmp_path / "logs")

    # Execute / Assert
    with pytest.raises(LaunchError, match=f"master 127.0.0.1:{port} is unreachable"):
        launch(config)
    assert not (tmp_path / "logs").exists()


def test_listen_sets_tcp_nodelay_so_small_responses_are_not_held_by_nagle():
    """Without TCP_NODELAY each keep-alive request/response of the servers waited ~40 ms
    (Nagle's algorithm against delayed ACKs), measured with bench/serve.py."""
    import socket

    from hybridfleet.launch.preflight import listen

    server = listen("127.0.0.1", 0, "the test")
    try:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        accepted.close()
        client.close()
    finally:
        server.close()


def test_free_port_never_hands_out_a_port_twice_within_its_window():
    """The OS may give the same free port to two binds in a row; the ranks of one rendezvous each
    take one from free_port, so within the last 512 picks no port repeats, and each one is free to
    bind."""
    ports = [preflight.free_port() for _ in range(600)]
    for i in range(len(ports)):
        assert ports[i] not in ports[max(0, i - 511):i], (i, ports[i])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))

