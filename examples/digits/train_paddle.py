"""Train a digits classifier with PaddlePaddle, jointly across sites through the parameter server.

    hfleet run examples/digits-hybrid-paddle.yaml

Each worker trains on its own site's rows only; `ps.step()` sends gradients and
brings back the job's parameters. Started without a parameter server (no
HFLEET_SERVERS), the same script trains alone on one site's data.
"""

import argparse

import numpy as np
import paddle
import paddle.nn.functional as F
from digits_data import load_site, load_test
from digits_model import build_paddle

import hybridfleet.paddle as hf

paddle.set_device("cpu")

parser = argparse.ArgumentParser()
parser.add_argument("--hidden", default="128", help="hidden layer widths, e.g. 2048,512 for a 1.2M-parameter model")
parser.add_argument("--lr", type=float, default=0.003, help="Adam learning rate (unless the job sets ps.optimizer)")
args = parser.parse_args()

# -- the model ---------------------------------------------------------------
paddle.seed(0)  # every worker starts from the same weights
model = build_paddle(args.hidden)  # digits_model.py: the same code `hfleet registry export` loads

# the shards apply this Adam (a ps.optimizer in the job file overrides it); with ps.sync: local it takes the inner steps
optimizer = paddle.optimizer.Adam(learning_rate=args.lr, parameters=model.parameters())
ps = hf.connect(model, optimizer)

# -- this worker's data ---------------------------------------------------------
train = ps.job.train
x, y = load_site(ps.job.sites[ps.site].data, ps.site_rank, ps.workers_at_site)
x, y = paddle.to_tensor(x), paddle.to_tensor(y)
x_test, y_test = (paddle.to_tensor(a) for a in load_test())
# every worker starts from the same weights (seeded above), but draws its own batches, dropout
# masks and augmentation: seed by rank after connect (and by step, so a restarted worker draws anew)
seed = train.seed + 1000 * ps.rank + ps.step_count
paddle.seed(seed)
rng = np.random.default_rng(seed)


def accuracy() -> float:
    with paddle.no_grad():
        return float((model(x_test).argmax(1) == y_test).astype("float32").mean())


# -- the training loop -------------------------------------------------------------
for step in range(ps.step_count, train.steps):
    batch = paddle.to_tensor(rng.integers(0, len(x), train.batch_size))
    loss = F.cross_entropy(model(paddle.gather(x, batch)), paddle.gather(y, batch))
    ps.zero_grad()
    loss.backward()
    ps.step()
    if train.eval_every_steps and (step + 1) % train.eval_every_steps == 0:
        ps.report(loss=round(float(loss), 5), test_accuracy=round(accuracy(), 5))

ps.scan_egress(x)  # only with `hfleet run --egress-scan`: were any of these rows sent?
ps.report(final=True, test_accuracy=accuracy(), train_rows=len(x))
ps.close()
