"""Sharding plan: balanced, deterministic, split/join round-trips, bad input named."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest

from hybridfleet.ps.wire.sharding import Block, ParamSpec, ShardingPlan

MIB = 1024 * 1024


def _transformer_params(num_layers: int = 12, hidden: int = 768, vocab: int = 30522) -> list[ParamSpec]:
    """A BERT-base-like parameter list: one huge embedding, many mid-sized and tiny tensors."""
    params = [
        ParamSpec("embeddings.word.weight", (vocab, hidden)),
        ParamSpec("embeddings.position.weight", (512, hidden)),
        ParamSpec("embeddings.norm.weight", (hidden,)),
        ParamSpec("embeddings.norm.bias", (hidden,)),
        ParamSpec("pooler.weight", (hidden, hidden)),
        ParamSpec("pooler.bias", (hidden,)),
        ParamSpec("logit_scale", ()),
    ]
    for i in range(num_layers):
        prefix = f"encoder.layer.{i}"
        for proj in ("query", "key", "value", "output"):
            params += [ParamSpec(f"{prefix}.attention.{proj}.weight", (hidden, hidden)),
                       ParamSpec(f"{prefix}.attention.{proj}.bias", (hidden,))]
        params += [
            ParamSpec(f"{prefix}.ffn.in.weight", (4 * hidden, hidden)),
            ParamSpec(f"{prefix}.ffn.in.bias", (4 * hidden,)),
            ParamSpec(f"{prefix}.ffn.out.weight", (hidden, 4 * hidden)),
            ParamSpec(f"{prefix}.ffn.out.bias", (hidden,)),
            ParamSpec(f"{prefix}.norm.weight", (hidden,)),
            ParamSpec(f"{prefix}.norm.bias", (hidden,)),
        ]
    return params


@pytest.mark.parametrize(("num_shards", "block_size_bytes"), [(2, 4 * MIB), (3, 4 * MIB), (4, 1 * MIB), (7, 3 * MIB + 5)])
def test_shard_loads_differ_by_at_most_one_block_for_a_transformer(num_shards, block_size_bytes):
    # Prepare
    params = _transformer_params()

    # Execute
    plan = ShardingPlan.build(params, num_shards, block_size_bytes)

    # Assert
    loads = plan.shard_bytes()
    assert max(loads) - min(loads) <= block_size_bytes
    assert sum(loads) == sum(p.nbytes for p in params)
    assert all(b.numel * 4 <= block_size_bytes for b in plan.blocks)


def test_tensor_above_block_size_is_split_into_contiguous_ranges_on_several_shards():
    # Prepare
    big = ParamSpec("emb.weight", (1000, 100))  # 400 000 bytes
    small = ParamSpec("fc.bias", (10,))

    # Execute
    plan = ShardingPlan.build([big, small], num_shards=4, block_size_bytes=64 * 1024)

    # Assert
    blocks = plan.blocks_of("emb.weight")
    assert len(blocks) == -(-big.nbytes // (64 * 1024))
    assert [b.key for b in blocks] == [f"emb.weight#{i}" for i in range(len(blocks))]
    assert blocks[0].start == 0 and blocks[-1].stop == big.numel
    assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:]))
    assert len({b.shard for b in blocks}) == 4
    assert plan.blocks_of("fc.bias") == [Block("fc.bias", "fc.bias", plan.block("fc.bias").shard, 0, 10)]


def test_tensor_of_exactly_the_block_size_stays_whole():
    plan = ShardingPlan.build([ParamSpec("w", (256,))], num_shards=2, block_size_bytes=1024)
    assert [b.key for b in plan.blocks] == ["w"]


def test_shuffled_input_order_gives_the_same_plan():
    # Prepare
    params = _transformer_params(num_layers=4)
    shuffled = list(params)
    random.Random(7).shuffle(shuffled)

    # Execute
    plan_a = ShardingPlan.build(params, 3, 2 * MIB)
    plan_b = ShardingPlan.build(shuffled, 3, 2 * MIB)

    # Assert
    assert plan_a.to_json() == plan_b.to_json()
    assert plan_a.digest() == plan_b.digest()
    assert plan_a.blocks == plan_b.blocks


def test_plan_digest_is_the_same_in_processes_with_different_hash_seeds():
    # Prepare
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_ps_sharding as t; "
        "from hybridfleet.ps.wire.sharding import ShardingPlan; "
        "print(ShardingPlan.build(t._transformer_params(num_layers=2), 3, 1 << 20).digest())"
    )
    here = os.path.dirname(__file__)
    expected = ShardingPlan.build(_transformer_params(num_layers=2), 3, 1 << 20).digest()

    # Execute
    digests = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", code, here], capture_output=True, text=True,
                             check=True, env=env)
        digests.append(out.stdout.strip())

    # Assert
    assert digests == [expected, expected]


def test_different_inputs_give_a_different_digest():
    params = [ParamSpec("w", (100, 100)), ParamSpec("b", (100,))]
    base = ShardingPlan.build(params, 2, 8192)
    assert ShardingPlan.build(params, 3, 8192).digest() != base.digest()
    assert ShardingPlan.build(params, 2, 4096).digest() != base.digest()
    assert ShardingPlan.build([ParamSpec("w", (100, 101)), params[1]], 2, 8192).digest() != base.digest()


@pytest.mark.parametrize("name", ["emb.weight", "fc.bias", "scale"])
def test_split_then_join_round_trips_values_and_shape(name):
    # Prepare
    params = [ParamSpec("emb.weight", (50, 33)), ParamSpec("fc.bias", (7,)), ParamSpec("scale", ())]
    plan = ShardingPlan.build(params, num_shards=3, block_size_bytes=1024)
    values = np.arange(plan.params[name].numel, dtype=np.float32).reshape(plan.params[name].shape) * 0.5

    # Execute
    parts = plan.split(name, values)
    joined = plan.join(name, parts)

    # Assert
    assert sorted(parts) == sorted(b.key for b in plan.blocks_of(name))
    assert all(p.ndim == 1 for p in parts.values())
    assert joined.shape == plan.params[name].shape
    np.testing.assert_array_equal(joined, values)


def test_split_of_a_contiguous_array_returns_views():
    # Prepare
    plan = ShardingPlan.build([ParamSpec("w", (64, 8))], num_shards=2, block_size_bytes=512)
    values = np.zeros((64, 8), dtype=np.float32)

    # Execute: writing through the parts writes the tensor
    for part in plan.split("w", values).values():
        part += 1

    # Assert
    assert len(plan.blocks_of("w")) == 4
    assert (values == 1).all()


def test_scalar_parameter_is_one_block_of_one_element():
    plan = ShardingPlan.build([ParamSpec("temperature", ())], num_shards=2, block_size_bytes=1024)
    assert plan.blocks == [Block("temperature", "temperature", 0, 0, 1)]
    assert plan.shard_bytes() == [4, 0]


def test_json_round_trip_gives_an_equal_plan():
    # Prepare
    plan = ShardingPlan.build(_transformer_params(num_layers=2) + [ParamSpec("ids", (3,), "int64")], 3, MIB)

    # Execute
    again = ShardingPlan.from_json(plan.to_json())

    # Assert
    assert again == plan
    assert again.digest() == plan.digest()
    assert again.blocks_for_shard(2) == plan.blocks_for_shard(2)
    assert again.params["ids"].dtype == "int64"


def test_blocks_for_shard_partition_all_blocks():
    plan = ShardingPlan.build(_transformer_params(num_layers=2), 4, MIB)
    per_shard = [plan.blocks_for_shard(s) for s in range(4)]
    assert sorted((b.key for blocks in per_shard for b in blocks)) == sorted(b.key for b in plan.blocks)
    assert all(b.shard == s for s, blocks in enumerate(per_shard) for b in blocks)


@pytest.mark.parametrize("num_shards", [0, -1])
def test_fewer_than_one_shard_is_refused(num_shards):
    with pytest.raises(ValueError) as err:
        ShardingPlan.build([ParamSpec("w", (3,))], num_shards, 1024)
    assert f"num_shards: must be an integer >= 1 (got {num_shards})" in str(err.value)


def test_duplicate_parameter_names_are_refused():
    with pytest.raises(ValueError) as err:
        ShardingPlan.build([ParamSpec("w", (3,)), ParamSpec("b", (2,)), ParamSpec("w", (4,))], 2, 1024)
    assert "params: duplicate parameter names ['w']" in str(err.value)


def test_block_size_below_one_element_is_refused():
    with pytest.raises(ValueError) as err:
        ShardingPlan.build([ParamSpec("w", (3,), "float64")], 2, 4)
    assert "block_size_bytes: must be an integer >= 8 (one element) (got 4)" in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(name="w", shape=(3, -1)), "parameter 'w': shape dimensions must be >= 0 (got (3, -1))"),
        (dict(name="w", shape=(3,), dtype="float8"), "parameter 'w': dtype must be one of"),
        (dict(name="w#0", shape=(3,)), "parameter 'w#0': names may not contain '#'"),
        (dict(name="", shape=(3,)), "parameter name: must be a non-empty string"),
        (dict(name="w", shape="3x4"), "parameter 'w': shape must be a sequence of integers"),
    ],
)
def test_bad_param_spec_is_refused_with_the_problem_named(kwargs, message):
    with pytest.raises(ValueError) as err:
        ParamSpec(**kwargs)
    assert message in str(err.value)


def test_split_with_the_wrong_number_of_elements_is_refused():
    plan = ShardingPlan.build([ParamSpec("w", (4, 4))], 2, 1024)
    with pytest.raises(ValueError) as err:
        plan.split("w", np.zeros(15, dtype=np.float32))
    assert "split 'w': got 15 elements, the parameter has 16 (shape (4, 4))" in str(err.value)


def test_join_with_a_missing_or_short_block_is_refused():
    # Prepare
    plan = ShardingPlan.build([ParamSpec("w", (64,))], 2, 128)
    parts = plan.split("w", np.zeros(64, dtype=np.float32))

    # Execute / Assert: a missing block
    with pytest.raises(ValueError) as err:
        plan.join("w", {k: v for k, v in parts.items() if k != "w#1"})
    assert "join 'w': missing blocks ['w#1'], unexpected []" in str(err.value)

    # Execute / Assert: a block of the wrong length
    with pytest.raises(ValueError) as err:
        plan.join("w", {**parts, "w#0": parts["w#0"][:-1]})
    assert "join 'w': block 'w#0' has 31 elements, expected 32" in str(err.value)


def test_unknown_parameter_and_shard_are_refused():
    plan = ShardingPlan.build([ParamSpec("w", (4,))], 2, 1024)
    with pytest.raises(ValueError) as err:
        plan.blocks_of("v")
    assert "unknown parameter 'v'" in str(err.value)
    with pytest.raises(ValueError) as err:
        plan.blocks_for_shard(2)
    assert "shard: must be an integer in [0, 2) (got 2)" in str(err.value)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda doc: doc.replace('"version":1', '"version":9'), "version 9 is not supported"),
        (lambda doc: doc[:-3], "sharding plan JSON: malformed"),
        (lambda doc: doc.replace('["w#1","w",1,32,64]', '["w#1","w",1,33,64]'),
         "block 'w#1' covers [33, 64) but the next range of 'w' starts at 32"),
        (lambda doc: doc.replace('["w#1","w",1,32,64]', '["w#1","w",5,32,64]'),
         "block 'w#1' is on shard 5, outside [0, 2)"),
    ],
)
def test_malformed_or_inconsistent_plan_json_is_refused(mutate, message):
    # Prepare
    doc = ShardingPlan.build([ParamSpec("w", (64,))], 2, 128).to_json()
    assert '["w#1","w",1,32,64]' in doc

    # Execute
    with pytest.raises(ValueError) as err:
        ShardingPlan.from_json(mutate(doc))

    # Assert
    assert message in str(err.value)


def test_plan_json_with_a_short_block_entry_is_refused():
    doc = ShardingPlan.build([ParamSpec("w", (64,))], 2, 128).to_json().replace('["w#1","w",1,32,64]', '["w#1",1]')
    with pytest.raises(ValueError) as err:
        ShardingPlan.from_json(doc)
    assert "sharding plan JSON: malformed (ValueError: not enough values to unpack" in str(err.value)
