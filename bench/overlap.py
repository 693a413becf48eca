"""Step time with the gradient stage overlapping backward (``ps.overlap: on``) vs without (``off``).

    python bench/overlap.py                          # torch, 8 x 1024-wide MLP (8.4M parameters), top-k 1% + EF
    python bench/overlap.py --framework paddle
    python bench/overlap.py --quick                  # 4 layers of 512, 8 steps (well under a minute)

One shard (``hfleet ps serve``, its own process, plaintext on 127.0.0.1), one worker in this
process training a deep MLP with the script's SGD; each setting gets fresh shards and the
same seed, inputs and steps. A step is timed from forward to the end of ``ps.step()``
(backward, copy to host, encode, push, pull, load). With ``on`` the copy and the top-k
encode of each layer's gradient run on a background thread while backward computes the
earlier layers; with ``off`` they run in ``ps.step()``, after backward. The last line is
JSON: ``overlap_step_s`` / ``no_overlap_step_s`` are median seconds per step,
``overlap_speedup`` = no_overlap_step_s / overlap_step_s (above 1: overlap is faster), and
``params_identical`` whether both runs ended with bit-identical parameters, ``stage`` the
stage's counters (``encoded_before_step``: gradients already encoded when ``ps.step()`` began).

On a CPU-only machine backward and the stage share the same cores, so expect little or no
gain there; the overlap pays where backward runs on an accelerator while the host encodes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shards import REPO, serve_shards, stop_shards  # noqa: E402

from hybridfleet.ps.worker.client import ClientSecurity  # noqa: E402
from hybridfleet.ps.worker.config import WorkerConfig  # noqa: E402
from hybridfleet.spec import load_spec  # noqa: E402


def _job(workdir: Path, framework: str, overlap: str, ratio: float) -> Path:
    path = workdir / f"overlap-{framework}-{overlap}.yaml"
    path.write_text(yaml.safe_dump({
        "name": f"overlap-{overlap}", "framework": framework,
        "entrypoint": str(REPO / "examples" / "digits" / f"train_{framework}.py"), "mode": "ps",
        "sites": {"a": {"workers": 1}},
        "ps": {"shards": 1, "sync": "bsp", "overlap": overlap,
               "compression": {"codec": "topk", "ratio": ratio, "error_feedback": True}},
        "security": {"tls": "off", "tokens": "off"}}))
    return path


def _mlp(framework: str, width: int, layers: int):
    """(adapter, model, optimizer, backward(x, y), state values) of a ``layers`` x ``width`` MLP."""
    if framework == "torch":
        import torch

        import hybridfleet.torch as hf

        nn, tensor = torch.nn, torch.from_numpy
        torch.manual_seed(0)
    else:
        import paddle

        import hybridfleet.paddle as hf

        nn, tensor = paddle.nn, paddle.to_tensor
        paddle.seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    model = nn.Sequential(*mods, nn.Linear(width, 10))
    if framework == "torch":
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        clear = opt.zero_grad
        values = lambda: {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    else:
        opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters())
        clear = lambda: opt.clear_grad(set_to_zero=False)
        values = lambda: {k: v.numpy().copy() for k, v in model.state_dict().items()}

    def backward(x, y):
        clear()
        nn.functional.cross_entropy(model(tensor(x)), tensor(y)).backward()

    return hf, model, opt, backward, values


def _run(framework, config, width, layers, steps, batch):
    """Seconds per step, the final parameters and the stage's counters."""
    hf, model, opt, backward, values = _mlp(framework, width, layers)
    ps = hf.connect(model, opt, config=config)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps):
        x, y = rng.standard_normal((batch, width)).astype(np.float32), rng.integers(0, 10, batch)
        t0 = time.perf_counter()
        backward(x, y)
        ps.step()
        times.append(time.perf_counter() - t0)
    stats = ps.stage.stats if ps.stage is not None else None
    ps.close()
    return times, values(), stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=["torch", "paddle"], default="torch")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ratio", type=float, default=0.01, help="top-k ratio (error feedback on)")
    ap.add_argument("--quick", action="store_true", help="4 layers of 512, 8 steps")
    args = ap.parse_args()
    if args.quick:
        args.width, args.layers, args.steps = 512, 4, 8
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for overlap in ("on", "off"):
            job = _job(workdir, args.framework, overlap, args.ratio)
            procs, addresses = serve_shards(job, 1, workdir, expected_workers=1)
            try:
                config = WorkerConfig(job=load_spec(job), site="a", servers=addresses,
                                      security=ClientSecurity(insecure=True))
                times, params, stats = _run(args.framework, config, args.width, args.layers, args.steps, args.batch)
            finally:
                stop_shards(procs)
            results[overlap] = (statistics.median(times[1:] or times), params, stats)  # the first step allocates
    on, off = results["on"][0], results["off"][0]
    same = all(np.array_equal(results["on"][1][k], results["off"][1][k]) for k in results["off"][1])
    numel = sum(v.size for v in results["off"][1].values())
    print(f"{args.framework}: MLP {args.layers} x {args.width} ({numel / 1e6:.1f}M parameters), batch {args.batch}, "
          f"top-k {args.ratio:g} + EF, {args.steps} steps, one shard")
    print(f"{'ps.overlap':<12}{'median step s':>16}")
    print(f"{'on':<12}{on:>16.4f}")
    print(f"{'off':<12}{off:>16.4f}")
    print(json.dumps({"bench": "overlap", "framework": args.framework, "overlap_step_s": round(on, 5),
                      "no_overlap_step_s": round(off, 5), "overlap_speedup": round(off / on, 3),
                      "params_identical": same, "parameters": int(numel), "steps": args.steps,
                      "batch": args.batch, "stage": vars(results["on"][2]),
                      "sides": "overlap_step_s = ps.overlap on (project), no_overlap_step_s = off (anchor)"}))


if __name__ == "__main__":
    main()
