"""The examples bench/zoo.py measures, and the glue between each one and the collective runner.

Everything that knows a workload's model, data, loss and metric sits in this file, so a
workload whose module names or functions change is adapted here only. Each workload is
an example folder (``examples/<name>/``) with ``train_torch.py`` / ``train_paddle.py``
(the PS three lines), a ``pack_sites.py`` that packs its site datasets, a model module and
a data module; `Workload.missing` names whatever of that is absent, and bench/zoo.py
reports such a workload as a skipped row instead of failing.

The collective runner (bench/_zoo_ddp.py) trains the SAME model, optimizer, schedule, data,
batch per worker and seeds as the example's script, wrapped in DDP / paddle.DataParallel.
`Workload.prepare` parses the script's own arguments (the job's ``args:``) into a `Run`;
with it `Workload.build` gives the model, the optimizer and the per-step schedule,
`load_train` / `load_test` the rows, `batch_loss` one step's loss on the batch the script
draws, and `evaluate` the metric the script reports. The glue calls the example's own
functions (model builders, data loaders, optimizer and schedule recipes, batch sampler);
what it writes itself is only what the scripts do inline (a flip, a chunked evaluation).
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from hybridfleet.obs import metric_direction

REPO = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("torch", "paddle")


@dataclass(frozen=True)
class Run:
    """What every glue function is given: the framework, the script's parsed options, the run's steps
    and the example's model and data modules."""

    framework: str
    options: argparse.Namespace
    steps: int
    model_mod: Any
    data_mod: Any


@dataclass(frozen=True)
class Workload:
    """One example: where its files are, the metric its scripts report and how good is good enough."""

    name: str
    model_module: str
    data_module: str
    metric: str            # its name says which way is better (`hybridfleet.obs.metric_direction`)
    target: float          # the metric value "time to target" waits for (full run)
    quick_target: float    # the same for --quick
    batch_size: int
    steps: int
    eval_every: int
    script_args: tuple[str, ...] = ()  # after the job's ``args:``, in every mode (the last of a flag wins)
    jobs: dict[str, str] = field(default_factory=dict)  # framework -> job file under examples/

    @property
    def folder(self) -> Path:
        return REPO / "examples" / self.name

    def script(self, framework: str) -> Path:
        return self.folder / f"train_{framework}.py"

    def job(self, framework: str) -> Path:
        return REPO / "examples" / self.jobs[framework]

    def args(self, framework: str) -> list[str]:
        """The script's arguments in every mode: the example job's ``args:``, then `script_args`."""
        job = yaml.safe_load(self.job(framework).read_text())
        return [str(a) for a in job.get("args") or []] + list(self.script_args)

    @property
    def glue_ready(self) -> bool:
        """Whether the collective runner knows this workload's model, optimizer, loss and metric (GLUE)."""
        return all(fn is not _glue_missing for fn in GLUE[self.name].values())

    def missing(self, framework: str) -> list[str]:
        """Files this workload needs for ``framework`` that are not in this checkout (repository-relative)."""
        needed = [self.script(framework), self.job(framework), self.folder / "pack_sites.py",
                  self.folder / f"{self.model_module}.py", self.folder / f"{self.data_module}.py"]
        return [str(p.relative_to(REPO)) for p in needed if not p.exists()]

    @property
    def higher_is_better(self) -> bool:
        return metric_direction.higher_is_better(self.metric)

    def reached(self, value: float, target: float) -> bool:
        """Whether a metric value meets the target in this workload's direction."""
        return metric_direction.reached(self.metric, value, target)

    def gap(self, joint: float, alone: float) -> float:
        """How much worse ``joint`` is than ``alone``, relative to ``alone`` (negative: joint is better)."""
        worse = metric_direction.worse_by(self.metric, alone, joint)
        return worse / abs(alone) if alone else float("inf")

    def modules(self) -> tuple[Any, Any]:
        """The example's model and data modules (its folder goes on sys.path, as when its script runs)."""
        if str(self.folder) not in sys.path:
            sys.path.insert(0, str(self.folder))
        return importlib.import_module(self.model_module), importlib.import_module(self.data_module)

    # -- the collective runner's glue: the example's own training step, per framework ---------------------

    def prepare(self, framework: str, steps: int, argv: list[str]) -> Run:
        """A `Run` of ``steps`` steps with the script's options parsed from ``argv`` by the script's own parser."""
        model_mod, data_mod = self.modules()
        return Run(framework, GLUE[self.name]["options"](list(argv)), steps, model_mod, data_mod)

    def build(self, run: Run) -> tuple[Any, Any, Callable[[], None] | None]:
        """The script's model (seeded as every worker), its optimizer and its schedule's per-step call
        (None where the script keeps a constant rate), the schedule spanning ``run.steps``."""
        return GLUE[self.name]["build"](run)

    def load_train(self, run: Run, data: str, shard: int, num_shards: int) -> Any:
        """This rank's 1/num_shards of the training rows of ``data`` (a packed dataset), as the script holds them."""
        return GLUE[self.name]["load_train"](run, data, shard, num_shards)

    def load_test(self, run: Run) -> Any:
        """The test set the script evaluates on, as the script holds it."""
        return GLUE[self.name]["load_test"](run)

    def batch_loss(self, run: Run, model: Any, train: Any, rng: np.random.Generator, batch_size: int) -> Any:
        """The loss of one step on the batch the script draws from ``rng`` (same draws, same order)."""
        return GLUE[self.name]["batch_loss"](run, model, train, rng, batch_size)

    def evaluate(self, run: Run, model: Any, test: Any) -> float:
        """The metric the script reports, computed as the script computes it."""
        return GLUE[self.name]["evaluate"](run, model, test)


