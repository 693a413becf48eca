"""`hfleet ps`: run one parameter-server shard, or ask shards for their status."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Optional

import typer

from hybridfleet.errors import PortInUseError, UsageError
from hybridfleet.obs.log import get_logger
from hybridfleet.spec import load_spec

log = get_logger("cli.ps")

group = typer.Typer(help="Parameter-server shards (one per machine in real clusters).", no_args_is_help=True)


@group.command("serve")
def serve(
    job: str = typer.Argument(..., help="the job file"),
    shard: int = typer.Option(..., help="this shard's index, 0..ps.shards-1"),
    host: str = typer.Option("127.0.0.1", help="address to bind"),
    port: int = typer.Option(50051, help="port to bind (0: any free port; a restarted shard takes the one in --port-file)"),
    bulk_port: int = typer.Option(0, help="port of the bulk data plane for tensor bytes (0: any free port; "
                                         "workers learn it when they join)"),
    certs: Optional[Path] = typer.Option(None, help="directory from `hfleet certs init` (TLS + token key)"),
    port_file: Optional[Path] = typer.Option(None, help="write host:port here once serving"),
    expected_workers: int = typer.Option(0, help="hold the first BSP round until this many workers joined"),
    snapshot_store: Optional[str] = typer.Option(None, help="where snapshots go (default: the job's checkpoint.store)"),
    insecure_plaintext: bool = typer.Option(False, "--insecure-plaintext", help="serve without TLS (explicit)"),
    no_auth: bool = typer.Option(False, "--no-auth", help="accept calls without a token (explicit)"),
    shards: Optional[int] = typer.Option(None, "--shards", help="the job's shard count now, when `hfleet ps "
                                                                "scale` changed it (default: ps.shards)"),
) -> None:
    """Serve shard SHARD of JOB until SIGTERM/Ctrl-C; SIGUSR1 hands over: stop answering, write a
    snapshot of the version held, exit 0 (`hfleet ps scale`)."""
    from hybridfleet.launch.helpers import restart_count
    from hybridfleet.ps.alloc import SHARD_MALLOC_ARENAS, tune_allocator
    from hybridfleet.ps.server.serve import server_security, start_shard

    tune_allocator(arenas=SHARD_MALLOC_ARENAS)
    spec = load_spec(job)
    if shards is not None:
        if shards < 1:
            raise UsageError(f"--shards: must be >= 1 (got {shards})", hint="leave it out to serve ps.shards")
        spec.ps.shards = shards
    security = server_security(spec, certs, insecure_plaintext, no_auth)  # UsageError naming the flags
    came_back = port == 0 and port_file is not None and restart_count() > 0 and port_file.is_file()
    if came_back:
        port = int(port_file.read_text().rsplit(":", 1)[1])  # come back where the workers left this shard
    try:
        server = start_shard(spec, shard, host, port, security, expected_workers, snapshot_store, bulk_port=bulk_port)
    except PortInUseError:
        if not came_back:
            raise
        # the old address is gone (taken by another process): serve as this shard's replacement on a
        # new port; the port file below tells the workers, which follow it (ps.worker.resolve)
        log.warning("shard_replaced_at_new_port", shard=shard, old_port=port)
        server = start_shard(spec, shard, host, 0, security, expected_workers, snapshot_store, bulk_port=bulk_port)
    from hybridfleet.obs.metrics import serve_from_env
    from hybridfleet.obs.psmetrics import watch_shard

    watch_shard(server.state)
    serve_from_env()  # before the port file: `hfleet run` waits for that file, then expects metrics
    done = threading.Event()
    stopped_by: list[int] = []
    # SIGUSR1: hand over (`hfleet ps scale`): stop answering, write a snapshot of the version held, exit 0.
    # The handlers go in before the port file: whoever waits for that file may signal at once.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, lambda signum, _frame: (stopped_by.append(signum), done.set()))
    if port_file is not None:
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(f"{host}:{server.port}\n")
        tmp.rename(port_file)
    while not stopped_by:  # polled as well: a wake-up from the handler can be missed
        done.wait(0.2)
    handover = stopped_by[0] == signal.SIGUSR1
    server.stop(grace_s=1.0, final_snapshot=handover)
    if handover:
        log.info("shard_handed_over", shard=shard, version=server.state.version)
    # SIGTERM is how a supervisor or Kubernetes stops a shard: a clean exit 0. Ctrl-C is an
    # interruption, exit 130 as for every command (docs/errors.md).
    if stopped_by and stopped_by[0] == signal.SIGINT:
        raise KeyboardInterrupt


@group.command("status")
def status(
    address: str = typer.Argument(..., help="host:port of a shard"),
    certs: Optional[Path] = typer.Option(None, help="directory holding the CA certificate"),
    token: Optional[str] = typer.Option(None, envvar="HFLEET_TOKEN", help="bearer token (role admin/monitor/worker)"),
    insecure_plaintext: bool = typer.Option(False, "--insecure", "--insecure-plaintext",
                                            help="connect without TLS; the token then travels unencrypted"),
    status_timeout_s: float = typer.Option(5.0, "--timeout-s", help="how long to wait for the shard's answer"),
) -> None:
    """Print one shard's status as JSON (over TLS: --certs DIR; plaintext only with --insecure)."""
    import grpc

    from hybridfleet.ps.worker.rpc_errors import explain
    from hybridfleet.ps.worker.status import ShardStatusProbe

    if certs is None and not insecure_plaintext:
        raise UsageError("--certs DIR is required to check the shard's TLS certificate",
                         hint="pass --certs DIR (the directory from `hfleet certs init`), or --insecure "
                              "for a shard served without TLS (a token then travels unencrypted)")
    probe = ShardStatusProbe(address, certs, token, insecure=insecure_plaintext)
    try:
        typer.echo(json.dumps(probe.status(timeout_s=status_timeout_s), indent=2))
    except grpc.RpcError as err:
        raise explain(err, address, "status", token_given=bool(token)) or err from None
    finally:
        probe.close()


