"""Train a small ResNet with BatchNorm on Fashion-MNIST with PyTorch, jointly across two sites.

    python examples/fashion/pack_sites.py             # once: writes examples/fashion/data/site-{a,b,all}
    hfleet run examples/fashion-hybrid.yaml           # joint; summary.json has each site alone too
    hfleet run examples/fashion-alone.yaml            # the same script alone on all the data

Each worker trains on its own site's rows only (the sites differ in classes and in scanner
brightness, see fashion_data.py); `ps.step()` sends gradients and brings back the job's
parameters. The shards apply this script's SGD with momentum and weight decay at the
learning rate its cosine schedule gives each step; BatchNorm's running statistics follow
the job's ``ps.buffers`` (averaged by default), so every worker evaluates, and rank 0
saves, the same model. Started without a parameter server (no HFLEET_SERVERS), the same
script trains alone on one site's data (that is how `site_baselines` trains each site alone).

Options (the job's ``args:``, see fashion_model.train_args): ``--width`` (16: 0.30M parameters), ``--lr``,
``--momentum``, ``--weight-decay``, ``--test-rows``.
"""

import numpy as np
import torch
import torch.nn.functional as F
from fashion_data import load_site, load_test
from fashion_model import build_torch, train_args

import hybridfleet.torch as hf

torch.set_num_threads(1)

args = train_args()  # --width, --lr, --momentum, --weight-decay, --test-rows

# -- the model and its optimizer -----------------------------------------------------
torch.manual_seed(0)  # every worker starts from the same weights
model = build_torch(args.width)  # fashion_model.py: the same code `hfleet registry export` loads
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
ps = hf.connect(model, optimizer)  # the shards apply this SGD, at the schedule's learning rate each step
train = ps.job.train
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=train.steps)
for _ in range(ps.step_count):  # a restarted worker resumes the schedule where the job is
    scheduler.step()

# -- this worker's data and randomness ------------------------------------------------
x, y = load_site(ps.job.sites[ps.site].data, ps.site_rank, ps.workers_at_site)
x, y = torch.from_numpy(x), torch.from_numpy(y)
x_test, y_test = (torch.from_numpy(a) for a in load_test(args.test_rows))
# the same weights everywhere (seeded above), but each worker its own batches and flips:
# seed by rank after connect (and by step, so a restarted worker draws anew)
seed = train.seed + 1000 * ps.rank + ps.step_count
torch.manual_seed(seed)
rng = np.random.default_rng(seed)


def accuracy() -> float:
    model.eval()  # BatchNorm's running statistics
    with torch.no_grad():
        correct = sum((model(xb).argmax(1) == yb).sum().item()
                      for xb, yb in zip(x_test.split(1000), y_test.split(1000)))
    model.train()
    return correct / len(y_test)


# -- the training loop ---------------------------------------------------------------
for step in range(ps.step_count, train.steps):
    batch = torch.from_numpy(rng.integers(0, len(x), train.batch_size))
    images = x[batch]
    flip = torch.from_numpy(rng.random(len(batch)) < 0.5)
    images = torch.where(flip[:, None, None, None], images.flip(3), images)  # random horizontal flip
    loss = F.cross_entropy(model(images), y[batch])
    ps.zero_grad()
    loss.backward()
    ps.step()  # instead of optimizer.step()
    scheduler.step()
    if train.eval_every_steps and (step + 1) % train.eval_every_steps == 0:
        ps.report(loss=round(loss.item(), 5), test_accuracy=round(accuracy(), 5), lr=scheduler.get_last_lr()[0])

ps.report(final=True, test_accuracy=accuracy(), train_rows=len(x))  # rank 0 saves exactly this model
ps.close()
