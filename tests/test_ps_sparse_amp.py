"""Sparse embeddings and mixed precision through the parameter server.

Real TLS shards on 127.0.0.1, workers as threads of this process, real torch / paddle
models on both sides.
"""

from __future__ import annotations

import pytest

import script_optim_helpers as h


@pytest.fixture
def shards(tmp_path):
    started = []

    def start(framework: str, workers: int = 1, shards: int = 1, **ps):
        s = h.start_shards(tmp_path, h.job(framework, workers, shards, **ps))
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


# ------------------------------------------------------------------------------------ sparse embeddings
@pytest.mark.torch
def test_connect_refuses_a_torch_sparse_embedding_naming_it_and_the_fix_before_joining(shards):
    import torch

    import hybridfleet.torch as hf
    from hybridfleet.errors import SpecError

    cluster = shards("torch")
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    with pytest.raises(SpecError, match=r"parameter '0\.weight' has sparse gradients: '0\.weight' "
                                        r"\(nn\.Embedding\(sparse=True\)\); the parameter server pushes dense "
                                        r"gradients: build the embedding with sparse=False"):
        hf.connect(m, torch.optim.SGD(m.parameters(), lr=0.1), config=cluster.config(0))
    status = cluster.status()[0]
    assert status["members"] == {} and not status["initialized"]


@pytest.mark.paddle
def test_connect_refuses_a_paddle_sparse_embedding_naming_it_and_the_fix_before_joining(shards):
    import paddle

    import hybridfleet.paddle as hf
    from hybridfleet.errors import SpecError

    class Net(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.emb = paddle.nn.Embedding(10, 4, sparse=True)
            self.fc = paddle.nn.Linear(4, 2)

    cluster = shards("paddle")
    m = Net()
    with pytest.raises(SpecError, match=r"parameter 'emb\.weight' has sparse gradients: 'emb\.weight' "
                                        r"\(nn\.Embedding\(sparse=True\)\); .*build the embedding with sparse=False"):
        hf.connect(m, config=cluster.config(0))
    status = cluster.status()[0]
    assert status["members"] == {} and not status["initialized"]


@pytest.mark.torch
def test_a_dense_torch_embedding_still_joins(shards):
    import torch

    import hybridfleet.torch as hf

    cluster = shards("torch")
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    ps = hf.connect(m, torch.optim.SGD(m.parameters(), lr=0.1), config=cluster.config(0))
    ps.close()
    assert cluster.status()[0]["initialized"]
