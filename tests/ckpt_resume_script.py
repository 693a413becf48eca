"""A small deterministic training run that checkpoints every step and resumes from the newest.

    python tests/ckpt_resume_script.py --framework torch --ckpt DIR --steps 12 --out final.safetensors [--pause-after 5]

With --pause-after K it prints "CHECKPOINT_SAVED K" after saving step K and then
waits to be killed. It draws from python `random` (augmentation), numpy (epoch
shuffles) and the framework RNG (dropout), so an exact resume needs all three.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
from safetensors.numpy import save_file

from hybridfleet.ckpt import load_checkpoint, save_checkpoint
from hybridfleet.errors import CheckpointError
from hybridfleet.frameworks import get_adapter

SAMPLES, FEATURES, BATCH = 48, 6, 8


def build(framework: str):
    """Model, optimizer and a train-step function of ``framework``."""
    if framework == "torch":
        import torch

        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)

        def train_step(x, y):
            opt.zero_grad()
            loss = (model(torch.from_numpy(x)) - torch.from_numpy(y)).pow(2).mean()
            loss.backward()
            opt.step()

        return model, opt, train_step
    import paddle

    paddle.seed(0)
    model = paddle.nn.Sequential(paddle.nn.Linear(FEATURES, 16), paddle.nn.ReLU(), paddle.nn.Dropout(0.3), paddle.nn.Linear(16, 1))
    opt = paddle.optimizer.Adam(learning_rate=1e-2, parameters=model.parameters())

    def train_step(x, y):
        loss = (model(paddle.to_tensor(x)) - paddle.to_tensor(y)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()

    return model, opt, train_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--pause-after", type=int, default=-1)
    args = parser.parse_args()

    random.seed(0)
    np.random.seed(0)
    data = np.random.default_rng(123)
    xs = data.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    ys = (xs.sum(axis=1, keepdims=True) * 0.5).astype(np.float32)
    model, opt, train_step = build(args.framework)

    sampler = {"epoch": -1, "order": [], "position": SAMPLES}
    start = 0
    try:
        info = load_checkpoint(args.ckpt, model, opt)
        start, sampler = info.step, info.state["sampler"]
        print(f"RESUMED_FROM {start}", flush=True)
    except CheckpointError:
        pass

    for step in range(start + 1, args.steps + 1):
        if sampler["position"] + BATCH > SAMPLES:
            sampler = {"epoch": sampler["epoch"] + 1, "order": np.random.permutation(SAMPLES).tolist(), "position": 0}
        index = sampler["order"][sampler["position"] : sampler["position"] + BATCH]
        sampler["position"] += BATCH
        scale = np.float32(1.0 + 0.05 * random.random())
        train_step(xs[index] * scale, ys[index])
        save_checkpoint(args.ckpt, step, model, opt, state={"sampler": sampler})
        if step == args.pause_after:
            print(f"CHECKPOINT_SAVED {step}", flush=True)
            time.sleep(600)  # the test kills us here with SIGKILL

    save_file(get_adapter(args.framework).model_state(model), args.out)


if __name__ == "__main__":
    main()
