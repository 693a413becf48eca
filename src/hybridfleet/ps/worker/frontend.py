"""The user-facing handle shared by the torch and paddle adapters.

A training script adds three lines::

    import hybridfleet.torch as hf        # or hybridfleet.paddle
    ps = hf.connect(model)                # joins the job, loads the job's current parameters
    ...; loss.backward(); ps.step()       # replaces optimizer.step(): push gradients, pull parameters

In ``ps.sync: bsp | ssp | asp`` the shards apply the script's optimizer given as
``hf.connect(model, optimizer)``: its class, parameter groups, every hyperparameter and,
read at every step, each group's current learning rate (so any scheduler works); see
`hybridfleet.ps.worker.optim_spec` and `hybridfleet.ps.server.groups`. A parameter
without a gradient this step is not pushed and not stepped; a parameter frozen at
connect is still part of the job, so unfreezing it later trains it from the job's value.
An explicit ``ps.optimizer`` in the job file overrides the script's optimizer (logged as
``script_optimizer_overridden``); so does a job mixing frameworks. Without an optimizer
here the shards apply ``ps.optimizer``.

With ``ps.sync: local`` the script's own optimizer is the inner optimizer:
``ps = hf.connect(model, optimizer)``; ``ps.step()`` then steps it and, every
``ps.local_steps`` steps, exchanges the pseudo-gradient for the new global parameters
(see `hybridfleet.ps.worker.local`).

An embedding built with ``sparse=True`` trains with the optimizers whose sparse update is
their dense one; its gradient is read as the dense one and, under codec ``none``, pushed as
its touched rows (`hybridfleet.ps.worker.sparse_grads`, `hybridfleet.codec.rows`).

Buffers (BatchNorm statistics, counters) follow ``ps.buffers`` (`hybridfleet.ps.worker.buffers`):
averaged over the round's workers by default, so the job's model is one model.

Subclasses only say how to list parameters, read gradients and assign values.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from hybridfleet.ckpt.run_model import MODEL_DIR_ENV
from hybridfleet.ckpt.site_buffers import save_site_buffers
from hybridfleet.codec.base import all_finite
from hybridfleet.errors import SpecError
from hybridfleet.obs.log import get_logger
from hybridfleet.ps.worker import sparse_grads
from hybridfleet.ps.worker.buffers import BufferSync
from hybridfleet.ps.worker.buffers import split as split_buffers
from hybridfleet.ps.worker.canonical import CanonicalLayout
from hybridfleet.ps.worker.overlap import GradientStage, overlap_blocker
from hybridfleet.ps.worker.session import PSSession, WorkerConfig

log = get_logger("ps.worker")


@functools.cache  # once per process
def quick_interpreter_exit() -> None:
    """Once a worker has left, its interpreter's exit skips the final cyclic collection (``gc.freeze``
    from an atexit hook): with torch or paddle loaded that collection walks millions of objects for
    a second or more per process, and Python promises no finalizer for objects alive at exit anyway."""
    atexit.register(gc.freeze)


class ParameterServerHandle(ABC):
    """Binds a model to a `PSSession`; the same API in every framework."""

    framework: str = ""

    def __init__(self, model: Any, config: WorkerConfig | None = None, optimizer: Any = None):
        self.model = model
        self.optimizer = optimizer
        self.config = config or WorkerConfig.from_env()
        self.rounds = None  # LocalRounds in ps.sync: local
        self._steps_past = 0  # steps taken past the job's last round (see _past_the_last_round)
        if self.config.job.ps.sync == "local" and optimizer is None:
            raise ValueError("ps.sync: local trains with the script's own optimizer as the inner optimizer: "
                             "pass it, ps = hf.connect(model, optimizer)")
        job, site = self.config.job, self.config.site
        declared = job.sites[site].framework
        if declared and declared != self.framework:
            raise SpecError(f"sites.{site}.framework: the site declares {declared}, this script trains with "
                            f"{self.framework}; fix the job file or run the site's {declared} script")
        if not declared and job.framework != self.framework:
            raise SpecError(f"framework: site {site} trains with the job's framework, {job.framework}; this script "
                            f"trains with {self.framework}; run the {job.framework} script, or set "
                            f"sites.{site}.framework: {self.framework} with its own entrypoint")
        params = self._named_parameters()
        # an embedding built with sparse=True: its gradient is read as the dense one (see sparse_grads.py);
        # refused before joining where the shards' dense update would differ from the plain script's
        self.sparse = self._sparse_gradient_parameters()
        if self._script_optimizer_applies(optimizer):
            sparse_grads.refusal(self.framework, optimizer, self.sparse, params)
        self.reader = self._optimizer_reader(optimizer, params)  # refuses an optimizer we cannot run, before joining
        # a worker of another framework than the job's maps to the job's names and layouts (see canonical.py)
        self.layout = CanonicalLayout.for_model(model, list(params), self.framework, job.framework, site)
        shapes = {k: tuple(p.shape) for k, p in params.items()}
        shapes = self.layout.shapes(shapes) if self.layout else shapes
        self.buffers, initial = self._buffer_sync()
        if self.buffers is not None:
            shapes.update(self.buffers.wire_shapes())
        self.session = PSSession(shapes, self.config, self.framework)
        self.session.row_sparse = set(self.sparse) if self.layout is None else set()
        self._samples = 0  # counted by _count_samples in training-mode forward passes since the last step
        self.model.register_forward_pre_hook(self._count_samples)
        self._load(self.session.start({**self._canonical({k: self._to_numpy(p) for k, p in params.items()}),
                                       **initial}))
        if self.config.job.ps.sync == "local":
            from hybridfleet.ps.worker.local import InnerState, LocalRounds

            self.rounds = LocalRounds(self.session, optimizer,
                                      InnerState.from_env(self.framework))
        # The job's model is saved by global rank 0 from the parameters it pulled, which in
        # BSP are bit-identical on every worker (see summary.json's params_sha256). Periodic and
        # best saves are written in the background, so a step does not wait for the disk.
        self._model_ckpt = None
        self._site_buffers_saved = False
        self.stage = self._start_stage()
        if self.config.rank == 0 and not self.session.local:
            from hybridfleet.ckpt.run_model import ModelCheckpointer

            self._model_ckpt = ModelCheckpointer.from_env(self.config.job, self.framework, background=True)

    def _sparse_gradient_parameters(self) -> dict[str, str]:
        """parameter name -> the layer that makes its gradient sparse (none by default)."""
        return {}

    def _script_optimizer_applies(self, optimizer: Any) -> bool:
        """Whether the shards would apply the script's optimizer (not ps.optimizer, not ps.sync: local)."""
        job = self.config.job
        mixed = any(site.framework and site.framework != job.framework for site in job.sites.values())
        return (optimizer is not None and job.ps.sync != "local" and "optimizer" not in job.ps.model_fields_set
                and not mixed)

    def _optimizer_reader(self, optimizer: Any, params: dict[str, Any]):
        """The reader of the script's optimizer when the shards apply it (None: ps.optimizer applies)."""
        job = self.config.job
        if optimizer is None or job.ps.sync == "local":
            return None
        if "optimizer" in job.ps.model_fields_set:
            log.info("script_optimizer_overridden", optimizer=job.ps.optimizer.name,
                     reason="the job file sets ps.optimizer: the shards apply it, not the script's "
                            f"{type(optimizer).__name__}")
            return None
        if any(site.framework and site.framework != job.framework for site in job.sites.values()):
            log.info("script_optimizer_overridden", optimizer=job.ps.optimizer.name,
                     reason="a job mixing frameworks applies ps.optimizer on the shards")
            return None
        from hybridfleet.ps.worker.optim_spec import ADAPTIVE_CLASSES, reader_for
        from hybridfleet.spec.rules import ADAPTIVE_UNSAFE_CODECS

        reader = reader_for(optimizer, self.framework, params)
        codec = job.ps.compression.codec
        if reader.name in ADAPTIVE_CLASSES and codec in ADAPTIVE_UNSAFE_CODECS:
            # the same measurement as the job-file rule (hybridfleet.spec.rules): the compressed downlink
            # of an optimizer that moves every coordinate every step lags behind the shards' values
            raise SpecError(f"ps.compression.codec: the shards would apply the script's {reader.name} with codec "
                            f"{codec!r}, which trains a poor model without failing; use sync: local (the script's "
                            f"{reader.name} as the inner optimizer), or codec int8/fp16, or SGD in the script")
        return reader

    def _start_stage(self) -> GradientStage | None:
        """The background stage that copies and encodes gradients during backward (`hybridfleet.ps.worker.overlap`),
        with a grad hook on each trainable parameter; None where the job's path cannot use it."""
        cfg = self.config
        params = self._named_parameters()
        why = overlap_blocker(cfg.job, local=self.session.local, aggregates=cfg.aggregates,
                              layout=self.layout is not None,
                              accelerator=any(self._on_accelerator(p) for p in params.values()))
        if why is not None:
            log.debug("overlap_off", reason=why)
            return None
        self._hooked: set[str] = set()
        stage = GradientStage(self._to_numpy, self.session.encode_param, self._grad_token)
        self._hook_new_parameters(stage, params)
        return stage

    def _hook_new_parameters(self, stage: GradientStage, params: dict[str, Any]) -> None:
        """A grad hook on each trainable parameter that has none yet (one unfrozen since joins here)."""
        for name, param in params.items():
            # a sparse gradient is made dense at step time: no staged copy of it
            if name not in self._hooked and name not in self.sparse and self._trainable(param):
                self._register_grad_hook(param, lambda tensor, name=name: stage.submit(name, tensor))
                self._hooked.add(name)

    def _host_gradients(self, tensors: dict[str, Any], staged: dict | None
                        ) -> tuple[dict[str, np.ndarray], dict | None]:
        """Each gradient tensor (name -> tensor) as float32 numpy, and the staged work that holds for
        it: name -> (array, blocks); None without a stage. Work made from another tensor, or from this
        one before it changed (its version, or its values where they are at hand), is not used: that
        gradient is copied here."""
        if staged is None:
            return {n: self._to_numpy(t) for n, t in tensors.items()}, None
        grads, usable = {}, {}
        for name, tensor in tensors.items():
            entry = staged.get(name)
            if self.stage.valid(entry, tensor) and self._same_values(entry.array, tensor):
                grads[name] = entry.array
                usable[name] = (entry.array, entry.payloads)
                self.stage.stats.used += 1
            else:
                grads[name] = self._to_numpy(tensor)
                self.stage.stats.redone += entry is not None
        return grads, usable

    def _same_values(self, array: np.ndarray, tensor: Any) -> bool:
        """Whether ``tensor`` holds exactly ``array``'s bits; a framework whose version counters miss
        some writes compares the values."""
        return True

    def _buffer_sync(self) -> tuple[BufferSync | None, dict[str, np.ndarray]]:
        """The model's buffers under ``ps.buffers`` (None when they stay on the worker) and their plan tensors."""
        cfg = self.config
        values = self._buffer_values()
        if not values or not cfg.servers or cfg.job.ps.buffers == "local":
            return None, {}
        BufferSync.check_job(cfg.job, cfg.site, bool(values), self.layout is not None)
        sync = BufferSync(cfg.job.ps.buffers, values, cfg.rank)
        return sync, sync.initial(values)

    def _with_buffers(self, grads: dict[str, np.ndarray], samples: int | None) -> dict[str, np.ndarray]:
        """``grads`` plus this step's buffer updates under ``ps.buffers`` (average, broadcast)."""
        if self.buffers is not None:
            grads.update(self._buffer_update(samples))
        return grads

    def _count_samples(self, module: Any, inputs: tuple) -> None:
        """Forward pre-hook: the samples of each training-mode forward pass (the first input's batch size)."""
        first = inputs[0] if isinstance(inputs, tuple) and inputs else None
        if getattr(module, "training", False) and first is not None and len(getattr(first, "shape", ())):
            self._samples += int(first.shape[0])

    # framework specifics --------------------------------------------------
    @abstractmethod
    def _named_parameters(self) -> dict[str, Any]: ...

    @abstractmethod
    def _buffer_values(self) -> dict[str, np.ndarray]:
        """The model's buffers (state that gradients do not train), in their own dtype."""

    @abstractmethod
    def _assign_buffers(self, values: dict[str, np.ndarray]) -> None: ...

    @abstractmethod
    def _to_numpy(self, tensor: Any) -> np.ndarray: ...

    def _trainable(self, param: Any) -> bool:
        return True

    def _register_grad_hook(self, param: Any, submit: Any) -> None:
        """Call ``submit(param.grad)`` each time backward() has accumulated the parameter's gradient
        (no hook: nothing overlaps)."""

    def _grad_token(self, tensor: Any) -> tuple:
        """Which tensor and which version of its values (changes with every in-place write)."""
        return (id(tensor),)

    def _grad(self, param: Any) -> np.ndarray | None:
        """The parameter's gradient as float32 numpy, or None before the first backward."""
        return None if param.grad is None else self._to_numpy(param.grad)

    @abstractmethod
    def _assign(self, values: dict[str, np.ndarray]) -> None: ...

    @abstractmethod
    def zero_grad(self) -> None: ...

    # the API ----------------------------------------------------------------
    def step(self, samples: int | None = None) -> None:
        """Push this step's gradients (of the parameters that have one) and load the new parameters;
        in local mode, step the inner optimizer and sync at the end of each outer round.

        ``samples``: how many samples this step's buffer statistics saw (the weight of this
        worker's BatchNorm statistics under ``ps.buffers: average``); default: the batch sizes
        of the training-mode forward passes since the last step.

        On the worker that saves the job's model, a model checkpoint whose background write
        failed is raised here (CheckpointError) before anything of this step is sent."""
        if self._model_ckpt is not None:
            self._model_ckpt.raise_failed_write()
        if self._past_the_last_round():
            return
        if self.rounds is not None:
            self._step_script_optimizer()
            new = self.rounds.after_inner_step(
                lambda: self._canonical({n: self._to_numpy(p) for n, p in self._named_parameters().items()}),
                (lambda: self._buffer_update(samples)) if self.buffers is not None else None)
            if new is not None:
                self._load(new)
                if self._model_ckpt is not None:  # the job's model exists between rounds, not between inner steps
                    self._model_ckpt.after_step(self.step_count, self.model)
            return
        params = self._named_parameters()
        staged = self.stage.take() if self.stage is not None else None
        if self.reader is None:
            grads, usable = self._host_gradients({n: p.grad for n, p in params.items() if p.grad is not None},
                                                 staged)
            self._load(self.session.step(self._with_buffers(self._canonical(grads), samples), staged=usable))
        elif self.session.local:  # no servers: the script's optimizer steps the model here
            self._step_script_optimizer()
            self.session.local_step(self._canonical({n: self._to_numpy(p) for n, p in params.items()}))
        else:
            if self.sparse:  # a group changed since connect (weight_decay set, add_param_group) is refused as there
                sparse_grads.refusal(self.framework, self.optimizer, self.sparse, params)
            desc = self.reader.describe()
            # in the optimizer's order: a global-norm clip sums in that order, as optimizer.step() does
            stepped = [n for g in desc["groups"] for n in g["params"]]
            raw = self.reader.clip({n: params[n].grad for n in stepped if params[n].grad is not None})
            from hybridfleet.ps.worker.optim_spec import encode

            grads, usable = self._host_gradients(raw, staged)
            self._load(self.session.step(self._with_buffers(self._canonical(grads), samples), encode(desc), usable))
        if self.stage is not None:
            self._hook_new_parameters(self.stage, params)
        if self._model_ckpt is not None:
            self._model_ckpt.after_step(self.step_count, self.model)

    def _past_the_last_round(self) -> bool:
        """Whether this step is one its script's loop counts past the job's ``train.steps``, for a worker
        that caught up.

        A worker that rejoined late takes up the open round, so rounds close without it; a script
        loop counted from where it started (``range(ps.step_count, train.steps)``) then runs as many
        steps past the job's last round as it missed (times ``local_steps`` in local mode), rounds no
        other worker joins (under secure aggregation such a round could never be unmasked). Those
        steps change nothing: no push, no optimizer step, the model keeps the job's final parameters.
        At most that many: a script that trains past ``train.steps`` on purpose goes on as before."""
        missed = self.session.caught_up * (self.rounds.local_steps if self.rounds is not None else 1)
        if self._steps_past >= missed or self.step_count < self.config.job.train.steps:
            return False
        if not self._steps_past:
            log.info("past_the_last_round", worker=self.config.worker_id, steps=self.config.job.train.steps,
                     caught_up=self.session.caught_up, steps_left_out=missed)
        self._steps_past += 1
        return True

    def _step_script_optimizer(self) -> None:
        """Step the script's optimizer on this worker, unless a gradient is not finite (GradScaler
        semantics: that step is skipped, logged and counted)."""
        bad = sorted(n for n, p in self._named_parameters().items()
                     if p.grad is not None and not all_finite(self._grad(p)))
        if bad:
            self.session.note_skipped_nonfinite(bad)
        else:
            self.optimizer.step()

    def _buffer_update(self, samples: int | None) -> dict[str, np.ndarray]:
        update = self.buffers.update(self._buffer_values(), self._samples if samples is None else samples)
        self._samples = 0
        return update

    def _canonical(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.layout.to_canonical(arrays) if self.layout else arrays

    def _load(self, canonical: dict[str, np.ndarray]) -> None:
        """Assign the job's parameters (canonical names and layouts) and buffers to the model."""
        params, buffers = split_buffers(canonical)
        self._assign(self.layout.to_native(params) if self.layout else params)
        if buffers:
            self._assign_buffers(self.buffers.load(buffers))

    @property
    def job(self):
        return self.config.job

    @property
    def site(self) -> str:
        return self.config.site

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def site_rank(self) -> int:
        return self.config.site_rank

    @property
    def workers_at_site(self) -> int:
        """Workers sharing this site's data (1 when training alone, without servers)."""
        return 1 if self.session.local else self.config.job.sites[self.config.site].workers

    @property
    def step_count(self) -> int:
        """Training steps taken by this job so far (inner steps in local mode)."""
        return self.session.step_count if self.rounds is None else self.rounds.inner_steps

    def report(self, **metrics: Any) -> None:
        """Record metrics (loss, accuracy, ...) with the worker's byte counters.

        On the worker that saves the job's model, a new best of ``checkpoint.keep_best``
        is checkpointed (written in the background), and ``final=True`` saves the final model
        with these metrics and returns once every model checkpoint is written.
        """
        self.session.report(step=self.step_count, **metrics)
        if metrics.get("final"):
            self._save_site_buffers()
        if self._model_ckpt is not None:
            if metrics.get("final"):
                self._model_ckpt.final(self.step_count, self.model, metrics)
            else:
                self._model_ckpt.on_metrics(self.step_count, self.model, metrics)

    def scan_egress(self, rows: Any) -> dict | None:
        """Egress test mode (`hfleet run --egress-scan`): search everything this worker sent for each
        of ``rows`` (its training data); reported in the final metrics. None when the mode is off."""
        return self.session.scan_egress(self._to_numpy(rows) if not isinstance(rows, np.ndarray) else rows)

    def close(self) -> None:
        """Leave the job (so synchronous rounds stop waiting for this worker); saves the final
        model first when no ``report(final=True)`` did, and waits until every model checkpoint is
        written. A checkpoint that failed to write is raised (CheckpointError) after leaving."""
        try:
            if self._model_ckpt is not None:
                if not self._model_ckpt.final_saved:
                    self._model_ckpt.final(self.step_count, self.model)
                self._model_ckpt.close()
        finally:
            if self.stage is not None:
                self.stage.close()
                log.info("overlap_stage_closed", worker=self.config.worker_id, **vars(self.stage.stats))
            self._save_site_buffers()
            self.session.close()
            quick_interpreter_exit()

    def _save_site_buffers(self) -> None:
        """Under ``ps.buffers: local`` the site's first worker saves its site's buffers next to the
        job's model (see `hybridfleet.ckpt.site_buffers`), once."""
        cfg = self.config
        if self._site_buffers_saved or cfg.job.ps.buffers != "local" or cfg.site_rank != 0 or self.session.local:
            return
        root = os.environ.get(MODEL_DIR_ENV)
        values = self._buffer_values()
        if root and values:
            path = save_site_buffers(root, cfg.site, self.step_count, values)
            log.info("site_buffers_saved", site=cfg.site, path=path, buffers=len(values), step=self.step_count)
        self._site_buffers_saved = True

    def __enter__(self) -> "ParameterServerHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
