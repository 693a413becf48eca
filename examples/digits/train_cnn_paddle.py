"""Train a small CNN with BatchNorm and dropout on the digits sites, through the parameter server (Paddle).

    hfleet run examples/digits-cnn-paddle.yaml
    hfleet registry export digits-cnn@prod --format paddle-inference --model examples/digits/digits_model.py:build_cnn_paddle -o out/digits-cnn-paddle

The script is an ordinary Paddle loop plus the three lines. BatchNorm's running statistics
(``_mean``/``_variance``) follow the job's ``ps.buffers`` (averaged over the sites by
default), so every worker evaluates, and rank 0 saves, the same model; the summary's joint
accuracy is that model's.
"""

import numpy as np
import paddle
import paddle.nn.functional as F
from digits_data import load_site, load_test
from digits_model import build_cnn_paddle

import hybridfleet.paddle as hf

paddle.set_device("cpu")

# -- the model ---------------------------------------------------------------
paddle.seed(0)  # every worker starts from the same weights
model = build_cnn_paddle()  # conv + BatchNorm + pool + dropout + linear (digits_model.py)
ps = hf.connect(model)

# -- this worker's data and randomness ---------------------------------------------
train = ps.job.train
x, y = load_site(ps.job.sites[ps.site].data, ps.site_rank, ps.workers_at_site)
x, y = paddle.to_tensor(x), paddle.to_tensor(y)
x_test, y_test = (paddle.to_tensor(a) for a in load_test())
# the same weights everywhere (seeded above), but each worker its own batches and dropout masks:
# seed by rank after connect (and by step, so a restarted worker draws anew)
seed = train.seed + 1000 * ps.rank + ps.step_count
paddle.seed(seed)
rng = np.random.default_rng(seed)


def accuracy() -> float:
    model.eval()  # running statistics, no dropout
    with paddle.no_grad():
        acc = float((model(x_test).argmax(1) == y_test).astype("float32").mean())
    model.train()
    return acc


# -- the training loop -------------------------------------------------------------
for step in range(ps.step_count, train.steps):
    batch = paddle.to_tensor(rng.integers(0, len(x), train.batch_size))
    loss = F.cross_entropy(model(paddle.gather(x, batch)), paddle.gather(y, batch))
    ps.zero_grad()
    loss.backward()
    ps.step()
    if train.eval_every_steps and (step + 1) % train.eval_every_steps == 0:
        ps.report(loss=round(float(loss), 5), test_accuracy=round(accuracy(), 5))

ps.report(final=True, test_accuracy=accuracy(), train_rows=len(x))  # rank 0 saves exactly this model
ps.close()
