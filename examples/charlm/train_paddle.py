"""Train a character-level transformer on Python's own source with PaddlePaddle, jointly across sites.

    python examples/charlm/pack_sites.py              # once: writes examples/charlm/data/{site-a,site-b,all}
    hfleet run examples/charlm-hybrid-paddle.yaml     # hospital + cloud, with each site alone for comparison
    hfleet run examples/charlm-alone-paddle.yaml      # the same script alone on all the data (both sites' rows)

Each worker trains on its own site's windows only; `ps.step()` sends gradients and brings
back the job's parameters. The shards apply this script's AdamW (weight decay only where
``apply_decay_param_fun`` says: Linear weights, not biases, LayerNorms or embeddings) and, at
every step, the learning rate of its ``LinearWarmup(CosineAnnealingDecay)`` schedule. The
metric is held-out bits per character (``test_bpc``: mean cross-entropy in nats / ln 2, on
packages no site holds; lower is better). Started without a parameter server (no
HFLEET_SERVERS), the same script trains alone.
"""

import math

import numpy as np
import paddle
import paddle.nn.functional as F
from charlm_args import parse_args
from charlm_data import load_site, load_test, sample_batch
from charlm_model import build_paddle
from charlm_optim import paddle_optimizer, paddle_schedule

import hybridfleet.paddle as hf

paddle.set_device("cpu")

args = parse_args()  # charlm_args.py: --layers --d-model --heads --context, optimizer and eval sizes

# -- the model and its optimizer -----------------------------------------------------------
model = build_paddle(args.layers, args.d_model, args.context, args.heads)  # every worker: the same seeded weights
optimizer = paddle_optimizer(model, args.lr, args.weight_decay)  # AdamW: no decay on biases, norms, embeddings
ps = hf.connect(model, optimizer)  # the shards apply this AdamW, its decay rule and each step's learning rate

train = ps.job.train
# the schedule needs the job's train.steps, known once connected; the shards read get_lr() at every step
schedule = paddle_schedule(args.lr, train.steps, args.warmup_steps, args.min_lr_ratio)  # warmup, then cosine
optimizer.set_lr_scheduler(schedule)
for _ in range(ps.step_count):  # a restarted worker resumes the schedule where the job is
    schedule.step()

# -- this worker's data --------------------------------------------------------------------
rows = load_site(ps.job.sites[ps.site].data, ps.site_rank, ps.workers_at_site)
test = paddle.to_tensor(load_test(args.context, args.test_bytes).astype(np.int64))
rng = np.random.default_rng(train.seed + 1000 * ps.rank + ps.step_count)  # each worker its own batches


def bits_per_char() -> float:
    """Mean cross-entropy over every held-out position, in bits."""
    nats = 0.0
    with paddle.no_grad():
        for i in range(0, test.shape[0], 64):
            w = test[i:i + 64]
            nats += float(F.cross_entropy(model(w[:, :-1]).reshape([-1, 256]), w[:, 1:].reshape([-1]),
                                          reduction="sum"))
    return nats / (test.shape[0] * (test.shape[1] - 1)) / math.log(2)


# -- the training loop ---------------------------------------------------------------------
for step in range(ps.step_count, train.steps):
    batch = paddle.to_tensor(sample_batch(rows, train.batch_size, args.context, rng))
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape([-1, 256]), batch[:, 1:].reshape([-1]))
    ps.zero_grad()
    loss.backward()
    ps.step()
    lr = optimizer.get_lr()  # the rate the shards applied on this step
    schedule.step()
    if train.eval_every_steps and (step + 1) % train.eval_every_steps == 0:
        ps.report(loss=round(float(loss), 5), test_bpc=round(bits_per_char(), 5), lr=lr)

ps.report(final=True, test_bpc=bits_per_char(), train_rows=len(rows))  # rank 0 saves exactly this model
ps.close()
