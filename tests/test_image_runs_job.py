"""The image `hfleet image render` writes for each shipped example job runs that job's imports.

No Docker engine runs here, so the image is stood in for by a virtual environment that holds
exactly the distributions the Dockerfile installs (its pins, plus the framework where the base
image brings it) and hybridfleet from the copied project: each distribution's installed files,
as its RECORD lists them, are linked into a fresh venv without pip. The job's modules are then
imported there by a fresh interpreter: a pin the Dockerfile leaves out is an ImportError.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from hybridfleet.env.image_request import image_request, render_request
from hybridfleet.env.runtime_deps import imported_modules
from hybridfleet.spec import load_spec
from tests.examples import REPO, example_job

# the torch and the paddle demo, and the CI example (a `registry:` block)
EXAMPLES = {"digits-hybrid-paddle.yaml": "paddle", "ci/digits-ci.yaml": "torch"}
# what `hfleet run` and the job's blocks import besides the script: the CLI, shards, workers,
# the report, the registry client and publish, packed data, differential privacy, S3 stores
RUN_MODULES = ["hybridfleet.cli.app", "hybridfleet.launch.psjob", "hybridfleet.ps.server.serve",
               "hybridfleet.obs.report", "hybridfleet.data", "hybridfleet.privacy.dp", "s3fs",
               "hybridfleet.registry.publish", "hybridfleet.registry.client", "matplotlib.pyplot"]
FRAMEWORK_DIST = {"torch": "torch", "paddle": "paddlepaddle"}


def _name(requirement: str) -> str:
    return requirement.split("<")[0].split("=")[0]


def venv_of(root: Path, distributions: set[str]) -> Path:
    """A venv at ``root`` whose site-packages hold exactly ``distributions`` (as installed here) and
    this checkout's hybridfleet; returns its python."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    site = root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for name in sorted(distributions):
        dist = importlib.metadata.distribution(name)
        for entry in dist.files or []:
            if entry.parts[0] == "..":
                continue  # scripts outside site-packages
            target = site / entry
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(Path(dist.locate_file(entry)).resolve(), target)
    (site / "hybridfleet-project.pth").write_text(f"{REPO / 'src'}\n")  # COPY . + pip install /workspace
    return root / "bin" / "python"


@pytest.mark.slow
@pytest.mark.parametrize("example", [pytest.param(e, marks=getattr(pytest.mark, f)) for e, f in sorted(EXAMPLES.items())])
def test_rendered_image_holds_every_distribution_the_job_imports(tmp_path, example):
    framework = EXAMPLES[example]
    # Prepare: the example job with absolute paths, rendered against this machine's installed lock
    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(example_job(example)))
    spec = load_spec(job)
    rendered = render_request(image_request(str(job), None, None, None, None, None))
    installed = {_name(r) for r in rendered.requirements} | {FRAMEWORK_DIST[framework]}  # the base image's framework
    installed |= {name for name, why in rendered.left_out.items() if why == "the base image provides it"}
    assert {"filelock", "sympy", "networkx", "jinja2"} <= installed if framework == "torch" else True
    assert "matplotlib" in installed and "httpx" in installed  # the report; the registry client
    python = venv_of(tmp_path / "image", installed)
    scripts = {Path(spec.site_entrypoint(s)) for s in spec.sites}
    modules = sorted({m for s in scripts for m in imported_modules(s)} | set(RUN_MODULES))
    # Execute: a fresh interpreter of the venv imports each module (no user site, no PYTHONPATH)
    code = ("import importlib, sys\nbad = []\nfor m in sys.argv[1:]:\n    try:\n        importlib.import_module(m)\n"
            "    except Exception as err:\n        bad.append(f'{m}: {type(err).__name__}: {err}')\nprint('\\n'.join(bad))\n"
            "sys.exit(1 if bad else 0)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    done = subprocess.run([str(python), "-c", code, *modules], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    # Assert
    assert done.returncode == 0, f"imports failing in the image of {example}:\n{done.stdout}{done.stderr[-2000:]}"
