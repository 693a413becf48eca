"""The workloads of ``bench/wan.py``: what each trains, what it measures, and how its jobs are built.

* ``digits``: the digits job of ``compression.py`` (2048,512 MLP, 1.19M parameters), test accuracy.
* ``fashion``: ``examples/fashion/train_{torch,paddle}.py`` on the packed Fashion-MNIST sites, the job of
  ``examples/fashion-hybrid[-paddle].yaml``, test accuracy (higher is better).
* ``charlm``: ``examples/charlm/train_{torch,paddle}.py`` on the packed standard-library sites, the job of
  ``examples/charlm-hybrid[-paddle].yaml``, held-out bits per character ``test_bpc`` (lower is better).

An example job's first site is the one behind the capped link, its second the cloud site that
initialises the shards; the bench keeps the job's script, arguments, training settings and BSP
optimizer and sets what each variant varies (sync mode, codec, site aggregation, the link).
Site datasets missing under the paths the job names are written first with the workload's
``pack_sites.py --out DIR`` (DIR: the folder holding the job's site datasets).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from hybridfleet.obs import metric_direction

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Workload:
    """One workload: its scripts and job files per framework, its metric and default sizes."""

    name: str
    scripts: dict[str, str]  # framework -> training script, relative to the repository
    jobs: dict[str, str]  # framework -> job file ("" for digits, built by compression.digits_job)
    pack: str  # the pack script ("" when the job's data needs none)
    metric: str  # its name says which way is better (`hybridfleet.obs.metric_direction`)
    target: float
    quick_target: float
    steps: int | None  # None: the job file's own train.steps
    quick_steps: int

    @property
    def higher_is_better(self) -> bool:
        return metric_direction.higher_is_better(self.metric)

    def reached(self, value: float | None, target: float) -> bool:
        """Whether a metric value meets the target in this workload's direction."""
        return metric_direction.reached(self.metric, value, target)

    def worse_by(self, anchor: float, other: float) -> float:
        """How much worse `other` is than `anchor` (positive: worse), in the metric's direction."""
        return metric_direction.worse_by(self.metric, anchor, other)


WORKLOADS = {
    "digits": Workload("digits", {"torch": "examples/digits/train_torch.py", "paddle": "examples/digits/train_paddle.py"},
                       {"torch": "", "paddle": ""}, "", "test_accuracy", 0.93, 0.85, 150, 60),
    "fashion": Workload("fashion", {"torch": "examples/fashion/train_torch.py",
                                    "paddle": "examples/fashion/train_paddle.py"},
                        {"torch": "examples/fashion-hybrid.yaml", "paddle": "examples/fashion-hybrid-paddle.yaml"},
                        "examples/fashion/pack_sites.py", "test_accuracy", 0.90, 0.75, None, 60),
    "charlm": Workload("charlm", {"torch": "examples/charlm/train_torch.py", "paddle": "examples/charlm/train_paddle.py"},
                       {"torch": "examples/charlm-hybrid.yaml", "paddle": "examples/charlm-hybrid-paddle.yaml"},
                       "examples/charlm/pack_sites.py", "test_bpc", 2.0, 3.5, None, 60),
}


def missing_files(workload: Workload, framework: str, root: Path = REPO) -> list[str]:
    """The files `workload` needs for `framework` that are not under `root` (relative paths)."""
    wanted = [workload.scripts[framework], workload.jobs[framework], workload.pack]
    return [path for path in wanted if path and not (root / path).is_file()]


def example_job(workload: Workload, framework: str, root: Path = REPO) -> dict:
    """The workload's job file as a dict (ValueError naming the file unless it has exactly two sites)."""
    path = root / workload.jobs[framework]
    job = yaml.safe_load(path.read_text())
    if not isinstance(job, dict) or not isinstance(job.get("sites"), dict) or len(job["sites"]) != 2:
        raise ValueError(f"{path}: the WAN bench needs a job with exactly two sites")
    return job


def site_names(job: dict) -> tuple[str, str]:
    """(capped site, cloud site) of a two-site example job: its first and second site."""
    capped, cloud = list(job["sites"])
    return capped, cloud


def ensure_packed(job: dict, workload: Workload, root: Path = REPO) -> None:
    """Write the job's site datasets with the workload's pack script when any is missing
    (RuntimeError with the script's output when it fails or leaves one missing)."""
    paths = [root / site["data"] for site in job["sites"].values() if isinstance(site.get("data"), str)]
    missing = [p for p in paths if not p.exists()]
    if not missing:
        return
    out = missing[0].parent
    proc = subprocess.run([sys.executable, str(root / workload.pack), "--out", str(out)], cwd=root,
                          capture_output=True, text=True)
    still = [str(p) for p in paths if not p.exists()]
    if proc.returncode != 0 or still:
        raise RuntimeError(f"{workload.pack} --out {out} exited {proc.returncode}"
                           f"{'; still missing: ' + ', '.join(still) if still else ''}: {proc.stderr[-1000:]}")


def variant_from_example(job: dict, name: str, *, compression: dict, aggregate: bool, local_steps: int | None,
                         eval_every_steps: int, steps: int | None, host: str, netns: str | None,
                         root: Path = REPO, outer_optimizer: dict | None = None) -> dict:
    """A copy of the example `job` set up as one WAN bench variant.

    Kept: entrypoint, args, train settings, shards, BSP optimizer. Set: the sync mode (``local`` with
    `outer_optimizer` as the shards' outer step when `local_steps` is given; DiLoCo's when None), codec, site aggregation on both sites, the
    capped site's namespace, the cloud site as the shards' initialiser, the shards' host. Dropped:
    checkpoint, registry and baseline settings (a bench run publishes nothing).
    """
    capped, cloud = site_names(job)
    sites = {}
    for site, conf in job["sites"].items():
        conf = dict(conf)
        if isinstance(conf.get("data"), str):
            conf["data"] = str(root / conf["data"])
        conf["aggregate"] = aggregate
        conf.pop("netns", None)
        if site == capped and netns:
            conf["netns"] = netns
        sites[site] = conf
    ps = {k: v for k, v in (job.get("ps") or {}).items() if k not in ("sync", "local_steps", "compression")}
    if local_steps is not None:
        ps.pop("optimizer", None)  # the BSP optimizer is not the outer one
        if outer_optimizer is not None:
            ps["optimizer"] = dict(outer_optimizer)
        ps.update(sync="local", local_steps=local_steps)
    else:
        ps["sync"] = "bsp"
    ps.update(compression=compression, host=host, init_site=cloud, heartbeat_interval_s=0.5, heartbeat_timeout_s=30)
    train = dict(job.get("train") or {})
    train.update(eval_every_steps=eval_every_steps, site_baselines=False)
    if steps is not None:
        train["steps"] = steps
    out = {k: v for k, v in job.items() if k not in ("checkpoint", "registry", "max_restarts")}
    out.update(name=name, mode="ps", entrypoint=str(root / job["entrypoint"]), sites=sites, ps=ps, train=train)
    return out
