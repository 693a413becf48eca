"""Local SGD / DiLoCo on the worker (``ps.sync: local``).

The script's own optimizer (torch.optim / paddle.optimizer) takes ``ps.local_steps``
inner steps on the worker's data; then the worker pushes its pseudo-gradient
``start - end`` parameters of the outer round through the job's codec (with error
feedback kept here, as for gradients), the shards average the round's pseudo-gradients
(a site that aggregates averages its own first, over the site's LAN) and apply them with
the outer optimizer (``ps.optimizer``, Nesterov SGD by default), and every worker starts
the next outer round from the new global parameters. The inner optimizer's state
(Adam moments) carries over from round to round, as in DiLoCo.

Outer rounds close like BSP rounds: a round waits for every live worker. A worker that
falls out of the quorum (heartbeat timeout) or restarts after a crash has its late
pseudo-gradient refused as stale; it joins the next outer round from the new global
parameters, so a straggler never holds back more than the round it is late for and
never applies an update computed on old parameters.

Crash safety: the shards' snapshots hold the outer state (parameters, outer momentum,
round); after each outer round the worker saves its inner optimizer's state to
``$HFLEET_RUN_DIR/inner/<process>`` (a hybridfleet checkpoint), and a restarted worker
loads it back and resumes at the start of the open round.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hybridfleet.errors import CheckpointError
from hybridfleet.obs.log import get_logger
from hybridfleet.ps.worker.session import PSSession
from hybridfleet.ps.wire.buffers import DTYPE  # the wire's float32, little-endian

log = get_logger("ps.local")



class InnerState:
    """The inner optimizer's state, saved after each outer round and loaded by a restarted worker."""

    def __init__(self, directory: Path, framework: str):
        self.url = str(directory)
        self.framework = framework

    @classmethod
    def from_env(cls, framework: str) -> "InnerState | None":
        """Under ``$HFLEET_RUN_DIR/inner/<process>`` (the supervisor's process name, e.g. ``worker-cloud-1``);
        None when the worker runs outside a supervisor."""
        run_dir, process = os.environ.get("HFLEET_RUN_DIR"), os.environ.get("HFLEET_PROCESS_NAME")
        return cls(Path(run_dir) / "inner" / process, framework) if run_dir and process else None

    def save(self, outer_round: int, optimizer: Any) -> None:
        from hybridfleet.ckpt.checkpoint import save_checkpoint
        from hybridfleet.ckpt.retention import gc

        save_checkpoint(self.url, outer_round, optimizer=optimizer, framework=self.framework)
        gc(self.url, keep_last=1)

    def load(self, optimizer: Any) -> int | None:
        """Load the newest saved state into ``optimizer``; its outer round, or None when there is none."""
        from hybridfleet.ckpt.checkpoint import list_checkpoints, load_checkpoint

        if not Path(self.url).is_dir() or not list_checkpoints(self.url):
            return None
        try:
            return load_checkpoint(self.url, optimizer=optimizer, restore_rng=False).step
        except CheckpointError as err:
            log.warning("inner_state_unreadable", url=self.url, error=str(err))
            return None


class LocalRounds:
    """Counts inner steps and, every ``local_steps``, exchanges the pseudo-gradient for the new global parameters."""

    def __init__(self, session: PSSession, optimizer: Any, inner_state: InnerState | None = None):
        self.session = session
        self.optimizer = optimizer
        self.local_steps = session.ps.local_steps
        self.inner_state = inner_state
        self.anchor = {k: v.copy() for k, v in session.parameters().items()}
        self.inner_steps = session.step_count * self.local_steps  # a restart resumes at the open round's start
        self.outer_rounds = 0
        if inner_state is not None and session.step_count > 0:
            restored = inner_state.load(optimizer)
            log.info("inner_state_restored" if restored is not None else "inner_state_missing",
                     worker=session.config.worker_id, saved_round=restored, open_round=session.step_count)

    def after_inner_step(self, read_params: Callable[[], dict[str, np.ndarray]],
                         read_extra: Callable[[], dict[str, np.ndarray]] | None = None) -> dict[str, np.ndarray] | None:
        """Call after each inner optimizer step; at the end of an outer round, returns the new global parameters.
        ``read_extra`` gives tensors pushed as they are (the model's buffer updates, see `ps.worker.buffers`)."""
        self.inner_steps += 1
        if self.inner_steps % self.local_steps:
            return None
        current = read_params()
        extra = read_extra() if read_extra is not None else {}
        pseudo = {k: np.subtract(self.anchor[k], np.asarray(current[k], dtype=DTYPE).reshape(self.anchor[k].shape),
                                 dtype=DTYPE) for k in self.anchor if k not in extra}
        new = self.session.step({**pseudo, **extra})
        # a worker that caught up (rounds closed without it) counts its inner steps from the open round
        self.inner_steps = max(self.inner_steps, self.session.step_count * self.local_steps)
        self.anchor = {k: v.copy() for k, v in new.items()}
        self.outer_rounds += 1
        if self.inner_state is not None:
            self.inner_state.save(self.session.step_count, self.optimizer)
        return new
