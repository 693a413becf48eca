"""Digits classifier trained data-parallel the classic Paddle way (gloo on CPU, NCCL on GPUs).

Run it on two processes, or on one without any launcher:

    hfleet launch --framework paddle --nproc-per-node 2 --device cpu examples/collective/train_paddle.py --epochs 30
    python examples/collective/train_paddle.py --epochs 30

Every ``--ckpt-every`` epochs rank 0 saves the weights to ``HFLEET_CKPT_DIR``; a restarted
run (``hfleet launch --max-restarts K``) resumes after the newest one. The last line
printed is JSON with the test accuracy.
"""

import argparse
import os
import signal

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle.io import DataLoader, DistributedBatchSampler, TensorDataset
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from hybridfleet.launch.helpers import dist_info, latest_checkpoint, log_rank0, restart_count, save_model, save_rank0

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
rank, world_size, local_rank = dist_info("paddle")
if world_size > 1:
    dist.init_parallel_env()
paddle.seed(args.seed)

# -- data: scikit-learn's bundled 8x8 digits, same split on every rank -----------------
digits = load_digits()
x = (digits.data / 16.0).astype(np.float32)
x_train, x_test, y_train, y_test = train_test_split(
    x, digits.target, test_size=0.2, random_state=args.seed, stratify=digits.target
)
train_set = TensorDataset([paddle.to_tensor(x_train), paddle.to_tensor(y_train.astype(np.int64))])
sampler = DistributedBatchSampler(
    train_set, batch_size=max(1, args.batch_size // world_size), num_replicas=world_size, rank=rank, shuffle=True
)
loader = DataLoader(train_set, batch_sampler=sampler)

# -- model: a small MLP; DataParallel averages gradients across ranks -----------------
net = paddle.nn.Sequential(paddle.nn.Linear(64, 64), paddle.nn.ReLU(), paddle.nn.Linear(64, 10))
start_epoch = 1
ckpt = latest_checkpoint()
if ckpt is not None:
    net.set_state_dict({name: paddle.to_tensor(value) for name, value in ckpt.state.items()})
    start_epoch = ckpt.step + 1
    log_rank0("resumed", checkpoint_epoch=ckpt.step, start_epoch=start_epoch, restart=restart_count())
model = paddle.DataParallel(net) if world_size > 1 else net
optimizer = paddle.optimizer.SGD(learning_rate=args.lr, parameters=model.parameters())  # stateless: resume is exact

# -- training loop ----------------------------------------------------------------
for epoch in range(start_epoch, args.epochs + 1):
    sampler.set_epoch(epoch)
    model.train()
    for step, (xb, yb) in enumerate(loader):
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        if rank == 1 and epoch == kill_rank1_at_epoch and restart_count() == 0 and step == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    log_rank0("epoch", epoch=epoch, loss=round(float(loss.item()), 4))
    if args.ckpt_every and epoch % args.ckpt_every == 0:
        save_rank0(net, step=epoch)  # with its layer layout: `hfleet ckpt convert` can turn it into torch

# -- evaluation on the held-out split -----------------------------------------------
net.eval()
with paddle.no_grad():
    predicted = net(paddle.to_tensor(x_test)).argmax(axis=1).numpy()
test_acc = float((predicted == y_test).mean())
log_rank0("final", framework="paddle", world_size=world_size, test_acc=test_acc)
save_model(net, step=args.epochs, metrics={"test_acc": test_acc})  # the run's model, with lineage
