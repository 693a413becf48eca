"""Error feedback beyond the shared identity: DGC momentum, warm-up, state, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from hybridfleet.codec import ErrorFeedback, get_codec, read_header
from hybridfleet.codec.sparse import kept_count

EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture
def rng():
    return np.random.default_rng(3)


def _grad(rng, shape=(20, 30), dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _velocity(feedback: ErrorFeedback, key: str) -> np.ndarray:
    return feedback.state_dict()[f"velocity/{key}"]


def test_momentum_correction_sends_the_accumulated_velocity_and_keeps_the_rest(rng):
    # Prepare
    momentum = 0.9
    feedback = ErrorFeedback(get_codec("topk", ratio=0.05), momentum=momentum)
    feedback.encode("w", _grad(rng))
    old_residual, old_velocity = feedback.residual("w"), _velocity(feedback, "w")
    grad = _grad(rng)

    # Execute
    decoded = get_codec("topk").decode(feedback.encode("w", grad))

    # Assert: u = m u + g; v = v + u; decoded + new v == old v + u
    expected = old_residual + (momentum * old_velocity + grad)
    np.testing.assert_allclose(decoded + feedback.residual("w"), expected, rtol=0, atol=4 * EPS32 * np.abs(expected).max())


def test_momentum_correction_clears_sent_coordinates_of_velocity_and_accumulation(rng):
    # Prepare
    feedback = ErrorFeedback(get_codec("topk", ratio=0.1), momentum=0.5)

    # Execute
    sent = get_codec("topk").decode_sparse(feedback.encode("w", _grad(rng))).indices

    # Assert
    assert sent.size and (feedback.residual("w").reshape(-1)[sent] == 0).all()
    assert (_velocity(feedback, "w").reshape(-1)[sent] == 0).all()
    unsent = np.setdiff1d(np.arange(600), sent)
    assert (_velocity(feedback, "w").reshape(-1)[unsent] != 0).all()


def test_warmup_lowers_density_exponentially_from_dense_to_the_ratio(rng):
    # Prepare
    ratio, warmup = 0.01, 4
    feedback = ErrorFeedback(get_codec("topk", ratio=ratio), warmup_steps=warmup)
    decoder = get_codec("topk")

    # Execute
    kept = [decoder.decode_sparse(feedback.encode("w", _grad(rng))).indices.size for _ in range(warmup + 2)]

    # Assert
    schedule = [feedback.ratio_at(step) for step in range(warmup + 2)]
    assert schedule[0] == 1.0 and schedule[warmup:] == [ratio, ratio]
    np.testing.assert_allclose(np.diff(np.log(schedule[: warmup + 1])), np.log(ratio) / warmup)
    assert kept == [kept_count(r, 600) for r in schedule]


def test_warmup_is_counted_per_key(rng):
    feedback = ErrorFeedback(get_codec("topk", ratio=0.01), warmup_steps=3)
    decoder = get_codec("topk")
    feedback.encode("a", _grad(rng))
    feedback.encode("a", _grad(rng))

    first_of_b = decoder.decode_sparse(feedback.encode("b", _grad(rng))).indices.size

    assert first_of_b == 600


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"momentum": 0.9}, ValueError, r"momentum correction needs a sparsifying codec \(topk, randomk\); got 'int8'"),
        ({"warmup_steps": 5}, ValueError, r"ratio warm-up needs a sparsifying codec \(topk, randomk\); got 'int8'"),
    ],
)
def test_momentum_and_warmup_need_a_sparse_codec(options, error, message):
    with pytest.raises(error, match=message):
        ErrorFeedback(get_codec("int8"), **options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"momentum": 1.0}, r"momentum must be a number in \[0, 1\) \(got 1.0\)"),
        ({"momentum": -0.1}, r"momentum must be a number in \[0, 1\) \(got -0.1\)"),
        ({"warmup_steps": -1}, r"warmup_steps must be an integer >= 0 \(got -1\)"),
        ({"warmup_steps": 2.5}, r"warmup_steps must be an integer >= 0 \(got 2.5\)"),
    ],
)
def test_bad_feedback_options_are_rejected_with_message(options, message):
    with pytest.raises(ValueError, match=message):
        ErrorFeedback(get_codec("topk"), **options)


def test_feedback_needs_a_codec():
    with pytest.raises(TypeError, match=r"ErrorFeedback wraps a Codec \(got str\)"):
        ErrorFeedback("topk")


def test_gradient_of_another_shape_is_rejected_and_state_unchanged(rng):
    # Prepare
    feedback = ErrorFeedback(get_codec("sign"))
    feedback.encode("w", _grad(rng))
    before = feedback.state_dict()

    # Execute / Assert
    with pytest.raises(ValueError, match=r"key 'w': gradient float32\[30, 20\] does not match the residual kept for it \(float32\[20, 30\]\)"):
        feedback.encode("w", _grad(rng, (30, 20)))
    after = feedback.state_dict()
    assert after.keys() == before.keys() and all(np.array_equal(after[k], before[k]) for k in before)


def test_non_finite_gradient_is_rejected_and_state_unchanged(rng):
    # Prepare
    feedback = ErrorFeedback(get_codec("topk", ratio=0.1), momentum=0.9)
    feedback.encode("w", _grad(rng))
    before = feedback.state_dict()
    grad = _grad(rng)
    grad[3, 4] = np.nan

    # Execute / Assert
    with pytest.raises(ValueError, match="cannot encode a gradient holding NaN or Inf"):
        feedback.encode("w", grad)
    after = feedback.state_dict()
    assert all(np.array_equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("key", ["", 3, None])
def test_key_must_be_a_non_empty_string(rng, key):
    with pytest.raises(TypeError, match="error-feedback key must be a non-empty string"):
        ErrorFeedback(get_codec("topk")).encode(key, _grad(rng))


def test_float16_gradient_travels_as_float16_and_keeps_the_identity(rng):
    # Prepare
    feedback = ErrorFeedback(get_codec("int8"))
    feedback.encode("w", _grad(rng, dtype=np.float16))
    old_residual = feedback.residual("w")
    grad = _grad(rng, dtype=np.float16)

    # Execute
    payload = feedback.encode("w", grad)

    # Assert: the payload keeps the dtype, the residual (float32) absorbs the rounding
    assert read_header(payload)[0].dtype == np.float16 and old_residual.dtype == np.float32
    decoded = get_codec("int8").decode(payload).astype(np.float32)
    expected = grad.astype(np.float32) + old_residual
    np.testing.assert_allclose(decoded + feedback.residual("w"), expected, rtol=0, atol=4 * EPS32 * np.abs(expected).max())


def test_float64_gradient_keeps_a_float64_residual(rng):
    feedback = ErrorFeedback(get_codec("topk", ratio=0.1))
    grad = _grad(rng, dtype=np.float64)
    decoded = get_codec("topk").decode(feedback.encode("w", grad))
    assert feedback.residual("w").dtype == np.float64
    np.testing.assert_allclose(decoded + feedback.residual("w"), grad, rtol=0, atol=4 * np.finfo(np.float64).eps * np.abs(grad).max())


def test_keys_keep_independent_residuals_and_reset_forgets_one(rng):
    # Prepare
    feedback = ErrorFeedback(get_codec("topk", ratio=0.1))
    feedback.encode("a", _grad(rng))
    feedback.encode("b", _grad(rng, (5,)))

    # Execute
    feedback.reset("a")

    # Assert
    assert feedback.keys() == ["b"] and feedback.residual("a") is None and feedback.residual("b").shape == (5,)
    feedback.encode("a", _grad(rng, (7,)))  # a reset key accepts a new shape


def test_loaded_state_continues_exactly_like_the_uninterrupted_run(rng):
    # Prepare
    make = lambda: ErrorFeedback(get_codec("topk", ratio=0.02), momentum=0.9, warmup_steps=4)  # noqa: E731
    grads = [{"w": _grad(rng), "b": _grad(rng, (9,))} for _ in range(5)]
    uninterrupted, first_half = make(), make()
    for step in grads[:2]:
        for key, grad in step.items():
            uninterrupted.encode(key, grad)
            first_half.encode(key, grad)

    # Execute
    resumed = make()
    resumed.load_state_dict(first_half.state_dict())

    # Assert
    for step in grads[2:]:
        for key, grad in step.items():
            assert resumed.encode(key, grad) == uninterrupted.encode(key, grad)


def _state(rng):
    feedback = ErrorFeedback(get_codec("topk", ratio=0.1), momentum=0.9)
    feedback.encode("w", _grad(rng))
    return feedback.state_dict()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.update({"bias": np.zeros(2)}), r"unknown entry 'bias' \(expected residual/, velocity/, q/ or step/<key>\)"),
        (lambda s: s.update({"residual/w": [0.0]}), r"'residual/w' must be a numpy array \(got list\)"),
        (lambda s: s.pop("step/w"), r"step/w must be a non-negative int64 array of shape \(1,\)"),
        (lambda s: s.pop("residual/w"), r"(velocity|step)/w has no residual/w"),
        (lambda s: s.update({"velocity/w": np.zeros(3, np.float32)}), r"velocity/w float32\[3\] does not match residual/w float32\[20, 30\]"),
        (lambda s: s.update({"residual/w": np.full((20, 30), np.inf, np.float32)}), r"residual/w must be finite float32 or float64"),
    ],
)
def test_inconsistent_state_is_rejected_and_current_state_kept(rng, edit, message):
    # Prepare
    feedback = ErrorFeedback(get_codec("topk", ratio=0.1), momentum=0.9)
    feedback.encode("kept", _grad(rng, (4,)))
    before = feedback.state_dict()
    state = _state(rng)
    edit(state)

    # Execute / Assert
    with pytest.raises(ValueError, match=message):
        feedback.load_state_dict(state)
    assert feedback.keys() == ["kept"] and np.array_equal(feedback.residual("kept"), before["residual/kept"])


def test_velocity_state_needs_momentum(rng):
    with pytest.raises(ValueError, match="error-feedback state holds velocities but momentum is off"):
        ErrorFeedback(get_codec("topk")).load_state_dict(_state(rng))


def test_keep_staged_drops_only_the_other_keys_staged_state():
    # Prepare: two keys with committed residuals, then both encoded again, staged
    ef = ErrorFeedback(get_codec("topk", ratio=0.25))
    rng = np.random.default_rng(3)
    for key in ("a", "b"):
        ef.encode(key, rng.standard_normal(16).astype(np.float32))
    before = {k: ef.residual(k) for k in ("a", "b")}
    staged_a = ef.encode("a", rng.standard_normal(16).astype(np.float32), stage=True)
    ef.encode("b", rng.standard_normal(16).astype(np.float32), stage=True)
    # Execute: only "a" was pushed
    dropped = ef.keep_staged({"a"})
    ef.commit()
    # Assert: "b" keeps its residual from before the dropped encoding, "a" took its staged one
    assert dropped == ["b"] and staged_a
    assert np.array_equal(ef.residual("b"), before["b"])
    assert not np.array_equal(ef.residual("a"), before["a"])