# -- digits: the script's default MLP and Adam, no schedule --------------------------------------------

def _digits_options(argv: list[str]) -> argparse.Namespace:
    if argv:
        raise ValueError(f"the digits glue builds the script's default model (--hidden 128, Adam lr 0.003); "
                         f"script arguments are not supported (got {' '.join(argv)})")
    return argparse.Namespace()


def _digits_build(run: Run) -> tuple[Any, Any, None]:
    # train_torch.py / train_paddle.py: seed 0, build_<framework>("128"), Adam lr 0.003
    if run.framework == "torch":
        import torch

        torch.manual_seed(0)
        model = run.model_mod.build_torch("128")
        return model, torch.optim.Adam(model.parameters(), lr=0.003), None
    import paddle

    paddle.seed(0)
    model = run.model_mod.build_paddle("128")
    return model, paddle.optimizer.Adam(learning_rate=0.003, parameters=model.parameters()), None


def _tensors(framework: str, *arrays: np.ndarray) -> tuple[Any, ...]:
    if framework == "torch":
        import torch

        return tuple(torch.from_numpy(a) for a in arrays)
    import paddle

    return tuple(paddle.to_tensor(a) for a in arrays)


def _digits_train(run: Run, data: str, shard: int, num_shards: int) -> tuple[Any, Any]:
    return _tensors(run.framework, *run.data_mod.load_site(data, shard, num_shards))


def _digits_test(run: Run) -> tuple[Any, Any]:
    return _tensors(run.framework, *run.data_mod.load_test())


def _digits_loss(run: Run, model: Any, train: tuple[Any, Any], rng: np.random.Generator, batch_size: int) -> Any:
    x, y = train
    batch = rng.integers(0, len(x), batch_size)
    if run.framework == "torch":
        import torch
        import torch.nn.functional as F

        idx = torch.from_numpy(batch)
        return F.cross_entropy(model(x[idx]), y[idx])
    import paddle
    import paddle.nn.functional as F

    idx = paddle.to_tensor(batch)
    return F.cross_entropy(model(paddle.gather(x, idx)), paddle.gather(y, idx))


def _digits_accuracy(run: Run, model: Any, test: tuple[Any, Any]) -> float:
    x_test, y_test = test
    if run.framework == "torch":
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


def _import(name: str) -> Any:
    return importlib.import_module(name)  # an example module; its folder is on sys.path (Workload.modules)


# -- fashion: the script's ResNet, SGD + momentum + weight decay, cosine over the run's steps ------------

EVAL_CHUNK = 1000  # test images per forward pass, as the fashion scripts evaluate


