"""Train a small ResNet with BatchNorm on Fashion-MNIST with Paddle, jointly across two sites.

    python examples/fashion/pack_sites.py                  # once: writes examples/fashion/data/site-{a,b,all}
    hfleet run examples/fashion-hybrid-paddle.yaml         # joint; summary.json has each site alone too
    hfleet run examples/fashion-alone-paddle.yaml          # the same script alone on all the data

Each worker trains on its own site's rows only (the sites differ in classes and in scanner
brightness, see fashion_data.py); `ps.step()` sends gradients and brings back the job's
parameters. The shards apply this script's Momentum optimizer with L2 weight decay at the
learning rate its cosine schedule (``paddle.optimizer.lr``) gives each step; BatchNorm's
running statistics (``_mean``/``_variance``) follow the job's ``ps.buffers`` (averaged by
default), so every worker evaluates, and rank 0 saves, the same model. Started without a
parameter server (no HFLEET_SERVERS), the same script trains alone on one site's data.

Options (the job's ``args:``, see fashion_model.train_args): ``--width`` (16: 0.30M parameters), ``--lr``,
``--momentum``, ``--weight-decay``, ``--test-rows``.
"""

import numpy as np
import paddle
import paddle.nn.functional as F
from fashion_data import load_site, load_test
from fashion_model import build_paddle, train_args

import hybridfleet.paddle as hf

paddle.set_device("cpu")

args = train_args()  # --width, --lr, --momentum, --weight-decay, --test-rows

# -- the model and its optimizer -----------------------------------------------------
paddle.seed(0)  # every worker starts from the same weights
model = build_paddle(args.width)  # fashion_model.py: the same code `hfleet registry export` loads
optimizer = paddle.optimizer.Momentum(learning_rate=args.lr, momentum=args.momentum, parameters=model.parameters(),
                                      weight_decay=args.weight_decay)
ps = hf.connect(model, optimizer)  # the shards apply this Momentum, at the schedule's learning rate each step
train = ps.job.train
scheduler = paddle.optimizer.lr.CosineAnnealingDecay(args.lr, T_max=train.steps)
optimizer.set_lr_scheduler(scheduler)  # the schedule needs the job's step count, known after connect
for _ in range(ps.step_count):  # a restarted worker resumes the schedule where the job is
    scheduler.step()

# -- this worker's data and randomness ------------------------------------------------
x, y = load_site(ps.job.sites[ps.site].data, ps.site_rank, ps.workers_at_site)
x_test, y_test = (paddle.to_tensor(a) for a in load_test(args.test_rows))
# the same weights everywhere (seeded above), but each worker its own batches and flips:
# seed by rank after connect (and by step, so a restarted worker draws anew)
seed = train.seed + 1000 * ps.rank + ps.step_count
paddle.seed(seed)
rng = np.random.default_rng(seed)


def accuracy() -> float:
    model.eval()  # BatchNorm's running statistics
    with paddle.no_grad():
        correct = sum(int((model(xb).argmax(1) == yb).astype("int64").sum())
                      for xb, yb in zip(paddle.split(x_test, _chunks(len(y_test))),
                                        paddle.split(y_test, _chunks(len(y_test)))))
    model.train()
    return correct / len(y_test)


def _chunks(n: int, size: int = 1000) -> list[int]:
    return [size] * (n // size) + ([n % size] if n % size else [])


# -- the training loop ---------------------------------------------------------------
for step in range(ps.step_count, train.steps):
    batch = rng.integers(0, len(x), train.batch_size)
    flip = rng.random(len(batch)) < 0.5
    images = np.where(flip[:, None, None, None], x[batch][..., ::-1], x[batch])  # random horizontal flip
    loss = F.cross_entropy(model(paddle.to_tensor(images)), paddle.to_tensor(y[batch]))
    ps.zero_grad()
    loss.backward()
    ps.step()  # instead of optimizer.step()
    scheduler.step()
    if train.eval_every_steps and (step + 1) % train.eval_every_steps == 0:
        ps.report(loss=round(float(loss), 5), test_accuracy=round(accuracy(), 5), lr=scheduler.get_lr())

ps.report(final=True, test_accuracy=accuracy(), train_rows=len(x))  # rank 0 saves exactly this model
ps.close()
