"""`hfleet data`: site datasets — pack, ls, verify."""

from __future__ import annotations

import json
from typing import Optional

import typer

group = typer.Typer(help="Site datasets: pack into memory-mapped Arrow shards, list, verify.", no_args_is_help=True)

ENDPOINT_HELP = "S3-compatible endpoint URL (default: $AWS_ENDPOINT_URL or AWS)"


@group.command("pack")
def pack_cmd(src: str = typer.Argument(..., help="a .npz/.npy file, a .parquet or .csv table, a folder of files, "
                                                 "or a saved Arrow dataset folder"),
             dest: str = typer.Argument(..., help="destination: a path, file:///dir or s3://bucket/prefix"),
             site: Optional[str] = typer.Option(None, help="the site whose data this is; its workers alone may read it"),
             shard_mb: float = typer.Option(64.0, help="target shard size in MiB"),
             overwrite: bool = typer.Option(False, "--overwrite", help="replace a dataset already at DEST"),
             endpoint_url: Optional[str] = typer.Option(None, help=ENDPOINT_HELP)) -> None:  # fmt: skip
    """Pack SRC into Arrow IPC shards plus a manifest (written last) at DEST."""
    from hybridfleet.data import pack

    manifest = pack(src, dest, site=site, shard_bytes=int(shard_mb * (1 << 20)), overwrite=overwrite,
                    **({"endpoint_url": endpoint_url} if endpoint_url else {}))
    typer.echo(f"packed {manifest.rows} rows into {len(manifest.shards)} shard(s), {manifest.bytes:,d} bytes, "
               f"at {dest}; manifest sha256 {manifest.digest}")


@group.command("ls")
def ls_cmd(url: str = typer.Argument(..., help="a packed dataset: path, file:// or s3:// URL"),
           as_json: bool = typer.Option(False, "--json", help="print the manifest as JSON"),
           endpoint_url: Optional[str] = typer.Option(None, help=ENDPOINT_HELP)) -> None:  # fmt: skip
    """Describe a packed dataset: columns, shards, rows, bytes, site and digest."""
    from hybridfleet.data import read_manifest
    from hybridfleet.store import open_store

    manifest = read_manifest(open_store(url, **({"endpoint_url": endpoint_url} if endpoint_url else {})))
    if as_json:
        typer.echo(json.dumps({"digest": manifest.digest, **json.loads(manifest.to_json())}, indent=1))
        return
    typer.echo(f"{url}: {manifest.rows} rows, {len(manifest.shards)} shard(s), {manifest.bytes:,d} bytes, "
               f"site {manifest.site or '-'}, sha256 {manifest.digest}")
    typer.echo(f"{'column':<20} {'arrow type':<32} {'dtype':<6} shape")
    for c in manifest.columns:
        typer.echo(f"{c.name:<20} {c.arrow_type:<32} {c.dtype or '-':<6} {tuple(c.shape)}")


@group.command("verify")
def verify_cmd(url: str = typer.Argument(..., help="a packed dataset: path, file:// or s3:// URL"),
               endpoint_url: Optional[str] = typer.Option(None, help=ENDPOINT_HELP)) -> None:  # fmt: skip
    """Check every shard's size, sha256 and columns against the manifest; exit 14 on the first bad one."""
    from hybridfleet.data.dataset import PackedDataset
    from hybridfleet.data.manifest import read_manifest
    from hybridfleet.store import open_store

    store = open_store(url, **({"endpoint_url": endpoint_url} if endpoint_url else {}))
    dataset = PackedDataset(store, read_manifest(store), verify=True)
    for index, shard in enumerate(dataset.manifest.shards):
        dataset._open(index)
        typer.echo(f"ok  {shard.name}  {shard.rows} rows  {shard.bytes:,d} B")
    typer.echo(f"valid: {len(dataset)} rows, manifest sha256 {dataset.manifest.digest}")


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="data")