def _fashion_options(argv: list[str]) -> argparse.Namespace:
    return _import("fashion_model").train_args(argv)


def _fashion_build(run: Run) -> tuple[Any, Any, Callable[[], None]]:
    # train_<framework>.py: seed 0, build_<framework>(width), SGD/Momentum, cosine over train.steps, stepped per step
    o = run.options
    if run.framework == "torch":
        import torch

        torch.manual_seed(0)
        model = run.model_mod.build_torch(o.width)
        optimizer = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=run.steps)
        return model, optimizer, scheduler.step
    import paddle

    paddle.seed(0)
    model = run.model_mod.build_paddle(o.width)
    optimizer = paddle.optimizer.Momentum(learning_rate=o.lr, momentum=o.momentum, parameters=model.parameters(),
                                          weight_decay=o.weight_decay)
    scheduler = paddle.optimizer.lr.CosineAnnealingDecay(o.lr, T_max=run.steps)
    optimizer.set_lr_scheduler(scheduler)
    return model, optimizer, scheduler.step


def _fashion_train(run: Run, data: str, shard: int, num_shards: int) -> tuple[Any, Any]:
    x, y = run.data_mod.load_site(data, shard, num_shards)
    return _tensors("torch", x, y) if run.framework == "torch" else (x, y)  # paddle's script keeps numpy rows


def _fashion_test(run: Run) -> tuple[Any, Any]:
    return _tensors(run.framework, *run.data_mod.load_test(run.options.test_rows))


def _fashion_loss(run: Run, model: Any, train: tuple[Any, Any], rng: np.random.Generator, batch_size: int) -> Any:
    # the scripts' step: a batch of rows, then a random horizontal flip of each image (the same two draws)
    x, y = train
    batch = rng.integers(0, len(x), batch_size)
    flip = rng.random(len(batch)) < 0.5
    if run.framework == "torch":
        import torch
        import torch.nn.functional as F

        idx, flip_t = torch.from_numpy(batch), torch.from_numpy(flip)
        images = x[idx]
        images = torch.where(flip_t[:, None, None, None], images.flip(3), images)
        return F.cross_entropy(model(images), y[idx])
    import paddle
    import paddle.nn.functional as F

    images = np.where(flip[:, None, None, None], x[batch][..., ::-1], x[batch])
    return F.cross_entropy(model(paddle.to_tensor(images)), paddle.to_tensor(y[batch]))


def _fashion_accuracy(run: Run, model: Any, test: tuple[Any, Any]) -> float:
    x_test, y_test = test
    n = len(y_test)
    model.eval()  # BatchNorm's running statistics
    if run.framework == "torch":
        import torch

        with torch.no_grad():
            correct = sum((model(xb).argmax(1) == yb).sum().item()
                          for xb, yb in zip(x_test.split(EVAL_CHUNK), y_test.split(EVAL_CHUNK)))
    else:
        import paddle

        with paddle.no_grad():
            correct = sum(int((model(x_test[i:i + EVAL_CHUNK]).argmax(1) == y_test[i:i + EVAL_CHUNK])
                              .astype("int64").sum()) for i in range(0, n, EVAL_CHUNK))
    model.train()
    return correct / n


# -- charlm: the transformer, AdamW groups, warmup + cosine, sample_batch, bits per character -------------

BPC_CHUNK = 64  # held-out windows per forward pass, as the charlm scripts evaluate


def _charlm_options(argv: list[str]) -> argparse.Namespace:
    return _import("charlm_args").parse_args(argv)


def _charlm_build(run: Run) -> tuple[Any, Any, Callable[[], None]]:
    # train_<framework>.py: build_<framework>(layers, d_model, context, heads), charlm_optim's AdamW and schedule
    o, optim = run.options, _import("charlm_optim")
    if run.framework == "torch":
        model = run.model_mod.build_torch(o.layers, o.d_model, o.context, o.heads)
        optimizer = optim.torch_optimizer(model, o.lr, o.weight_decay)
        schedule = optim.torch_schedule(optimizer, run.steps, o.warmup_steps, o.min_lr_ratio)
        return model, optimizer, schedule.step
    model = run.model_mod.build_paddle(o.layers, o.d_model, o.context, o.heads)
    optimizer = optim.paddle_optimizer(model, o.lr, o.weight_decay)
    schedule = optim.paddle_schedule(o.lr, run.steps, o.warmup_steps, o.min_lr_ratio)
    optimizer.set_lr_scheduler(schedule)
    return model, optimizer, schedule.step


