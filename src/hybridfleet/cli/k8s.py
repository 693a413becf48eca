"""`hfleet k8s`: Kubernetes / Kubeflow manifests, and the plain-host bundle of a site without Kubernetes."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

group = typer.Typer(help="Kubernetes / Kubeflow manifests.", no_args_is_help=True)


@group.command("render")
def render(
    job: Path = typer.Argument(..., help="job file (YAML)"),
    out_dir: Path = typer.Option(Path("k8s"), "--out", "-o", help="directory for the manifests"),
    image: Optional[str] = typer.Option(None, "--image", help="image for every pod (default: environment.image, "
                                                              "else the tag `hfleet image render JOB` prints)"),
    api: str = typer.Option("v1", "--api", help="collective torch jobs: v1 (PyTorchJob) or v2 (Trainer TrainJob)"),
    site: Optional[str] = typer.Option(None, "--site", help="render only this site's bundle (hybrid topology); "
                                                            "the shard site's bundle also holds the shards"),
    shard_site: Optional[str] = typer.Option(None, "--shard-site", help="the site whose cluster runs the shards "
                                                                        "(default: 'cloud', else the first site)"),
    external_name: List[str] = typer.Option([], "--external-name", help="DNS name other sites dial for shard i "
                                                                        "(repeat once per shard, in shard order)"),
    ingress_cidr: List[str] = typer.Option([], "--ingress-cidr", help="with --external-name: a network (CIDR) the "
                                                                      "other sites connect from; the shards' "
                                                                      "NetworkPolicy admits only these (repeat)"),
    metrics_namespace: str = typer.Option("monitoring", "--metrics-namespace", help="the namespace whose pods may "
                                                                                 "scrape every pod's metrics port"),
    certs: Optional[Path] = typer.Option(None, "--certs", help="`hfleet certs init` directory: Secrets get real values"),
    placeholders: bool = typer.Option(False, "--placeholders", help="write REPLACE-with-... Secret values "
                                                                    "(to fill in later) instead of --certs"),
    scheduler: Optional[str] = typer.Option(None, "--scheduler", help="volcano: gang-schedule all pods of the job"),
    plain_host: bool = typer.Option(False, "--plain-host", help="with --site: a bundle for machines without "
                                                                "Kubernetes (scripts + systemd units), not manifests"),
    site_rank: Optional[int] = typer.Option(None, "--site-rank", help="with --plain-host: the bundle of one worker's "
                                                                      "machine (only its token)"),
) -> None:
    """Render JOB as Kubernetes manifests (one file per object), or one site's plain-host bundle."""
    from hybridfleet.k8s.common import RenderOptions
    from hybridfleet.k8s.credentials import CredentialSource

    options = RenderOptions(image=image, api=api, site=site, shard_site=shard_site, external_names=tuple(external_name),
                            ingress_cidrs=tuple(ingress_cidr), metrics_namespace=metrics_namespace,
                            credentials=CredentialSource(certs, placeholders), scheduler=scheduler)
    if plain_host:
        from hybridfleet.k8s.hostbundle import write_host_bundle

        paths = write_host_bundle(job, options, out_dir, site_rank)
    else:
        from hybridfleet.k8s.render import render_to_dir

        if site_rank is not None:
            raise typer.BadParameter("only with --plain-host (each worker's pod already mounts only its own token)",
                                     param_hint="--site-rank")
        paths = render_to_dir(job, options, out_dir)
    for path in paths:
        typer.echo(str(path))


@group.command("quota")
def quota(
    job: Path = typer.Argument(..., help="job file (YAML)"),
    namespace: str = typer.Option("team-a", "--namespace", help="the team's namespace"),
    jobs: int = typer.Option(1, "--jobs", help="how many such jobs may run at once in the namespace"),
) -> None:
    """Print a ResourceQuota + LimitRange example for a team namespace sized for JOB."""
    from hybridfleet.k8s.render import load_job, plain_yaml
    from hybridfleet.k8s.scheduling import job_pods, team_quota

    if jobs < 1:
        raise typer.BadParameter(f"must be >= 1 (got {jobs})", param_hint="--jobs")
    spec, _ = load_job(job)
    typer.echo(plain_yaml(team_quota(spec, job_pods(spec) * jobs, namespace)), nl=False)


@group.command("render-serving")
def render_serving(
    ref: str = typer.Argument(..., help="NAME@ALIAS: its rollout becomes KServe's canary"),
    mode: str = typer.Option("serverless", "--mode", help="serverless (canaryTrafficPercent) or standard (spec.canary)"),
    fmt: str = typer.Option("onnx", "--format", help="onnx (Triton) or paddle-inference (paddle server)"),
    namespace: str = typer.Option("default", "--namespace"),
    name: Optional[str] = typer.Option(None, "--name", help="InferenceService name (default: NAME-ALIAS)"),
    s3_endpoint: Optional[str] = typer.Option(None, "--s3-endpoint", help="S3 endpoint URL (default: $AWS_ENDPOINT_URL)"),
    s3_region: Optional[str] = typer.Option(None, "--s3-region"),
    secret_name: Optional[str] = typer.Option(None, "--secret-name", help="an existing Secret with the S3 keys"),
    cpu: str = typer.Option("1", "--cpu"), memory: str = typer.Option("2Gi", "--memory"),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="write the YAML here (default: stdout)"),
    registry: Optional[str] = typer.Option(None, "--registry", "-r", help="registry URL or database (default: $HFLEET_REGISTRY)"),
    token: Optional[str] = typer.Option(None, "--token", help="registry token (default: $HFLEET_REGISTRY_TOKEN)"),
) -> None:
    """Render a KServe InferenceService for a registry alias, its canary weight taken from the rollout."""
    import os

    import yaml

    from hybridfleet.k8s.serving import GATEWAY_NOTE, render_inference_service
    from hybridfleet.registry.client import open_registry

    objects = render_inference_service(open_registry(registry, token), ref, mode, fmt, namespace, name,
                                       s3_endpoint or os.environ.get("AWS_ENDPOINT_URL"), s3_region, secret_name, cpu, memory)
    text = yaml.safe_dump_all(objects, sort_keys=False)
    if mode == "standard":
        text = f"# {GATEWAY_NOTE}\n" + text
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        typer.echo(str(out))


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="k8s")
