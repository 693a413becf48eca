"""``hfleet k8s render``: a job file in, one YAML file per Kubernetes object out."""

from __future__ import annotations

from pathlib import Path

import yaml

from hybridfleet.errors import SpecError
from hybridfleet.k8s.collective import render_collective
from hybridfleet.k8s.common import Manifest, config_map, resolve_image
from hybridfleet.k8s.ps import SECRET_HOWTO, render_ps
from hybridfleet.k8s.scrape import add_scrape_annotations
from hybridfleet.spec.load import parse_spec


def render_job_file(job_path: Path) -> list[Manifest]:
    """Every manifest for the job in ``job_path`` (validated first; errors name the field)."""
    if not job_path.is_file():
        raise SpecError(f"{job_path}: no such job file")
    job_text = job_path.read_text()
    try:
        data = yaml.safe_load(job_text)
    except yaml.YAMLError as err:
        raise SpecError(f"{job_path}: not valid YAML: {err}") from None
    spec = parse_spec(data, str(job_path))
    image = resolve_image(spec, job_path.parent)
    body = render_collective(spec, image) if spec.mode == "collective" else render_ps(spec, image)
    return [config_map(spec, job_text), *add_scrape_annotations(body)]


def write_manifests(manifests: list[Manifest], out_dir: Path) -> list[Path]:
    """Write ``NN-kind-name.yaml`` files into ``out_dir``; Secrets get a comment on how to fill them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, manifest in enumerate(manifests):
        name = manifest["metadata"]["name"]
        path = out_dir / f"{index:02d}-{manifest['kind'].lower()}-{name}.yaml"
        header = ""
        if manifest["kind"] == "Secret":
            role = manifest["metadata"]["labels"]["hybridfleet/role"]
            header = "".join(f"# {line}\n" for line in SECRET_HOWTO[role].format(
                name=name, from_files=" ".join(f"--from-file=certs/{f}" for f in manifest.get("stringData", {}))).splitlines())
        path.write_text(header + yaml.safe_dump(manifest, sort_keys=False))
        paths.append(path)
    return paths
