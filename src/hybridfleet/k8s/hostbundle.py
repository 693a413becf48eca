"""One site's bundle for plain machines (no Kubernetes): the job file, its credentials, scripts, systemd units.

Layout of the bundle directory (copy it to ``/opt/hfleet/<job>`` on each machine of the site)::

    job.yaml                     the job file
    certs/                       only this site's files (the shard site: also the shards')
    run-worker.sh RANK           one worker, site rank RANK (one per machine, or several)
    run-shard.sh INDEX           the shard site only: one shard
    hfleet-worker@.service       systemd template: `systemctl enable --now hfleet-worker@0`
    hfleet-shard@.service        the shard site only

Workers dial the shards at the external names (plain machines have no cluster DNS), so
the bundle needs ``--external-name`` once per shard and real credentials (``--certs``).
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from hybridfleet.errors import SpecError
from hybridfleet.k8s.common import CERTS_DIR, JOB_FILE, PS_BULK_PORT, PS_PORT, RenderOptions
from hybridfleet.k8s.credentials import SHARD_ROLE, TOKEN_PREFIX, credential_value, secret_files, tls_on
from hybridfleet.k8s.ps import SITE_HUB_PORT, aggregates, server_addresses, shard_command, worker_command
from hybridfleet.k8s.render import check_options, load_job

INSTALL_DIR = "/opt/hfleet"
SCRIPT_MODE = 0o755
KEY_MODE = 0o600
CERT_MODE = 0o644

_SCRIPT_HEAD = """#!/usr/bin/env bash
# Rendered by `hfleet k8s render --plain-host`; regenerate it rather than edit it.
set -euo pipefail
cd "$(dirname "$0")"
"""

_UNIT = """[Unit]
Description=hybridfleet {job}: {role} %i
After=network-online.target
Wants=network-online.target

[Service]
WorkingDirectory={workdir}
ExecStart={workdir}/run-{role}.sh %i
Restart={restart}
RestartSec=5

[Install]
WantedBy=multi-user.target
"""


def _command_line(command: list[str], placeholder: str) -> str:
    """A shell line of ``command`` whose ``placeholder`` argument becomes ``"$1"``."""
    return " ".join('"$1"' if arg == placeholder else shlex.quote(arg) for arg in command)


def _local_paths(command: list[str]) -> list[str]:
    """The container command with the bundle's relative paths in place of the pod's mount points."""
    return ["job.yaml" if a == JOB_FILE else "certs" if a == CERTS_DIR else a for a in command]


def _write(path: Path, text: str, mode: int) -> Path:
    from hybridfleet.security.certs import write_file_atomic

    write_file_atomic(path, text.encode(), mode)
    return path


def write_host_bundle(job_path: Path, options: RenderOptions, out_dir: Path,
                      site_rank: int | None = None) -> list[Path]:
    """Write ``options.site``'s plain-host bundle into ``out_dir``; return the files written.

    With ``site_rank`` the bundle is for that worker's machine alone: ``certs/`` holds its
    token and no other, and ``run-worker.sh`` runs that rank only. Everything is checked and
    every credential read before the first file is written.
    """
    spec, _ = load_job(job_path)
    if spec.mode != "ps":
        raise SpecError("--plain-host: only parameter-server jobs have a plain-host bundle; "
                        "collective jobs run with `hfleet launch` on each node")
    if options.site is None:
        raise SpecError("--plain-host: name the site with --site")
    if not options.external_names:
        raise SpecError("--plain-host: give --external-name once per shard (the names machines dial the shards at)")
    if options.credentials.certs_dir is None and (tls_on(spec) or spec.security.tokens != "off"):
        raise SpecError("--plain-host: needs --certs DIR (from `hfleet certs init`); a bundle holds real files")
    options = check_options(spec, options, manifests=False)
    site = options.site
    assert site is not None
    if site_rank is not None and not 0 <= site_rank < spec.sites[site].workers:
        raise SpecError(f"--site-rank: must be in 0..{spec.sites[site].workers - 1} for site {site!r} (got {site_rank})")
    with_shards = site == options.shard_site
    if options.credentials.certs_dir is not None and tls_on(spec):
        from hybridfleet.k8s.credentials import check_server_names

        check_server_names(options.credentials.certs_dir, list(options.external_names))
    owners = ([SHARD_ROLE] if with_shards else []) + [site]
    files = {name: credential_value(spec, owner, name, options.credentials)
             for owner in owners for name in secret_files(spec, owner, None if owner == SHARD_ROLE else site_rank)}
    servers = server_addresses(spec, list(options.external_names))
    worker = _local_paths(worker_command(spec, site, "RANK", servers, "/etc/hfleet/certs"))
    has_tokens = any(name.startswith(TOKEN_PREFIX) for name in files)
    token = f'export HFLEET_TOKEN_FILE="$PWD/certs/{TOKEN_PREFIX}{site}-$1"\n' if has_tokens else ""
    if aggregates(spec, site):  # followers send their gradients to the site leader (site rank 0) over the site network
        token += (f': "${{HFLEET_SITE_HUB:?set HFLEET_SITE_HUB=<host of site rank 0>:{SITE_HUB_PORT} '
                  '(the same on every machine of the site)}"\nexport HFLEET_SITE_HUB\n')
    ranks = f"{site_rank}" if site_rank is not None else f"0..{spec.sites[site].workers - 1}"
    only = ("" if site_rank is None else
            f'[ "$1" = {site_rank} ] || '
            f'{{ echo "this bundle holds the token of site rank {site_rank} only" >&2; exit 2; }}\n')
    scripts = {"worker": _SCRIPT_HEAD + f": \"${{1:?usage: $0 SITE_RANK ({ranks})}}\"\n" + only
               + token + "exec " + _command_line(worker, "RANK") + "\n"}
    if with_shards:
        shard = _local_paths(shard_command(spec, "INDEX", "/etc/hfleet/certs"))
        ports = f"{PS_PORT}" + ("" if spec.ps.transport == "grpc" else f" and {PS_BULK_PORT}")
        scripts["shard"] = (_SCRIPT_HEAD + f"# Open TCP {ports} to the other sites.\n"
                            + f": \"${{1:?usage: $0 SHARD_INDEX (0..{spec.ps.shards - 1})}}\"\n"
                            + "exec " + _command_line(shard, "INDEX") + "\n")

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "certs").mkdir(exist_ok=True)
    written = [out_dir / "job.yaml"]
    shutil.copyfile(job_path, written[0])
    for name, text in files.items():
        mode = KEY_MODE if name.endswith(".key") or name.startswith(TOKEN_PREFIX) else CERT_MODE
        written.append(_write(out_dir / "certs" / name, text, mode))
    workdir = f"{INSTALL_DIR}/{spec.name}"
    for role, text in scripts.items():
        written.append(_write(out_dir / f"run-{role}.sh", text, SCRIPT_MODE))
        restart = "always" if role == "shard" else "on-failure"
        written.append(_write(out_dir / f"hfleet-{role}@.service",
                              _UNIT.format(job=spec.name, role=role, workdir=workdir, restart=restart), CERT_MODE))
    return written
