"""``hfleet k8s render``: a job file in, one YAML file per Kubernetes object out."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from hybridfleet.errors import SpecError
from hybridfleet.k8s.collective import render_collective
from hybridfleet.k8s.common import APIS, SCHEDULERS, Manifest, RenderOptions, config_map, resolve_image
from hybridfleet.k8s.netpol import check_cidrs, network_policies
from hybridfleet.k8s.ps import dialled_hosts, render_ps, worker_name
from hybridfleet.k8s.scrape import add_scrape_annotations
from hybridfleet.security.certs import KEY_FILE_MODE, write_file_atomic
from hybridfleet.spec.load import parse_spec
from hybridfleet.spec.models import JobSpec

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def load_job(job_path: Path) -> tuple[JobSpec, str]:
    """The validated spec and the file's text (errors name the field)."""
    if not job_path.is_file():
        raise SpecError(f"{job_path}: no such job file")
    job_text = job_path.read_text()
    try:
        data = yaml.safe_load(job_text)
    except yaml.YAMLError as err:
        raise SpecError(f"{job_path}: not valid YAML: {err}") from None
    return parse_spec(data, str(job_path)), job_text


def image_for(spec: JobSpec, job_path: Path, options: RenderOptions) -> str:
    """``--image``, else the job's image (pinned by the lock's digest), else the tag `hfleet image render` gives."""
    if options.image:
        return options.image
    named = resolve_image(spec, job_path.parent)
    if named:
        return named
    from hybridfleet.env.image_request import render_image_for

    try:
        return render_image_for(str(job_path)).tag
    except SpecError as err:
        raise SpecError(f"environment.image: not set, and the tag `hfleet image render` would give is unknown "
                        f"({err}); pass --image TAG or set environment.image") from None


def check_options(spec: JobSpec, options: RenderOptions, manifests: bool = True) -> RenderOptions:
    """``options`` completed (the shard site) and checked against the job; SpecError naming the flag otherwise.

    ``manifests`` False: for the plain-host bundle, which has no NetworkPolicies (so no ``--ingress-cidr``).
    """
    if options.api not in APIS:
        raise SpecError(f"--api: must be one of {', '.join(APIS)} (got {options.api!r})")
    if options.scheduler is not None and options.scheduler not in SCHEDULERS:
        raise SpecError(f"--scheduler: must be one of {', '.join(SCHEDULERS)} (got {options.scheduler!r})")
    if not _DNS_LABEL.fullmatch(options.metrics_namespace):
        raise SpecError(f"--metrics-namespace: {options.metrics_namespace!r} is not a namespace name "
                        "(lower-case letters, digits and '-', at most 63)")
    check_cidrs(options.ingress_cidrs)
    if spec.mode == "collective":
        if options.site or options.external_names or options.ingress_cidrs:
            raise SpecError("--site/--external-name/--ingress-cidr: only parameter-server jobs (mode: ps) are "
                            "rendered per site")
        return options
    if options.api == "v2":
        raise SpecError("--api v2: only collective jobs become a TrainJob; PS jobs render as core objects")
    shard_site = options.shard_site or ("cloud" if "cloud" in spec.sites else next(iter(spec.sites)))
    for site, site_spec in spec.sites.items():  # a pod's hostname and its Job's label are DNS labels
        longest = worker_name(spec, site, site_spec.workers - 1)
        if len(longest) > 63:
            raise SpecError(f"sites.{site}: the worker Job name {longest!r} has {len(longest)} characters, over "
                            "Kubernetes' 63; shorten the job's name or the site's")
    for flag, site in (("--site", options.site), ("--shard-site", shard_site)):
        if site is not None and site not in spec.sites:
            raise SpecError(f"{flag}: {site!r} is not a site of the job ({', '.join(spec.sites)})")
    if options.external_names and len(options.external_names) != spec.ps.shards:
        raise SpecError(f"--external-name: give one per shard ({spec.ps.shards}), got {len(options.external_names)}")
    if options.site is not None and len(spec.sites) > 1 and not options.external_names:
        raise SpecError(f"--site {options.site}: other sites reach the shards from outside the cluster; "
                        f"give --external-name once per shard (the DNS names of their LoadBalancers)")
    exposes_shards = bool(options.external_names) and options.site in (None, shard_site) and manifests
    if not manifests and options.ingress_cidrs:
        raise SpecError("--ingress-cidr: a plain-host bundle has no NetworkPolicy; admit the other sites "
                        "in the shard hosts' firewall (TCP ports of the shards)")
    if exposes_shards and not options.ingress_cidrs:
        raise SpecError("--external-name: the shards' NetworkPolicy admits the other sites by source address; "
                        "give --ingress-cidr once per network they connect from (0.0.0.0/0 admits any address, "
                        "which then only the shards' TLS and tokens keep out)")
    if options.ingress_cidrs and not exposes_shards:
        raise SpecError("--ingress-cidr: only the bundle that exposes the shards (--external-name, and --site "
                        "the shard site when given) admits other sites")
    return RenderOptions(**{**options.__dict__, "shard_site": shard_site})


