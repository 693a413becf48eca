"""A shard's optimizer step on a 64 MB slice: the framework's own optimizer vs the numpy one.

    python bench/script_optimizer.py            # 64 MB slice (16 Mi float32), 5 steps each
    python bench/script_optimizer.py --quick    # 16 MB, 3 steps (well under a minute)

What a shard does with one round's gradient of the 64 MB exchange (bench/ps_exchange.py):
the slice is cut into the job's blocks (``ps.block_size_bytes``, 4 MiB by default) and
each block is stepped with Adam (weight decay 0.01). The project side is the shard's
`ScriptOptimizer` running ``torch.optim.Adam`` / ``paddle.optimizer.Adam`` on the shard's
numpy buffers (the script's optimizer, what a job without ``ps.optimizer`` gets); the
anchor is the numpy Adam of `hybridfleet.ps.server.optim` (what an explicit
``ps.optimizer`` gets), in the same flavour. Both run here, in this process, one after
the other, on the same gradients.

The last line is JSON: ``<framework>_script_s`` and ``<framework>_numpy_s`` are median
seconds per step, ``ratio`` = script_s / numpy_s for torch (below 1: the framework's
optimizer is faster), ``paddle_ratio`` the same for paddle (omitted when paddle is not
installed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from hybridfleet.ps.server.groups import ScriptOptimizer
from hybridfleet.ps.server.optim import make_optimizer
from hybridfleet.spec.models import OptimizerSpec

BLOCK_BYTES = 4 << 20


def _blocks(total_bytes: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n = BLOCK_BYTES // 4
    return {f"w#{i}": rng.standard_normal(n).astype(np.float32) for i in range(total_bytes // BLOCK_BYTES)}


def _description(framework: str) -> dict:
    if framework == "torch":
        hyper = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
                 "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                 "decoupled_weight_decay": False}
        return {"framework": "torch", "class": "Adam", "lr": None, "ctor": {}, "param_attrs": {},
                "groups": [{"params": ["w"], "hyper": hyper}]}
    return {"framework": "paddle", "class": "Adam", "lr": 1e-3, "param_attrs": {},
            "ctor": {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "lazy_mode": False, "weight_decay": ["l2", 0.01]},
            "groups": [{"params": ["w"], "hyper": {}}]}


def _time(step, steps: int) -> float:
    step()  # the first step allocates the state
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(framework: str, total_bytes: int, steps: int) -> tuple[float, float, float]:
    """(script_s, numpy_s, max relative difference of the two results after all steps)."""
    grads = {k: v * np.float32(0.01) for k, v in _blocks(total_bytes).items()}
    script_params, numpy_params = _blocks(total_bytes), _blocks(total_bytes)
    script = ScriptOptimizer(framework, {k: "w" for k in script_params})
    desc = _description(framework)
    script_s = _time(lambda: script.step(script_params, grads, desc), steps)
    numpy_opt = make_optimizer(OptimizerSpec(name="adam", lr=1e-3, weight_decay=0.01), framework)

    def numpy_step():
        for k, g in grads.items():
            numpy_opt.step(k, numpy_params[k], g)

    numpy_s = _time(numpy_step, steps)
    diff = max(float(np.abs(script_params[k] - numpy_params[k]).max() / np.abs(numpy_params[k]).max())
               for k in grads)
    return script_s, numpy_s, diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 MB, 3 steps")
    args = parser.parse_args()
    total, steps = (16 << 20, 3) if args.quick else (64 << 20, 5)
    result = {"bench": "script_optimizer", "slice_bytes": total, "block_bytes": BLOCK_BYTES, "steps": steps,
              "anchor": "numpy Adam of hybridfleet.ps.server.optim (an explicit ps.optimizer)",
              "project": "the framework's own Adam on the shard's buffers (the script's optimizer)"}
    print(f"Adam step on a {total >> 20} MB slice in {BLOCK_BYTES >> 20} MiB blocks, median of {steps}")
    print(f"{'framework':<10}{'framework optimizer s':>24}{'numpy optimizer s':>20}{'ratio':>8}{'max rel diff':>14}")
    for framework in ("torch", "paddle"):
        try:
            script_s, numpy_s, diff = measure(framework, total, steps)
        except ImportError:
            print(f"{framework:<10} not installed")
            continue
        ratio = script_s / numpy_s
        print(f"{framework:<10}{script_s:>24.3f}{numpy_s:>20.3f}{ratio:>8.2f}{diff:>14.1e}")
        result.update({f"{framework}_script_s": round(script_s, 4), f"{framework}_numpy_s": round(numpy_s, 4),
                       f"{framework}_max_rel_diff": diff,
                       ("ratio" if framework == "torch" else "paddle_ratio"): round(ratio, 3)})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
