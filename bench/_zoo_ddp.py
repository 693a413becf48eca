"""Collective runner of bench/zoo.py: an example's own model, optimizer and loop under DDP / paddle.DataParallel.

Started by ``hfleet launch --framework F --nproc-per-node N --device cpu`` with
``WORKLOAD FRAMEWORK DATA STEPS BATCH_SIZE EVAL_EVERY SEED [SCRIPT ARGS...]`` (the
script's own arguments, the example job's ``args:``, parsed by the script's parser). Each
rank trains on its 1/N of ``DATA`` (a packed dataset) with the batches the example's script
draws (``seed + 1000 * rank``), from the same weights (seeded as the script seeds them), with
the script's optimizer and its schedule stepped once per step over STEPS; gradients are
averaged by the framework's collective (gloo). Rank 0 prints one ``ZOO {...}`` JSON line per
evaluation with the step, the wall-clock time, the seconds since training started and the metric.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _zoo_workloads import WORKLOADS, Run, Workload

from hybridfleet.launch.helpers import finish


def train_loop(workload: Workload, run: Run, model: Any, wrapped: Any, optimizer: Any,
               schedule_step: Callable[[], None] | None, train: Any, test: Any, batch_size: int, eval_every: int,
               seed: int, rank: int, report: Callable[[dict], None]) -> None:
    """The script's loop for ``run.steps`` steps: the batch it draws (seeded ``seed + 1000 * rank``), its loss
    through ``wrapped`` (DDP / DataParallel, or the model itself), the optimizer's step, then the schedule's.
    On rank 0, ``report`` gets a record per evaluation (every ``eval_every`` steps and after the last one): the
    step, the times, the step's loss (rounded as the scripts report it) and the metric."""
    if run.framework == "torch":
        import torch

        torch.manual_seed(seed + 1000 * rank)
    else:
        import paddle

        paddle.seed(seed + 1000 * rank)
    rng = np.random.default_rng(seed + 1000 * rank)
    started = time.monotonic()  # as the PS session's clock: from the joined, initialised model
    for step in range(run.steps):
        loss = workload.batch_loss(run, wrapped, train, rng, batch_size)
        if run.framework == "torch":
            optimizer.zero_grad(set_to_none=True)
        else:
            optimizer.clear_grad()
        loss.backward()
        optimizer.step()
        if schedule_step is not None:  # as the scripts: the schedule advances once per step, after it
            schedule_step()
        final = step + 1 == run.steps
        if rank == 0 and (final or (eval_every and (step + 1) % eval_every == 0)):
            value = workload.evaluate(run, model, test)
            report({"step": step + 1, "ts": time.time(), "elapsed_s": round(time.monotonic() - started, 4),
                    "loss": round(float(loss), 5), workload.metric: value, "final": final})


def main() -> None:
    name, framework, data = sys.argv[1], sys.argv[2], sys.argv[3]
    steps, batch_size, eval_every, seed = (int(a) for a in sys.argv[4:8])
    workload = WORKLOADS[name]
    run = workload.prepare(framework, steps, sys.argv[8:])
    rank, world = int(os.environ.get("RANK", os.environ.get("PADDLE_TRAINER_ID", "0"))), int(
        os.environ.get("WORLD_SIZE", os.environ.get("PADDLE_TRAINERS_NUM", "1")))
    if framework == "torch":
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        model, optimizer, schedule_step = workload.build(run)
        wrapped = DistributedDataParallel(model)
    else:
        import paddle
        import paddle.distributed as dist

        paddle.set_device("cpu")
        dist.init_parallel_env()
        model, optimizer, schedule_step = workload.build(run)
        wrapped = paddle.DataParallel(model)

    train = workload.load_train(run, data, rank, world)
    test = workload.load_test(run)
    train_loop(workload, run, model, wrapped, optimizer, schedule_step, train, test, batch_size, eval_every, seed,
               rank, lambda record: print("ZOO " + json.dumps(record), flush=True))
    if framework == "torch":
        del wrapped  # DDP's reducer holds the group: let it go before the group is torn down
        dist.barrier()
        dist.destroy_process_group()
        finish()  # as the examples: no interpreter teardown, where a gloo rank can abort after its work is done


if __name__ == "__main__":
    main()