@group.command("reshard")
def reshard(
    store: str = typer.Argument(..., help="the snapshot store of a stopped job (its ps/shard-<i> folders), "
                                          "e.g. RUN_DIR/snapshots or s3://bucket/job/run"),
    shards: int = typer.Option(..., "--shards", help="the new shard count (then set ps.shards to it)"),
) -> None:
    """Re-cut a stopped job's shard snapshots for --shards N shards (BSP and local rounds only).

    Every block moves with its optimizer state to its shard under the new plan, at the newest
    version all old shards hold; start N shards (`hfleet run JOB --resume RUN` with ps.shards: N
    does this by itself) and training continues where it stopped."""
    from hybridfleet.ps.server.handover import HandoverError, reshard_store

    if "://" not in store:
        store = f"file://{Path(store).resolve()}"
    try:
        moved = reshard_store(store, shards)
    except HandoverError as err:
        raise UsageError(str(err), hint="pass --shards N >= 1 and the store of a stopped BSP job whose "
                                        "shards share a snapshot version") from None
    typer.echo(json.dumps(moved))


@group.command("scale")
def scale(
    run_dir: Path = typer.Argument(..., help="the folder of a running `hfleet run` job (it printed it)"),
    shards: int = typer.Option(..., "--shards", help="the new shard count"),
    timeout_s: float = typer.Option(300.0, "--timeout-s", help="how long to wait for the job's answer"),
) -> None:
    """Change the shard count of a running BSP job to --shards N while it trains.

    At a round boundary every shard writes a snapshot and stops, the snapshots are re-cut for N
    shards (each block with its optimizer state), N shards start from them and the workers join
    them at their next step: training goes on as it would have on the old count. Refused, with
    nothing changed: N < 1, a folder that is not a running job, ps.sync asp/ssp, a job without
    shard snapshots or under secure aggregation. N equal to the current count changes nothing."""
    from hybridfleet.launch.scale import ScaleError, request_scale

    if shards < 1:
        raise UsageError(f"--shards: must be an integer >= 1 (got {shards}); nothing changed",
                         hint="pass the new shard count, e.g. --shards 4")
    try:
        answer = request_scale(run_dir, shards, timeout_s)
    except ScaleError as err:
        raise UsageError(str(err), hint=err.hint) from None
    if not answer.get("ok"):
        raise UsageError(answer.get("error", "the job refused the change"),
                         hint=answer.get("hint") or f"see {run_dir}/logs/")
    answer.pop("token", None)
    typer.echo(json.dumps(answer))


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="ps")
