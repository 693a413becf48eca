"""The examples bench/zoo.py measures, and the glue between each one and the collective runner.

Everything that knows a workload's model, data, loss and metric sits in this file, so a
workload whose module names or functions change is adapted here only. Each workload is
an example folder (``examples/<name>/``) with ``train_torch.py`` / ``train_paddle.py``
(the PS three lines), a ``pack_sites.py`` that packs its site datasets, a model module and
a data module; `Workload.missing` names whatever of that is absent, and bench/zoo.py
reports such a workload as a skipped row instead of failing.

The collective runner (bench/_zoo_ddp.py) trains the SAME model, optimizer, data, batch
per worker and seeds as the example's script, wrapped in DDP / paddle.DataParallel:
`Workload.build` gives it the model and optimizer, `load_train` / `load_test` the rows,
`batch_loss` one step's loss and `evaluate` the metric the script reports.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("torch", "paddle")


@dataclass(frozen=True)
class Workload:
    """One example: where its files are, the metric its scripts report and how good is good enough."""

    name: str
    model_module: str
    data_module: str
    metric: str
    higher_is_better: bool
    target: float          # the metric value "time to target" waits for (full run)
    quick_target: float    # the same for --quick
    batch_size: int
    steps: int
    eval_every: int
    script_args: tuple[str, ...] = ()
    jobs: dict[str, str] = field(default_factory=dict)  # framework -> job file under examples/

    @property
    def folder(self) -> Path:
        return REPO / "examples" / self.name

    def script(self, framework: str) -> Path:
        return self.folder / f"train_{framework}.py"

    def job(self, framework: str) -> Path:
        return REPO / "examples" / self.jobs[framework]

    @property
    def glue_ready(self) -> bool:
        """Whether the collective runner knows this workload's model, optimizer, loss and metric (GLUE)."""
        return all(fn is not _glue_missing for fn in GLUE[self.name].values())

    def missing(self, framework: str) -> list[str]:
        """Files this workload needs for ``framework`` that are not in this checkout (repository-relative)."""
        needed = [self.script(framework), self.job(framework), self.folder / "pack_sites.py",
                  self.folder / f"{self.model_module}.py", self.folder / f"{self.data_module}.py"]
        return [str(p.relative_to(REPO)) for p in needed if not p.exists()]

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target

    def gap(self, joint: float, alone: float) -> float:
        """How much worse ``joint`` is than ``alone``, relative to ``alone`` (negative: joint is better)."""
        worse = alone - joint if self.higher_is_better else joint - alone
        return worse / abs(alone) if alone else float("inf")

    def modules(self) -> tuple[Any, Any]:
        """The example's model and data modules (its folder goes on sys.path, as when its script runs)."""
        if str(self.folder) not in sys.path:
            sys.path.insert(0, str(self.folder))
        return importlib.import_module(self.model_module), importlib.import_module(self.data_module)

    # -- the collective runner's glue: the example's own training step, per framework ---------------------

    def build(self, framework: str) -> tuple[Any, Any]:
        """The script's model (seeded 0, as every worker) and its optimizer."""
        model_mod, _ = self.modules()
        return GLUE[self.name]["build"](framework, model_mod)

    def load_train(self, data: str, shard: int, num_shards: int) -> tuple[Any, Any]:
        """This rank's 1/num_shards of the training rows of ``data`` (a packed dataset), as numpy arrays."""
        _, data_mod = self.modules()
        return GLUE[self.name]["load_train"](data_mod, data, shard, num_shards)

    def load_test(self) -> tuple[Any, Any]:
        _, data_mod = self.modules()
        return GLUE[self.name]["load_test"](data_mod)

    def batch_loss(self, framework: str, model: Any, x: Any, y: Any, batch: Any) -> Any:
        return GLUE[self.name]["batch_loss"](framework, model, x, y, batch)

    def evaluate(self, framework: str, model: Any, x_test: Any, y_test: Any) -> float:
        return GLUE[self.name]["evaluate"](framework, model, x_test, y_test)