def _render(spec: JobSpec, job_text: str, job_path: Path, options: RenderOptions) -> list[Manifest]:
    image = image_for(spec, job_path, options)
    body = render_collective(spec, image, options) if spec.mode == "collective" else render_ps(spec, image, options)
    return [config_map(spec, job_text), *add_scrape_annotations(body), *network_policies(spec, options)]


def render_job_file(job_path: Path, options: RenderOptions | None = None) -> list[Manifest]:
    """Every manifest for the job in ``job_path`` under ``options`` (validated first; errors name the field)."""
    spec, job_text = load_job(job_path)
    return _render(spec, job_text, job_path, check_options(spec, options or RenderOptions()))


def render_to_dir(job_path: Path, options: RenderOptions, out_dir: Path) -> list[Path]:
    """Render and write the manifests; nothing is written when rendering fails."""
    spec, job_text = load_job(job_path)
    options = check_options(spec, options)
    return write_manifests(_render(spec, job_text, job_path, options), out_dir, secret_howto(spec, options))


def secret_howto(spec: JobSpec, options: RenderOptions) -> str:
    """The comment written above a placeholder Secret: how to make the real one."""
    from hybridfleet.k8s.credentials import certs_init_command

    init = certs_init_command(spec, dialled_hosts(spec, options)) if spec.mode == "ps" else "hfleet certs init certs/"
    return ("Placeholders: do not apply as is. Make the PKI with the names workers dial:\n"
            f"  {init}\n"
            "then render again with --certs certs/ (real values, one Secret per site).")


class _PlainDumper(yaml.SafeDumper):
    """Writes shared objects (a pod's labels in two places) in full, without YAML anchors."""

    def ignore_aliases(self, data) -> bool:
        return True


def plain_yaml(documents: list[Any]) -> str:
    """``documents`` as a YAML stream in key order, every shared object written out in full (no
    ``&id001`` / ``*id001`` anchors), ready to paste."""
    return yaml.dump_all(documents, Dumper=_PlainDumper, sort_keys=False)


def write_manifests(manifests: list[Manifest], out_dir: Path, howto: str = "") -> list[Path]:
    """Write ``NN-kind-name.yaml`` files into ``out_dir``; Secrets are created with mode 0600 (and placeholder
    Secrets get ``howto`` as a comment)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, manifest in enumerate(manifests):
        name = manifest["metadata"]["name"]
        path = out_dir / f"{index:02d}-{manifest['kind'].lower()}-{name}.yaml"
        header = ""
        values = manifest.get("stringData", {}).values() if manifest["kind"] == "Secret" else ()
        if any(str(v).startswith("REPLACE-with-") for v in values):
            header = "".join(f"# {line}\n" for line in howto.splitlines())
        text = header + yaml.dump(manifest, Dumper=_PlainDumper, sort_keys=False)
        if manifest["kind"] == "Secret":  # created 0600 (never readable by others, not even for a moment)
            write_file_atomic(path, text.encode(), KEY_FILE_MODE)
        else:
            path.write_text(text)
        paths.append(path)
    return paths
