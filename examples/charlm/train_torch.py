"""Train a character-level transformer on Python's own source with PyTorch, jointly across sites.

    python examples/charlm/pack_sites.py         # once: writes examples/charlm/data/{site-a,site-b,all}
    hfleet run examples/charlm-hybrid.yaml       # hospital + cloud, with each site alone for comparison
    hfleet run examples/charlm-alone.yaml        # the same script alone on all the data (both sites' rows)

Each worker trains on its own site's windows only; `ps.step()` sends gradients and brings
back the job's parameters. The shards apply this script's AdamW, its two parameter groups
(no weight decay on biases, LayerNorms and embeddings) and, at every step, the learning
rate of its warmup + cosine schedule. The metric is held-out bits per character
(``test_bpc``: mean cross-entropy in nats / ln 2, on packages no site holds; lower is better).
Started without a parameter server (no HFLEET_SERVERS), the same script trains alone.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F
from charlm_args import parse_args
from charlm_data import load_site, load_test, sample_batch
from charlm_model import build_torch
from charlm_optim import torch_optimizer, torch_schedule

import hybridfleet.torch as hf

torch.set_num_threads(1)

args = parse_args()  # charlm_args.py: --layers --d-model --heads --context, optimizer and eval sizes

# -- the model and its optimizer -----------------------------------------------------------
model = build_torch(args.layers, args.d_model, args.context, args.heads)  # every worker: the same seeded weights
optimizer = torch_optimizer(model, args.lr, args.weight_decay)  # AdamW: no decay on biases, norms, embeddings
ps = hf.connect(model, optimizer)  # the shards apply this AdamW, its groups and each step's learning rate

train = ps.job.train
schedule = torch_schedule(optimizer, train.steps, args.warmup_steps, args.min_lr_ratio)  # warmup, then cosine
for _ in range(ps.step_count):  # a restarted worker resumes the schedule where the job is
    schedule.step()

# -- this worker's data --------------------------------------------------------------------
rows = load_site(ps.job.sites[ps.site].data, ps.site_rank, ps.workers_at_site)
test = torch.from_numpy(load_test(args.context, args.test_bytes).astype(np.int64))
rng = np.random.default_rng(train.seed + 1000 * ps.rank + ps.step_count)  # each worker its own batches


def bits_per_char() -> float:
    """Mean cross-entropy over every held-out position, in bits."""
    with torch.no_grad():
        nats = sum(F.cross_entropy(model(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
                   for w in test.split(64))
    return nats / (test.shape[0] * (test.shape[1] - 1)) / math.log(2)


# -- the training loop ---------------------------------------------------------------------
for step in range(ps.step_count, train.steps):
    batch = torch.from_numpy(sample_batch(rows, train.batch_size, args.context, rng))
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    ps.zero_grad()
    loss.backward()
    ps.step()
    lr = schedule.get_last_lr()[0]  # the rate the shards applied on this step
    schedule.step()
    if train.eval_every_steps and (step + 1) % train.eval_every_steps == 0:
        ps.report(loss=round(loss.item(), 5), test_bpc=round(bits_per_char(), 5), lr=lr)

ps.report(final=True, test_bpc=bits_per_char(), train_rows=len(rows))  # rank 0 saves exactly this model
ps.close()