def _charlm_train(run: Run, data: str, shard: int, num_shards: int) -> np.ndarray:
    return run.data_mod.load_site(data, shard, num_shards)  # uint8 windows: sample_batch crops them


def _charlm_test(run: Run) -> Any:
    (test,) = _tensors(run.framework, run.data_mod.load_test(run.options.context, run.options.test_bytes)
                       .astype(np.int64))
    return test


def _charlm_nats(framework: str, model: Any, windows: Any, reduction: str) -> Any:
    """Cross-entropy of the next byte at every position of ``windows`` ([batch, context + 1] int64)."""
    logits = model(windows[:, :-1])
    if framework == "torch":
        import torch.nn.functional as F

        return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction=reduction)
    import paddle.nn.functional as F

    return F.cross_entropy(logits.reshape([-1, 256]), windows[:, 1:].reshape([-1]), reduction=reduction)


def _charlm_loss(run: Run, model: Any, rows: np.ndarray, rng: np.random.Generator, batch_size: int) -> Any:
    (batch,) = _tensors(run.framework, run.data_mod.sample_batch(rows, batch_size, run.options.context, rng))
    return _charlm_nats(run.framework, model, batch, "mean")


def _charlm_bpc(run: Run, model: Any, test: Any) -> float:
    # the scripts' bits_per_char: summed nats over every held-out position, chunk by chunk, / positions / ln 2
    if run.framework == "torch":
        import torch

        with torch.no_grad():
            nats = sum(_charlm_nats("torch", model, w, "sum").item() for w in test.split(BPC_CHUNK))
    else:
        import paddle

        with paddle.no_grad():
            nats = sum(float(_charlm_nats("paddle", model, test[i:i + BPC_CHUNK], "sum"))
                       for i in range(0, test.shape[0], BPC_CHUNK))
    return nats / (test.shape[0] * (test.shape[1] - 1)) / math.log(2)


def _glue_missing(*_: Any) -> Any:
    raise NotImplementedError("this workload's collective glue is not written yet: see GLUE in bench/_zoo_workloads.py")


GLUE: dict[str, dict[str, Callable[..., Any]]] = {
    "digits": {"options": _digits_options, "build": _digits_build, "load_train": _digits_train,
               "load_test": _digits_test, "batch_loss": _digits_loss, "evaluate": _digits_accuracy},
    "fashion": {"options": _fashion_options, "build": _fashion_build, "load_train": _fashion_train,
                "load_test": _fashion_test, "batch_loss": _fashion_loss, "evaluate": _fashion_accuracy},
    "charlm": {"options": _charlm_options, "build": _charlm_build, "load_train": _charlm_train,
               "load_test": _charlm_test, "batch_loss": _charlm_loss, "evaluate": _charlm_bpc},
}

WORKLOADS: dict[str, Workload] = {
    w.name: w for w in (
        Workload("digits", "digits_model", "digits_data", "test_accuracy", target=0.95, quick_target=0.5,
                 batch_size=32, steps=300, eval_every=25,
                 jobs={"torch": "digits-hybrid.yaml", "paddle": "digits-hybrid-paddle.yaml"}),
        Workload("fashion", "fashion_model", "fashion_data", "test_accuracy", target=0.90, quick_target=0.5,
                 batch_size=64, steps=2000, eval_every=100,
                 jobs={"torch": "fashion-hybrid.yaml", "paddle": "fashion-hybrid-paddle.yaml"}),
        Workload("charlm", "charlm_model", "charlm_data", "test_bpc", target=2.0, quick_target=4.0,
                 batch_size=32, steps=2000, eval_every=100,
                 jobs={"torch": "charlm-hybrid.yaml", "paddle": "charlm-hybrid-paddle.yaml"}),
    )
}
