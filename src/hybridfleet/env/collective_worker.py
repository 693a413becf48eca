"""One rank of the all-reduce smoke test: ``python -m hybridfleet.env.collective_worker FRAMEWORK BACKEND``.

The rendezvous comes from the environment the parent (`hybridfleet.env.smoke`)
sets: MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE for torch, PADDLE_* for paddle.
Each rank contributes ``rank + 1`` and prints the reduced value on one marked line.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

MARKER = "HFLEET_SMOKE "


def _torch_all_reduce(backend: str) -> tuple[int, int, float]:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    timeout_s = float(os.environ.get("HFLEET_SMOKE_TIMEOUT_S", "60"))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        device = "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        value = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(value)
        return rank, dist.get_world_size(), float(value.item())
    finally:
        dist.destroy_process_group()


def _paddle_all_reduce(backend: str) -> tuple[int, int, float]:
    import paddle
    import paddle.distributed as dist

    rank = int(os.environ["PADDLE_TRAINER_ID"])
    paddle.set_device(f"gpu:{rank}" if backend == "nccl" else "cpu")
    dist.init_parallel_env()
    value = paddle.to_tensor([float(rank + 1)])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), float(value.numpy()[0])


def main(argv: list[str]) -> int:
    """Child entry: join the group, all-reduce, print the result as one marked JSON line."""
    framework, backend = argv[0], argv[1]
    run = _torch_all_reduce if framework == "torch" else _paddle_all_reduce
    rank, world_size, value = run(backend)
    sys.stdout.write(MARKER + json.dumps({"rank": rank, "world_size": world_size, "value": value}) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    from hybridfleet.launch.helpers import finish

    finish(main(sys.argv[1:]))  # no interpreter teardown, where a finished torch gloo rank can abort
