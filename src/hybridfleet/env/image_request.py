"""What `hfleet image render` renders for a job file or flags: the request resolved against the lock.

`hfleet k8s render` uses the same function, so the tag it puts into manifests is the tag
`hfleet image render` prints for the same job and lock.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from hybridfleet.env.dockerfile import RenderedImage, render_dockerfile
from hybridfleet.env.images import DEVICES, base_version, resolve_base_image
from hybridfleet.env.lock import make_lock, read_lock
from hybridfleet.env.probe import FRAMEWORKS
from hybridfleet.env.runtime_deps import job_extras, script_distributions
from hybridfleet.errors import SpecError


@dataclass
class ImageRequest:
    """The framework, version, device and lock an image is rendered for."""

    framework: str
    version: str | None
    device: str
    cuda: str | None
    lock_path: str | None
    name: str
    registry: str | None
    extras: tuple[str, ...] = ()  # hybridfleet extras the job's blocks need (`runtime_deps.job_extras`)
    distributions: tuple[str, ...] = ()  # what the job's scripts import (`runtime_deps.script_distributions`)


def image_request(job: str | None, framework: str | None, version: str | None, device: str | None,
                  cuda: str | None, lock: str | None) -> ImageRequest:
    """The request from a job file's ``environment`` section, overridden by flags; SpecError naming the flag."""
    if device is not None and device not in DEVICES:
        raise SpecError(f"--device: must be one of {', '.join(DEVICES)} (got {device!r})")
    if job:
        from hybridfleet.spec import load_spec

        spec = load_spec(job)
        env = spec.environment
        if framework and framework != spec.framework:
            raise SpecError(f"--framework: {framework} differs from the job's framework {spec.framework}")
        lock_path = lock or (str(Path(job).parent / env.lock) if env.lock and not Path(env.lock).is_absolute()
                             else env.lock)
        scripts = dict.fromkeys(Path(spec.site_entrypoint(site)) for site in spec.sites)
        imported = sorted({d for script in scripts for d in script_distributions(script)})
        return ImageRequest(spec.framework, version or env.version, device or env.device, cuda or env.cuda,
                            lock_path, spec.name, env.registry, job_extras(spec), tuple(imported))
    if not framework:
        raise SpecError("give a job file, or --framework with --version and --device")
    if framework not in FRAMEWORKS:
        raise SpecError(f"--framework: must be one of {sorted(FRAMEWORKS)} (got {framework!r})")
    return ImageRequest(framework, version, device or "cpu", cuda, lock, framework, None)


def _installed_version(framework: str) -> str | None:
    for dist in FRAMEWORKS[framework]["distributions"]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def render_request(req: ImageRequest, mirror: bool = False) -> RenderedImage:
    """The Dockerfile and tag for ``req`` (the lock's, else this machine's, distributions)."""
    if req.lock_path:
        lock_data, lock_source = read_lock(req.lock_path), Path(req.lock_path).name
    else:
        lock_data, lock_source = make_lock(), "this machine (no lock file given)"
    locked = lock_data["frameworks"].get(req.framework, {}).get("version")
    chosen = req.version or locked or _installed_version(req.framework)
    if chosen is None:
        raise SpecError(f"--version: {req.framework} is neither in the lock nor installed; give its version")
    locked_cuda = lock_data["frameworks"].get(req.framework, {}).get("cuda")
    wanted_cuda = req.cuda or (".".join(locked_cuda.split(".")[:2]) if locked_cuda and req.device == "gpu" else None)
    base = resolve_base_image(req.framework, base_version(chosen), req.device, wanted_cuda,
                              python=lock_data["python"]["minor"], mirror=mirror)
    return render_dockerfile(lock_data, base, name=req.name, registry=req.registry,
                             lock_source=lock_source, extras=req.extras, distributions=req.distributions)


def render_image_for(job: str) -> RenderedImage:
    """What `hfleet image render JOB` renders, with no flags."""
    return render_request(image_request(job, None, None, None, None, None))
