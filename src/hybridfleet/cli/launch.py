"""`hfleet launch`: collective data parallel for torch or paddle, through their own launchers."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer


def launch_command(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="training script; arguments after it are passed to it untouched"),
    framework: str = typer.Option(..., "--framework", "-f", help="torch or paddle"),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", "-n", help="processes on this node"),
    nnodes: str = typer.Option("1", "--nnodes", help="N, or MIN:MAX for elastic"),
    master: str = typer.Option(None, "--master", help="host:port of the rendezvous (node rank 0)"),
    node_rank: int = typer.Option(None, "--node-rank", help="this node's rank (default 0 on one node; paddle assigns it)"),
    max_restarts: int = typer.Option(0, "--max-restarts", help="restart the whole group this many times"),
    log_dir: Path = typer.Option(None, "--log-dir", help="per-rank logs; default runs/launch-<time>"),
    ckpt_dir: str = typer.Option(None, "--ckpt-dir", help="HFLEET_CKPT_DIR: a directory or a store URL "
                                                        "(s3://bucket/prefix); default <log-dir>/ckpt"),
    device: str = typer.Option("auto", "--device", help="auto (framework default), cpu (gloo) or gpu (one per process)"),
    connect_timeout_s: float = typer.Option(60.0, "--connect-timeout-s", help="how long a node waits for the master"),
) -> None:
    """Run SCRIPT on N processes per node with torch.distributed.run or paddle.distributed.launch."""
    from hybridfleet.launch.collective import LaunchConfig, launch

    config = LaunchConfig(
        framework=framework, script=script, script_args=tuple(ctx.args), nproc_per_node=nproc_per_node,
        nnodes=nnodes, master=master, node_rank=node_rank, max_restarts=max_restarts,
        log_dir=log_dir or Path("runs") / time.strftime("launch-%Y%m%d-%H%M%S"), ckpt_dir=ckpt_dir,
        device=device, connect_timeout_s=connect_timeout_s,
    )
    result = launch(config, echo=lambda line: (sys.stdout.write(line), sys.stdout.flush()))
    typer.echo(f"launch finished after {result.attempts} attempt(s); logs in {result.log_dir}", err=True)


def register(app: typer.Typer) -> None:
    app.command(
        "launch",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False},
    )(launch_command)
