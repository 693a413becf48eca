"""torchrun worker of bench/ps_exchange.py: gloo all_reduce of the same tensors, timed per round."""

import json
import sys
import time

import torch
import torch.distributed as dist

from hybridfleet.launch.helpers import finish


def main() -> None:
    rounds, numel, tensors = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ts = [torch.randn(numel // tensors) for _ in range(tensors)]
    times = []
    for _ in range(rounds + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for t in ts:
            dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        print("GLOO " + json.dumps({"round_s": times[1:]}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    finish()  # no interpreter teardown, where a finished gloo rank can abort (SIGABRT) in torch's destructors


if __name__ == "__main__":
    main()
