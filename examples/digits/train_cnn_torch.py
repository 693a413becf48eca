"""Train a small CNN with BatchNorm and dropout on the digits sites, through the parameter server.

    hfleet run examples/digits-cnn.yaml
    hfleet registry export digits-cnn@prod --format onnx --model examples/digits/digits_model.py:build_cnn_torch -o out/digits-cnn-onnx

The script is an ordinary PyTorch loop plus the three lines. BatchNorm's running statistics
follow the job's ``ps.buffers`` (averaged over the sites by default), so every worker
evaluates, and rank 0 saves, the same model; the summary's joint accuracy is that model's.
"""

import numpy as np
import torch
import torch.nn.functional as F
from digits_data import load_site, load_test
from digits_model import build_cnn_torch

import hybridfleet.torch as hf

torch.set_num_threads(1)

# -- the model ---------------------------------------------------------------
torch.manual_seed(0)  # every worker starts from the same weights
model = build_cnn_torch()  # conv + BatchNorm + pool + dropout + linear (digits_model.py)
ps = hf.connect(model)

# -- this worker's data and randomness ---------------------------------------------
train = ps.job.train
x, y = load_site(ps.job.sites[ps.site].data, ps.site_rank, ps.workers_at_site)
x, y = torch.from_numpy(x), torch.from_numpy(y)
x_test, y_test = (torch.from_numpy(a) for a in load_test())
# the same weights everywhere (seeded above), but each worker its own batches and dropout masks:
# seed by rank after connect (and by step, so a restarted worker draws anew)
seed = train.seed + 1000 * ps.rank + ps.step_count
torch.manual_seed(seed)
rng = np.random.default_rng(seed)


def accuracy() -> float:
    model.eval()  # running statistics, no dropout
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    model.train()
    return acc


# -- the training loop -------------------------------------------------------------
for step in range(ps.step_count, train.steps):
    batch = torch.from_numpy(rng.integers(0, len(x), train.batch_size))
    loss = F.cross_entropy(model(x[batch]), y[batch])
    ps.zero_grad()
    loss.backward()
    ps.step()
    if train.eval_every_steps and (step + 1) % train.eval_every_steps == 0:
        ps.report(loss=round(loss.item(), 5), test_accuracy=round(accuracy(), 5))

ps.report(final=True, test_accuracy=accuracy(), train_rows=len(x))  # rank 0 saves exactly this model
ps.close()