# -- classification glue (digits; fashion uses the same loss and metric) ---------------------------------

def _cross_entropy(framework: str, model: Any, x: Any, y: Any, batch: Any) -> Any:
    if framework == "torch":
        import torch
        import torch.nn.functional as F

        idx = torch.from_numpy(batch)
        return F.cross_entropy(model(x[idx]), y[idx])
    import paddle
    import paddle.nn.functional as F

    idx = paddle.to_tensor(batch)
    return F.cross_entropy(model(paddle.gather(x, idx)), paddle.gather(y, idx))


def _accuracy(framework: str, model: Any, x_test: Any, y_test: Any) -> float:
    if framework == "torch":
        import torch

        model.eval()
        with torch.no_grad():
            value = (model(x_test).argmax(1) == y_test).float().mean().item()
        model.train()
        return value
    import paddle

    model.eval()
    with paddle.no_grad():
        value = float((model(x_test).argmax(1) == y_test).astype("float32").mean())
    model.train()
    return value


def to_tensors(framework: str, *arrays: Any) -> tuple[Any, ...]:
    if framework == "torch":
        import torch

        return tuple(torch.from_numpy(a) for a in arrays)
    import paddle

    return tuple(paddle.to_tensor(a) for a in arrays)


def _digits_build(framework: str, model_mod: Any) -> tuple[Any, Any]:
    # train_torch.py / train_paddle.py: seed 0, build_<framework>("128"), Adam lr 0.003
    if framework == "torch":
        import torch

        torch.manual_seed(0)
        model = model_mod.build_torch("128")
        return model, torch.optim.Adam(model.parameters(), lr=0.003)
    import paddle

    paddle.seed(0)
    model = model_mod.build_paddle("128")
    return model, paddle.optimizer.Adam(learning_rate=0.003, parameters=model.parameters())


def _site_rows(data_mod: Any, data: str, shard: int, num_shards: int) -> tuple[Any, Any]:
    return data_mod.load_site(data, shard, num_shards)


def _test_rows(data_mod: Any) -> tuple[Any, Any]:
    return data_mod.load_test()


def _glue_missing(*_: Any) -> Any:
    raise NotImplementedError("this workload's collective glue is not written yet: see GLUE in bench/_zoo_workloads.py")


GLUE: dict[str, dict[str, Any]] = {
    "digits": {"build": _digits_build, "load_train": _site_rows, "load_test": _test_rows,
               "batch_loss": _cross_entropy, "evaluate": _accuracy},
    # fashion: a classifier like digits; "build" must give the script's CNN and its SGD + momentum + schedule
    "fashion": {"build": _glue_missing, "load_train": _site_rows, "load_test": _test_rows,
                "batch_loss": _cross_entropy, "evaluate": _accuracy},
    # charlm: the transformer and its AdamW groups, a window batch, bits per character on the held-out package
    "charlm": {"build": _glue_missing, "load_train": _site_rows, "load_test": _test_rows,
               "batch_loss": _glue_missing, "evaluate": _glue_missing},
}

WORKLOADS: dict[str, Workload] = {
    w.name: w for w in (
        Workload("digits", "digits_model", "digits_data", "test_accuracy", True, target=0.95, quick_target=0.5,
                 batch_size=32, steps=300, eval_every=25,
                 jobs={"torch": "digits-hybrid.yaml", "paddle": "digits-hybrid-paddle.yaml"}),
        Workload("fashion", "fashion_model", "fashion_data", "test_accuracy", True, target=0.90, quick_target=0.5,
                 batch_size=64, steps=2000, eval_every=100,
                 jobs={"torch": "fashion-hybrid.yaml", "paddle": "fashion-hybrid-paddle.yaml"}),
        Workload("charlm", "charlm_model", "charlm_data", "test_bpc", False, target=2.0, quick_target=4.0,
                 batch_size=32, steps=2000, eval_every=100,
                 jobs={"torch": "charlm-hybrid.yaml", "paddle": "charlm-hybrid-paddle.yaml"}),
    )
}
