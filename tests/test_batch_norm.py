"""BatchNorm against torch.nn.BatchNorm1d / BatchNorm2d, in both storage modes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqx_state as es


def _torch_bn(shape, **kw):
    cls = torch.nn.BatchNorm1d if len(shape) == 2 else torch.nn.BatchNorm2d
    return cls(shape[1], **kw)


def _run(mode, bn, x):
    if mode == "ref":
        return bn(x), bn
    return es.apply(lambda m, x: m(x), bn, x)


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("shape", [(8, 5), (6, 4, 3, 3)])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("affine", [True, False])
def test_matches_torch(mode, shape, momentum, affine):
    rng = np.random.default_rng(0)
    tbn = _torch_bn(shape, momentum=momentum, affine=affine)
    bn = es.nn.BatchNorm(shape[1], momentum=momentum, affine=affine)
    if affine:  # non-trivial affine parameters, the same in both
        w = rng.normal(size=shape[1]).astype(np.float32)
        b = rng.normal(size=shape[1]).astype(np.float32)
        with torch.no_grad():
            tbn.weight.copy_(torch.from_numpy(w))
            tbn.bias.copy_(torch.from_numpy(b))
        bn = eqx.tree_at(
            lambda m: (m.weight, m.bias), bn, (jnp.asarray(w), jnp.asarray(b))
        )
    if mode == "ref":
        bn = es.to_refs(bn)
    tbn.train()
    for step in range(4):
        x = (rng.normal(size=shape) * (step + 1) + step).astype(np.float32)
        y, bn = _run(mode, bn, jnp.asarray(x))
        ty = tbn(torch.from_numpy(x)).detach().numpy()
        np.testing.assert_allclose(np.asarray(y), ty, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            np.asarray(bn.running_mean[...]),
            tbn.running_mean.numpy(),
            rtol=1e-5,
            atol=1e-6,
        )
        np.testing.assert_allclose(
            np.asarray(bn.running_var[...]),
            tbn.running_var.numpy(),
            rtol=1e-5,
            atol=1e-6,
        )
        assert int(bn.num_batches_tracked[...]) == int(tbn.num_batches_tracked)
    # evaluation: running statistics, no writes, callable eagerly in value mode
    tbn.eval()
    ev = eqx.nn.inference_mode(bn)
    x = rng.normal(size=shape).astype(np.float32)
    before = np.asarray(bn.running_mean[...])
    np.testing.assert_allclose(
        np.asarray(ev(jnp.asarray(x))),
        tbn(torch.from_numpy(x)).detach().numpy(),
        rtol=1e-5,
        atol=1e-5,
    )
    np.testing.assert_array_equal(np.asarray(bn.running_mean[...]), before)


def test_no_running_stats_matches_torch():
    rng = np.random.default_rng(1)
    tbn = torch.nn.BatchNorm1d(3, track_running_stats=False)
    bn = es.nn.BatchNorm(3, track_running_stats=False)
    assert bn.running_mean is None and not jax.tree_util.tree_leaves(
        bn, is_leaf=es.is_state
    ).count(None)
    for train in (True, False):
        x = rng.normal(size=(7, 3)).astype(np.float32)
        tbn.train(train)
        m = bn if train else eqx.nn.inference_mode(bn)
        np.testing.assert_allclose(
            np.asarray(m(jnp.asarray(x))),
            tbn(torch.from_numpy(x)).detach().numpy(),
            rtol=1e-5,
            atol=1e-5,
        )


def test_channels_last_axis():
    x = jax.random.normal(jax.random.key(0), (4, 5, 5, 3))
    bn_last = es.nn.BatchNorm(3, channel_axis=-1)
    bn_first = es.nn.BatchNorm(3)
    y_last, bn_last = es.apply(lambda m, x: m(x), bn_last, x)
    y_first, bn_first = es.apply(lambda m, x: m(x), bn_first, jnp.moveaxis(x, -1, 1))
    np.testing.assert_allclose(
        np.moveaxis(np.asarray(y_last), -1, 1), y_first, atol=1e-6
    )
    np.testing.assert_allclose(bn_last.running_var[...], bn_first.running_var[...])


def test_wrong_channels_is_a_clear_error():
    bn = es.to_refs(es.nn.BatchNorm(4))
    with pytest.raises(
        ValueError, match=r"BatchNorm\(4\) got an input of shape \(2, 3\)"
    ):
        bn(jnp.ones((2, 3)))


def test_single_example_in_training_is_a_clear_error():
    bn = es.to_refs(es.nn.BatchNorm(4, channel_axis=0))
    with pytest.raises(ValueError, match="batch statistics need a batch"):
        bn(jnp.ones(4))


def test_bad_momentum():
    with pytest.raises(ValueError, match="momentum must be in"):
        es.nn.BatchNorm(3, momentum=1.5)


def test_bfloat16_input_keeps_dtype_and_float32_stats():
    bn = es.nn.BatchNorm(3)
    x = jax.random.normal(jax.random.key(0), (8, 3)).astype(jnp.bfloat16)
    y, bn = es.apply(lambda m, x: m(x), bn, x)
    assert y.dtype == jnp.bfloat16
    assert bn.running_mean.dtype == jnp.float32
    np.testing.assert_allclose(
        bn.running_mean[...],
        0.1 * np.asarray(x, np.float32).mean(0),
        rtol=1e-5,
        atol=1e-6,
    )


def test_integer_input_fails_at_the_call():
    """Public layers are annotated with jaxtyping; in the tests beartype checks them,
    so a wrong dtype fails at the call with a readable message."""
    bn = es.to_refs(es.nn.BatchNorm(3))
    with pytest.raises(Exception, match=r"(?s)Type-check error.*BatchNorm"):
        bn(jnp.ones((4, 3), jnp.int32))
