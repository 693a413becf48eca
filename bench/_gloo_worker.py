"""torchrun worker of bench/ps_exchange.py: gloo all_reduce of the same tensors, timed per round.

Then the same rounds as a DDP iteration runs them after its backward: all_reduce of the
gradients, their mean, and the job's optimizer step (torch.optim with its defaults, the
shards' optimizer and lr) on this process's parameters; the parameter server's round does
that step on the shards, so this is the anchor that does the same work."""

import json
import sys
import time

import torch
import torch.distributed as dist

from hybridfleet.launch.helpers import finish


def main() -> None:
    rounds, numel, tensors = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    optimizer, lr = sys.argv[4], float(sys.argv[5])
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
    params = [torch.nn.Parameter(torch.randn(t.numel())) for t in ts]
    for p, t in zip(params, ts):
        p.grad = t  # the gradients' buffers: all_reduce works in them, as DDP's buckets do
    opt = (torch.optim.Adam if optimizer == "adam" else torch.optim.SGD)(params, lr=lr)
    world = dist.get_world_size()
    step_times = []
    for _ in range(rounds + 1):  # the first round creates Adam's slots, as a job's first step does
        dist.barrier()
        t0 = time.perf_counter()
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        opt.step()
        step_times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        print("GLOO " + json.dumps({"round_s": times[1:], "step_round_s": step_times[1:]}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    finish()  # no interpreter teardown, where a finished gloo rank can abort (SIGABRT) in torch's destructors


if __name__ == "__main__":
    main()
