"""Digits classifier trained data-parallel with PyTorch DDP (gloo on CPU, NCCL on GPUs).

Run it on two processes, or on one without any launcher:

    hfleet launch --framework torch --nproc-per-node 2 --device cpu examples/collective/train_torch.py --epochs 30
    python examples/collective/train_torch.py --epochs 30

Every ``--ckpt-every`` epochs rank 0 saves the weights to ``HFLEET_CKPT_DIR``; a restarted
run (``hfleet launch --max-restarts K``) resumes after the newest one. The last line
printed is JSON with the test accuracy.
"""

import argparse
import os
import signal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hybridfleet.launch.helpers import (
    dist_info, finish, latest_checkpoint, log_rank0, restart_count, save_model, save_rank0,
)

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=30)
parser.add_argument("--batch-size", type=int, default=32, help="global: split across the processes")
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--ckpt-every", type=int, default=2, help="epochs between checkpoints (0: never)")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
# Fault injection for tests: rank 1 SIGKILLs itself in this epoch on the first attempt only.
kill_rank1_at_epoch = int(os.environ.get("HFLEET_EXAMPLE_KILL_RANK1_AT_EPOCH", "0"))

# -- process group -----------------------------------------------------------------
rank, world_size, local_rank = dist_info("torch")
if world_size > 1:
    dist.init_process_group(backend=os.environ.get("HFLEET_DIST_BACKEND", "gloo"))
torch.manual_seed(args.seed)

# -- data: scikit-learn's bundled 8x8 digits, same split on every rank -----------------
digits = load_digits()
x = (digits.data / 16.0).astype(np.float32)
x_train, x_test, y_train, y_test = train_test_split(
    x, digits.target, test_size=0.2, random_state=args.seed, stratify=digits.target
)
train_set = TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train).long())
sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
loader = DataLoader(train_set, batch_size=max(1, args.batch_size // world_size), sampler=sampler)

# -- model: a small MLP; DDP averages gradients across ranks --------------------------
net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
start_epoch = 1
ckpt = latest_checkpoint()
if ckpt is not None:
    net.load_state_dict({name: torch.from_numpy(value) for name, value in ckpt.state.items()})
    start_epoch = ckpt.step + 1
    log_rank0("resumed", checkpoint_epoch=ckpt.step, start_epoch=start_epoch, restart=restart_count())
model = DistributedDataParallel(net) if world_size > 1 else net
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)  # stateless: resume is exact

# -- training loop ----------------------------------------------------------------
for epoch in range(start_epoch, args.epochs + 1):
    sampler.set_epoch(epoch)
    model.train()
    for step, (xb, yb) in enumerate(loader):
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 1 and epoch == kill_rank1_at_epoch and restart_count() == 0 and step == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    log_rank0("epoch", epoch=epoch, loss=round(loss.item(), 4))
    if args.ckpt_every and epoch % args.ckpt_every == 0:
        save_rank0(net, step=epoch)  # with its layer layout: `hfleet ckpt convert` can turn it into paddle

# -- evaluation on the held-out split -----------------------------------------------
net.eval()
with torch.no_grad():
    predicted = net(torch.from_numpy(x_test)).argmax(dim=1).numpy()
test_acc = float((predicted == y_test).mean())
log_rank0("final", framework="torch", world_size=world_size, test_acc=test_acc)
save_model(net, step=args.epochs, metrics={"test_acc": test_acc})  # the run's model, with lineage
if world_size > 1:
    dist.barrier()  # every rank is past its last collective before any tears the group down
    dist.destroy_process_group()
finish()  # leave without interpreter teardown, where torch's native destructors can abort a finished rank
