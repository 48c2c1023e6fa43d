"""BatchNorm against torch.nn.BatchNorm1d / BatchNorm2d, in both storage modes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest
import torch

import eqx_state as es


def _torch_bn(shape, **kw):
    cls = torch.nn.BatchNorm1d if len(shape) in (2, 3) else torch.nn.BatchNorm2d
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


def test_single_example_with_the_default_channel_axis_is_the_documented_error():
    """`[C]` with the default `channel_axis=1` used to get the channel-axis message
    ("got an input of shape (3,) ... expected 3 channels on that axis"), which
    contradicts itself; it is the single-example error of docs/misuse.md, however
    the example reaches the layer, and nothing is written."""
    x = jnp.arange(12.0).reshape(4, 3)
    ref = es.to_refs(es.nn.BatchNorm(3))
    calls = {
        "ref mode": lambda: ref(x[0]),
        "es.apply": lambda: es.apply(lambda m, x: m(x[0]), es.nn.BatchNorm(3), x),
        "jax.vmap": lambda: es.apply(lambda m, x: jax.vmap(m)(x), ref, x),
        "es.vmap": lambda: es.apply(lambda m, x: es.vmap(m)(x), ref, x),
    }
    for name, f in calls.items():
        with pytest.raises(ValueError) as info:
            f()
        msg = str(info.value)
        assert "single example of shape (3,) in training mode" in msg, name
        assert "axis_name=name" in msg and "channel_axis=0" in msg, name
        assert "channels on that axis" not in msg, name
    assert int(ref.num_batches_tracked[...]) == 0
    np.testing.assert_array_equal(ref.running_mean[...], np.zeros(3))
    # in evaluation with running statistics a 1-d input needs channel_axis=0: the
    # message says the axis does not exist, not that it has the wrong size
    with pytest.raises(ValueError, match=r"shape \(3,\), which has no axis 1") as info:
        eqx.nn.inference_mode(es.nn.BatchNorm(3))(x[0])
    assert "one example [C] (per-example code) needs channel_axis=0" in str(info.value)
    # a batch with the wrong number of channels still says how many it found
    with pytest.raises(ValueError, match=r"expected 3 channels on that axis, found 4"):
        ref(jnp.ones((2, 4)))


def test_bad_momentum():
    with pytest.raises(ValueError, match="momentum must be in"):
        es.nn.BatchNorm(3, momentum=1.5)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"num_features": 2.5}, TypeError, "num_features .* must be an int"),
        ({"num_features": True}, TypeError, "must be an int, got True"),
        ({"num_features": "3"}, TypeError, "must be an int, got '3'"),
        ({"num_features": 0}, ValueError, "must be >= 1, got 0"),
        ({"num_features": 3, "eps": -1.0}, ValueError, "eps must be non-neg"),
        ({"num_features": 3, "eps": "1"}, TypeError, "eps must be a real number"),
        ({"num_features": 3, "momentum": "a"}, TypeError, "momentum must"),
        ({"num_features": 3, "channel_axis": 1.5}, TypeError, "channel_axis"),
    ],
)
def test_constructor_arguments_are_checked(kwargs, error, match, monkeypatch):
    """`BatchNorm(2.5)` used to raise JAX's "Shapes must be 1D sequences of
    concrete values of integer type"; every argument is checked when the layer is
    built, with an eqx_state error that also is the built-in type. (The suite's
    jaxtyping/beartype hook would refuse a wrong type before `__init__` runs; users
    see the library's own error, so the hook is off here.)"""
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    with pytest.raises(error, match=match) as info:
        es.nn.BatchNorm(**kwargs)
    assert isinstance(info.value, es.EqxStateError)
    assert isinstance(info.value, TypeError if error is TypeError else ValueError)


def test_numpy_integer_sizes_are_accepted(monkeypatch):
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)  # as above
    bn = es.nn.BatchNorm(np.int64(3), channel_axis=np.int32(-1), eps=np.float32(1e-5))
    assert type(bn.num_features) is int and type(bn.channel_axis) is int
    y, _ = es.apply(lambda m, x: m(x), bn, jnp.array([[0.0, 1, 2], [2, 3, 6]]))
    np.testing.assert_allclose(y, [[-1, -1, -1], [1, 1, 1]], rtol=1e-4)


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


# --- per-example (axis_name) statistics: two passes, exact far from zero ----------


def _per_example(mode, bn, x, mask=None):
    """`bn` per example under `es.vmap(axis_name="batch")`, writing state."""
    if mask is None:
        fn = lambda m, x: es.vmap(m, axis_name="batch")(x)  # noqa: E731
        args = (x,)
    else:
        fn = lambda m, x, k: es.vmap(  # noqa: E731
            lambda m, x, k: m(x, mask=k), in_axes=(None, 0, 0), axis_name="batch"
        )(m, x, k)
        args = (x, mask)
    if mode == "ref":
        return fn(bn, *args), bn
    return es.apply(fn, bn, *args)


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("offset", [255.0, 1e3, 1e4])
def test_axis_name_variance_is_exact_far_from_zero(mode, offset):
    """E[x^2] - E[x]^2 cancels in float32 at these offsets (27 % off at 1e3); the
    two-pass variance equals float64 NumPy and torch to float32 round-off of the
    data (Flax's BatchNorm test adds 1e4 for this reason)."""
    rng = np.random.default_rng(0)
    bn = es.nn.BatchNorm(4, channel_axis=0, axis_name="batch")
    if mode == "ref":
        bn = es.to_refs(bn)
    tbn = torch.nn.BatchNorm1d(4)
    # round-off of the mean of float32 data at this offset, then a little slack
    tol = 4 * offset * np.finfo(np.float32).eps + 1e-5
    for step in range(2):
        x = (rng.normal(size=(32, 4)) * (step + 1) + offset).astype(np.float32)
        y, bn = _per_example(mode, bn, jnp.asarray(x))
        x64 = x.astype(np.float64)
        want = (x64 - x64.mean(0)) / np.sqrt(x64.var(0) + 1e-5)
        np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=tol)
        ty = tbn(torch.from_numpy(x)).detach().numpy()
        np.testing.assert_allclose(np.asarray(y), ty, rtol=0, atol=2 * tol)
        # the running variance is the (unbiased) batch variance, not ~0.9 + noise
        np.testing.assert_allclose(
            bn.running_var[...], tbn.running_var.numpy(), rtol=1e-4
        )
        np.testing.assert_allclose(
            bn.running_mean[...], tbn.running_mean.numpy(), rtol=1e-6
        )
    assert np.std(np.asarray(y), axis=0) == pytest.approx(np.ones(4), rel=1e-3)


def test_axis_name_with_spatial_axes_matches_whole_batch_and_torch():
    """Per example `[C, H, W]` under es.vmap equals BatchNorm2d on `[N, C, H, W]`."""
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(6, 3, 4, 4)) * 2 + 1e3).astype(np.float32)
    per_ex = es.nn.BatchNorm(3, channel_axis=0, axis_name="batch")
    y, per_ex = _per_example("value", per_ex, jnp.asarray(x))
    tbn = torch.nn.BatchNorm2d(3)
    ty = tbn(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(np.asarray(y), ty, rtol=0, atol=1e-3)
    np.testing.assert_allclose(per_ex.running_var[...], tbn.running_var, rtol=1e-4)


def test_axis_name_under_shard_map_on_one_device_is_exact():
    """The `jax.shard_map` path (a per-device call) uses the same two passes."""
    mesh = jax.make_mesh((1,), ("d",))
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(16, 3)) + 1e4).astype(np.float32)
    bn = es.nn.BatchNorm(3, channel_axis=1, axis_name="d")
    arrays, static = eqx.partition(bn, eqx.is_array)

    @jax.jit
    def run(arrays, x):
        def per_device(arrays, x):
            m = eqx.combine(arrays, static)
            y, m = es.apply(lambda m, x: m(x), m, x)
            return y, eqx.filter(m, eqx.is_array)

        spec = jax.sharding.PartitionSpec
        return jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(spec(), spec("d")),
            out_specs=(spec("d"), spec()),
        )(arrays, x)

    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    y, arrays = run(arrays, jax.device_put(jnp.asarray(x), sharded))
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean(0)) / np.sqrt(x64.var(0) + 1e-5)
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=5e-3)
    bn = eqx.combine(arrays, static)
    np.testing.assert_allclose(
        bn.running_var[...], 0.9 + 0.1 * x64.var(0, ddof=1), rtol=1e-4
    )


# --- complex input: refused, as PyTorch ---------------------------------------------


def test_complex_input_is_refused_like_torch():
    x = jnp.ones((4, 3), jnp.complex64)
    with pytest.raises(RuntimeError):  # PyTorch refuses complex input too
        torch.nn.BatchNorm1d(3)(torch.ones(4, 3, dtype=torch.complex64))
    for bn in (es.nn.BatchNorm(3), eqx.nn.inference_mode(es.nn.BatchNorm(3))):
        with pytest.raises(TypeError, match="does not support complex input"):
            es.apply(lambda m, x: m(x), bn, x)
    with pytest.raises(ValueError, match="real floating dtype"):
        es.nn.BatchNorm(3, dtype=jnp.complex64)


# --- mask: padded entries contribute nothing ----------------------------------------


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("shape", [(9, 4), (7, 3, 5)])
def test_mask_equals_torch_on_the_unpadded_batch(mode, shape):
    """Padding (filled with NaN and huge values, which must not leak in) changes
    nothing: outputs of the kept rows and running statistics equal
    torch.nn.BatchNorm on the unpadded batch, step after step."""
    rng = np.random.default_rng(3)
    bn = es.nn.BatchNorm(shape[1])
    if mode == "ref":
        bn = es.to_refs(bn)
    tbn = _torch_bn(shape)
    for step, keep in enumerate([5, 3, 9 if shape[0] == 9 else 7]):
        x = (rng.normal(size=shape) * (step + 1) + 10).astype(np.float32)
        x[keep:] = np.nan if step == 0 else 1e30
        rows = np.arange(shape[0]) < keep
        mask = jnp.asarray(rows.reshape((-1,) + (1,) * (len(shape) - 1)))
        if mode == "ref":
            y = bn(jnp.asarray(x), mask=mask)
        else:
            y, bn = es.apply(lambda m, x, k: m(x, mask=k), bn, jnp.asarray(x), mask)
        ty = tbn(torch.from_numpy(x[:keep])).detach().numpy()
        np.testing.assert_allclose(np.asarray(y)[:keep], ty, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            bn.running_mean[...], tbn.running_mean, rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            bn.running_var[...], tbn.running_var, rtol=1e-5, atol=1e-6
        )
        assert int(bn.num_batches_tracked[...]) == int(tbn.num_batches_tracked)


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("pad", [np.nan, np.inf, -np.inf, 1e30, 3.4e38])
def test_mask_gradients_equal_torch_on_the_unpadded_batch(mode, pad):
    """Gradients with padding left unset (NaN, inf): the masked-loss idiom gave
    finite losses and NaN weight and bias after one step (a probe's finding).
    Reference: torch.nn.BatchNorm1d on the unpadded rows, one SGD step."""
    rng = np.random.default_rng(4)
    keep, target = 6, rng.normal(size=(10, 3)).astype(np.float32)
    # scale 0.1: float32's largest value as padding overflows when normalised
    x = (0.1 * rng.normal(size=(10, 3))).astype(np.float32)
    x[keep:] = pad
    rows = jnp.asarray(np.arange(10) < keep)

    def loss(bn, x):
        y = jnp.where(rows[:, None], bn(x, mask=rows[:, None]), 0.0)
        return jnp.sum(jnp.where(rows[:, None], (y - target) ** 2, 0.0)) / keep

    tbn = torch.nn.BatchNorm1d(3)
    t = (tbn(torch.from_numpy(x[:keep])) - torch.from_numpy(target[:keep])) ** 2
    (t.sum() / keep).backward()
    bn = es.nn.BatchNorm(3)
    if mode == "ref":
        bn = es.to_refs(bn)
    step = es.make_step(loss, optax.sgd(1.0))
    bn, _ = step(bn, step.init(bn), jnp.asarray(x))
    np.testing.assert_allclose(1.0 - np.asarray(bn.weight), tbn.weight.grad, atol=1e-5)
    np.testing.assert_allclose(-np.asarray(bn.bias), tbn.bias.grad, atol=1e-5)
    np.testing.assert_allclose(bn.running_mean[...], tbn.running_mean, atol=1e-6)
    np.testing.assert_allclose(bn.running_var[...], tbn.running_var, rtol=1e-5)
    # the gradient of the input: finite, and the kept rows' equal torch's
    xt = torch.from_numpy(x[:keep]).requires_grad_()
    tbn2 = torch.nn.BatchNorm1d(3)
    ((tbn2(xt) - torch.from_numpy(target[:keep])) ** 2).sum().div(keep).backward()
    gx = jax.grad(lambda x: es.apply(loss, es.nn.BatchNorm(3), x)[0])(jnp.asarray(x))
    assert np.all(np.isfinite(gx))
    np.testing.assert_allclose(gx[:keep], xt.grad, atol=1e-5)
    np.testing.assert_array_equal(gx[keep:], 0.0)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_mask_under_axis_name_equals_torch_on_the_unpadded_batch(mode):
    rng = np.random.default_rng(4)
    bn = es.nn.BatchNorm(3, channel_axis=0, axis_name="batch")
    if mode == "ref":
        bn = es.to_refs(bn)
    tbn = torch.nn.BatchNorm1d(3)
    for keep in (6, 2):
        x = (rng.normal(size=(8, 3)) + 1e3).astype(np.float32)
        x[keep:] = np.nan
        mask = jnp.arange(8) < keep  # one flag per example
        y, bn = _per_example(mode, bn, jnp.asarray(x), mask)
        ty = tbn(torch.from_numpy(x[:keep])).detach().numpy()
        np.testing.assert_allclose(np.asarray(y)[:keep], ty, rtol=0, atol=1e-3)
        np.testing.assert_allclose(bn.running_var[...], tbn.running_var, rtol=1e-4)
        np.testing.assert_allclose(bn.running_mean[...], tbn.running_mean, rtol=1e-5)


def test_mask_matches_flax_elementwise_mask():
    """An elementwise mask (not only whole rows), against flax.linen.BatchNorm(mask=)
    (two-pass variance) and float64 NumPy."""
    flax_nn = pytest.importorskip("flax.linen")
    rng = np.random.default_rng(5)
    x = rng.normal(size=(6, 5, 3)).astype(np.float32) + 100
    mask = rng.random(size=(6, 5, 1)) < 0.6
    mask = np.broadcast_to(mask, x.shape)
    fbn = flax_nn.BatchNorm(
        use_running_average=False, momentum=0.9, use_fast_variance=False
    )
    variables = fbn.init(jax.random.key(0), x, mask=mask)
    fy, fvars = fbn.apply(variables, x, mask=mask, mutable=["batch_stats"])
    bn = es.nn.BatchNorm(3, channel_axis=-1, unbiased_running_var=False)
    y, bn = es.apply(lambda m, x, k: m(x, mask=k), bn, jnp.asarray(x), mask)
    np.testing.assert_allclose(y, fy, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        bn.running_mean[...], fvars["batch_stats"]["mean"], rtol=1e-6
    )
    np.testing.assert_allclose(
        bn.running_var[...], fvars["batch_stats"]["var"], rtol=1e-5
    )
    x64 = x.reshape(-1, 3).astype(np.float64)
    k = mask.reshape(-1, 3)
    for c in range(3):
        want = x64[k[:, c], c]
        assert bn.running_mean[...][c] == pytest.approx(0.1 * want.mean(), rel=1e-6)


def test_mask_with_an_empty_channel_keeps_its_statistics():
    bn = es.nn.BatchNorm(2)
    x = jnp.array([[1.0, 2.0], [3.0, 6.0], [5.0, 10.0]])
    mask = jnp.array([[True, False]] * 3)
    _, bn = es.apply(lambda m, x, k: m(x, mask=k), bn, x, mask)
    np.testing.assert_allclose(bn.running_mean[...], [0.1 * 3.0, 0.0])
    np.testing.assert_allclose(bn.running_var[...], [0.9 + 0.1 * 4.0, 1.0])
    assert int(bn.num_batches_tracked[...]) == 1


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_an_empty_batch_keeps_the_statistics_as_torch(mode):
    """Zero examples (no mask: the count is a Python 0 while tracing): PyTorch
    counts the batch and keeps its running statistics; so does the layer."""
    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    tbn, bn = _torch_bn((4, 3)), es.nn.BatchNorm(3)
    if mode == "ref":
        bn = es.to_refs(bn)
    tbn(torch.from_numpy(x))
    _, bn = _run(mode, bn, jnp.asarray(x))
    before = [np.array(bn.running_mean[...]), np.array(bn.running_var[...])]
    torch_before = [tbn.running_mean.clone().numpy(), tbn.running_var.clone().numpy()]
    tbn(torch.zeros((0, 3)))
    out, bn = _run(mode, bn, jnp.zeros((0, 3)))
    assert out.shape == (0, 3)
    for got, kept, want, torch_kept in zip(
        (bn.running_mean[...], bn.running_var[...]),
        before,
        (tbn.running_mean.numpy(), tbn.running_var.numpy()),
        torch_before,
        strict=True,
    ):
        np.testing.assert_array_equal(want, torch_kept)  # torch keeps them
        np.testing.assert_array_equal(got, kept)  # and so does the layer
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert int(bn.num_batches_tracked[...]) == int(tbn.num_batches_tracked) == 2


def test_mask_errors():
    bn = es.to_refs(es.nn.BatchNorm(3))
    with pytest.raises(ValueError, match=r"mask of shape \(4,\) does not broadcast"):
        bn(jnp.ones((4, 3)), mask=jnp.ones(4, bool))
    # the annotation's check in the test suite, or the layer's own message
    with pytest.raises(TypeError, match="mask must be boolean|parameter 'mask'"):
        bn(jnp.ones((4, 3)), mask=jnp.ones((4, 1), jnp.float32))
    assert int(bn.num_batches_tracked[...]) == 0


# --- Equinox's BatchNorm(mode="batch"): zero-debiased, biased running variance ------


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("per_example", [True, False])
def test_zero_debias_matches_equinox_batch_mode(mode, per_example):
    """The exact translation of `eqx.nn.BatchNorm(C, "batch", momentum=0.99,
    mode="batch")`, against Equinox itself over several steps: training outputs,
    inference outputs (running statistics divided by 1 - 0.99**t)."""
    ebn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        3, "batch", momentum=0.99, mode="batch"
    )
    w = jnp.array([1.5, -0.5, 2.0])
    b = jnp.array([0.1, 0.2, -0.3])
    ebn = eqx.tree_at(lambda m: (m.weight, m.bias), ebn, (w, b))
    kw = dict(momentum=0.01, zero_debias=True, unbiased_running_var=False)
    if per_example:
        bn = es.nn.BatchNorm(3, channel_axis=0, axis_name="batch", **kw)
    else:
        bn = es.nn.BatchNorm(3, **kw)
    bn = eqx.tree_at(lambda m: (m.weight, m.bias), bn, (w, b))
    if mode == "ref":
        bn = es.to_refs(bn)
    rng = np.random.default_rng(6)
    for step in range(4):
        x = jnp.asarray(
            (rng.normal(size=(8, 3, 5)) * (step + 1) + 3 * step).astype(np.float32)
        )
        ey, state = jax.vmap(
            ebn, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(x, state)
        if per_example:
            y, bn = _per_example(mode, bn, x)
        else:
            y, bn = _run(mode, bn, x)
        np.testing.assert_allclose(y, ey, rtol=1e-5, atol=1e-5)
        # inference: Equinox's debiased running statistics
        xe = jnp.asarray(rng.normal(size=(4, 3, 5)).astype(np.float32) + step)
        ev = eqx.nn.inference_mode(ebn)
        want, _ = jax.vmap(
            ev, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(xe, state)
        got = eqx.nn.inference_mode(bn)
        got = jax.vmap(got)(xe) if per_example else got(xe)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    hidden_mean, hidden_var = state.get(ebn.batch_state_index)
    np.testing.assert_allclose(bn.running_mean[...], hidden_mean, rtol=1e-5)
    np.testing.assert_allclose(bn.running_var[...], hidden_var, rtol=1e-5)


def test_momentum_alone_is_not_equinox_batch_mode():
    """Why the docs name zero_debias: momentum=0.01 alone is far off after a step."""
    ebn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        2, "batch", momentum=0.99, mode="batch"
    )
    x = jnp.asarray(np.random.default_rng(7).normal(size=(8, 2)) * 3 + 5)
    _, state = jax.vmap(ebn, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        x.astype(jnp.float32), state
    )
    want, _ = jax.vmap(
        eqx.nn.inference_mode(ebn),
        axis_name="batch",
        in_axes=(0, None),
        out_axes=(0, None),
    )(x.astype(jnp.float32), state)
    plain = es.nn.BatchNorm(2, momentum=0.01)
    _, plain = es.apply(lambda m, x: m(x), plain, x.astype(jnp.float32))
    assert (
        np.max(np.abs(eqx.nn.inference_mode(plain)(x.astype(jnp.float32)) - want)) > 1
    )
    with pytest.raises(ValueError, match="zero_debias=True needs a momentum"):
        es.nn.BatchNorm(2, momentum=None, zero_debias=True)


# --- axis_name where no axis is bound ----------------------------------------------


class _BnNet(eqx.Module):
    lin: eqx.nn.Linear
    bn: es.nn.BatchNorm

    def __init__(self, axis_name):
        self.lin = eqx.nn.Linear(3, 4, key=jax.random.key(0))
        self.bn = es.nn.BatchNorm(4, axis_name=axis_name)

    def __call__(self, x):
        return self.bn(jax.vmap(self.lin)(x))


def test_unbound_axis_name_is_a_clear_error():
    """Inside make_step(mesh=...) (even on one device) or any whole-batch call, an
    axis_name that no transform binds raises a NameError that says to drop it."""
    optax = pytest.importorskip("optax")
    model = _BnNet("data")
    mesh = jax.make_mesh((1,), ("data",))
    step = es.make_step(
        lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1), mesh=mesh, donate=False
    )
    msg = r"(?s)BatchNorm\(axis_name='data'\) was called where no axis.*make_step.*mesh.*without `axis_name`"
    with pytest.raises(NameError, match=msg):
        step(model, step.init(model), jnp.ones((4, 3)))
    with pytest.raises(NameError, match=msg):
        es.apply(lambda m, x: m(x), model, jnp.ones((4, 3)))
    assert int(model.bn.num_batches_tracked[...]) == 0
    # the fix: no axis_name, the same step works on the mesh
    fixed = _BnNet(None)
    fixed, _ = step(fixed, step.init(fixed), jnp.ones((4, 3)))
    assert int(fixed.bn.num_batches_tracked[...]) == 1


# --- kinds and reset fills ----------------------------------------------------------


def test_all_three_cells_are_batch_stats_with_reset_fills():
    """`es.reset(model, es.BatchStat)` must be torch's reset_running_stats(): all
    three cells are BatchStat (the count too, which momentum=None divides by), with
    fills 0, 1, 0."""
    bn = es.nn.BatchNorm(3)
    cells = [c for c in jax.tree.leaves(bn, is_leaf=es.is_state) if es.is_state(c)]
    assert [type(c) for c in cells] == [es.BatchStat] * 3
    assert [c.init for c in cells] == [0, 1, 0]


def test_recalibration_with_cumulative_average_matches_torch():
    """PyTorch's `reset_running_stats()` + `momentum=None` recalibration: writing
    every BatchStat back to its fill (what es.reset does) then averaging."""
    rng = np.random.default_rng(8)
    bn = es.nn.BatchNorm(3, momentum=None)
    tbn = torch.nn.BatchNorm1d(3, momentum=None)
    batches = [rng.normal(size=(5, 3)).astype(np.float32) + i for i in range(5)]
    for x in batches[:2]:
        _, bn = es.apply(lambda m, x: m(x), bn, jnp.asarray(x))
        tbn(torch.from_numpy(x))

    bn = es.reset(bn, es.BatchStat)
    tbn.reset_running_stats()
    for x in batches[2:]:
        _, bn = es.apply(lambda m, x: m(x), bn, jnp.asarray(x))
        tbn(torch.from_numpy(x))
    np.testing.assert_allclose(bn.running_mean[...], tbn.running_mean, rtol=1e-5)
    np.testing.assert_allclose(bn.running_var[...], tbn.running_var, rtol=1e-5)
    assert int(bn.num_batches_tracked[...]) == 3


# --- cases ported from PyTorch's and Flax's own BatchNorm tests ---------------------


def test_flax_batch_norm_case_biased_running_var():
    """flax tests/linen/linen_test.py::test_batch_norm: x (4, 3, 2) channels last,
    Flax momentum 0.9; ema mean = 0.1 * mean, ema var = 0.9 + 0.1 * biased var."""
    x = jax.random.normal(jax.random.key(0), (4, 3, 2))
    bn = es.nn.BatchNorm(2, channel_axis=-1, unbiased_running_var=False)
    y, bn = es.apply(lambda m, x: m(x), bn, x)
    np.testing.assert_allclose(y.mean((0, 1)), [0.0, 0.0], atol=1e-4)
    np.testing.assert_allclose(y.var((0, 1)), [1.0, 1.0], rtol=1e-4)
    x64 = np.asarray(x, np.float64)
    np.testing.assert_allclose(bn.running_mean[...], 0.1 * x64.mean((0, 1)), atol=1e-6)
    np.testing.assert_allclose(
        bn.running_var[...], 0.9 + 0.1 * x64.var((0, 1)), rtol=1e-6
    )


def test_flax_multi_call_case():
    """flax test_batch_norm_multi_init: a BatchNorm called twice in one step (on x,
    then on its own output) under a named axis; torch on the same two calls."""
    x = jax.random.normal(jax.random.key(1), (2, 4))
    bn = es.nn.BatchNorm(4, channel_axis=0, axis_name="batch")

    def twice(m, x):
        f = es.vmap(m, axis_name="batch")
        y1 = f(x)
        return y1, f(y1)

    (y1, y2), bn = es.apply(twice, bn, x)
    tbn = torch.nn.BatchNorm1d(4)
    t1 = tbn(torch.from_numpy(np.array(x)))
    t2 = tbn(t1)
    np.testing.assert_allclose(y1, t1.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y2, t2.detach().numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(bn.running_var[...], tbn.running_var, rtol=1e-5)
    assert int(bn.num_batches_tracked[...]) == 2


@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 2, 2)])
def test_torch_grad_case(shape):
    """PyTorch test_nn's BatchNorm gradient checks: d(output)/d(input, weight, bias)
    in training mode equal torch autograd (the batch statistics are differentiated
    through; the running statistics are not)."""
    rng = np.random.default_rng(9)
    x = rng.normal(size=shape).astype(np.float32) * 2 + 1
    g = rng.normal(size=shape).astype(np.float32)
    w = rng.normal(size=shape[1]).astype(np.float32)
    b = rng.normal(size=shape[1]).astype(np.float32)
    tbn = _torch_bn(shape)
    with torch.no_grad():
        tbn.weight.copy_(torch.from_numpy(w))
        tbn.bias.copy_(torch.from_numpy(b))
    tx = torch.from_numpy(x).requires_grad_()
    (tbn(tx) * torch.from_numpy(g)).sum().backward()
    bn = es.nn.BatchNorm(shape[1])
    bn = eqx.tree_at(lambda m: (m.weight, m.bias), bn, (jnp.asarray(w), jnp.asarray(b)))

    def loss(wb, x):
        m = eqx.tree_at(lambda m: (m.weight, m.bias), bn, wb)
        y, _ = es.apply(lambda m, x: m(x), m, x)
        return jnp.sum(y * g)

    (gw, gb), gx = jax.grad(loss, argnums=(0, 1))((bn.weight, bn.bias), jnp.asarray(x))
    np.testing.assert_allclose(gx, tx.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw, tbn.weight.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gb, tbn.bias.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_torch_eval_does_not_update_case():
    """PyTorch test_nn test_batchnorm_update_stats: eval leaves the buffers and the
    count alone; train updates them."""
    bn = es.to_refs(es.nn.BatchNorm(3))
    x = jnp.asarray(np.random.default_rng(10).normal(size=(4, 3)), jnp.float32)
    eqx.nn.inference_mode(bn)(x)
    assert int(bn.num_batches_tracked[...]) == 0
    np.testing.assert_array_equal(bn.running_mean[...], np.zeros(3))
    bn(x)
    assert int(bn.num_batches_tracked[...]) == 1
    assert not np.allclose(bn.running_mean[...], 0)


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_empty_batch_keeps_the_statistics_like_torch(mode, momentum):
    """An empty batch `[0, C]` in training: PyTorch keeps the running statistics
    and counts the call (which moves a cumulative average's weights)."""
    rng = np.random.default_rng(0)
    tbn = torch.nn.BatchNorm1d(3, momentum=momentum)
    bn = es.nn.BatchNorm(3, momentum=momentum)
    if mode == "ref":
        bn = es.to_refs(bn)
    for n in (4, 0, 5):
        x = rng.normal(size=(n, 3)).astype(np.float32) + 2
        y, bn = _run(mode, bn, jnp.asarray(x))
        ty = tbn(torch.from_numpy(x)).detach().numpy()
        assert y.shape == (n, 3)
        np.testing.assert_allclose(np.asarray(y), ty, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            bn.running_mean[...], tbn.running_mean.numpy(), rtol=1e-6
        )
        np.testing.assert_allclose(
            bn.running_var[...], tbn.running_var.numpy(), rtol=1e-6
        )
        assert int(bn.num_batches_tracked[...]) == int(tbn.num_batches_tracked)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_one_value_per_channel_is_refused_or_keeps_the_variance(mode):
    """PyTorch refuses a training batch of one value per channel (its unbiased
    variance is undefined). Unmasked, also per example under `es.vmap` (a batch of
    one), it raises; a mask leaving one entry (known only at run time) updates the
    running mean and keeps the running variance, as documented."""
    x = jnp.array([[1.0, 2.0], [5.0, 7.0], [9.0, 3.0]])
    with pytest.raises(ValueError, match="one value per channel"):
        _run(mode, es.nn.BatchNorm(2), x[:1])
    per = es.nn.BatchNorm(2, channel_axis=0, axis_name="batch")
    with pytest.raises(ValueError, match="one value per channel over axis 'batch'"):
        _per_example(mode, es.to_refs(per) if mode == "ref" else per, x[:1])
    bn = es.nn.BatchNorm(2)
    bn = es.to_refs(bn) if mode == "ref" else bn
    mask = jnp.array([True, False, False])[:, None]
    fn = lambda m, x: m(x, mask=mask)  # noqa: E731
    _, bn = (fn(bn, x), bn) if mode == "ref" else es.apply(fn, bn, x)
    np.testing.assert_allclose(bn.running_mean[...], 0.1 * np.array([1.0, 2.0]))
    np.testing.assert_array_equal(bn.running_var[...], [1.0, 1.0])
    assert int(bn.num_batches_tracked[...]) == 1


def test_bfloat16_model_keeps_float32_statistics_that_do_not_stall():
    """`BatchNorm(dtype=bfloat16)`: weight and bias in bfloat16, running statistics
    in float32 (as Flax keeps batch statistics), so a small momentum still moves
    them: equal to the float64 running average of the same bfloat16 batches.
    (PyTorch in bfloat16 stalls at 2.0 on this data.)"""
    rng = np.random.default_rng(0)
    m = 0.01
    bn = es.nn.BatchNorm(1, momentum=m, dtype=jnp.bfloat16)
    assert bn.weight.dtype == jnp.bfloat16 and bn.running_mean.dtype == jnp.float32
    step = eqx.filter_jit(lambda bn, x: es.apply(lambda b, x: b(x), bn, x)[1])
    want = 0.0
    for _ in range(600):
        x = jnp.asarray(rng.normal(3.0, 0.01, (64, 1)), jnp.bfloat16)
        bn = step(bn, x)
        want = (1 - m) * want + m * np.asarray(x, np.float64).mean()
    np.testing.assert_allclose(float(bn.running_mean[...][0]), want, rtol=1e-4)


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("track", [True, False])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("shape", [(1, 3), (1, 3, 1), (1, 3, 2)])
@pytest.mark.split
def test_one_value_per_channel_is_refused_exactly_where_torch_refuses(
    mode, track, train, shape
):
    """PyTorch normalises with batch statistics when training *or* when it has no
    running statistics (`bn_training`), and refuses one value per channel whenever
    it does: so `track_running_stats=False` refuses it in evaluation too. Each case
    follows torch: the same refusal, or the same output."""
    x = np.random.default_rng(3).normal(size=shape).astype(np.float32) + 1
    tbn = torch.nn.BatchNorm1d(3, track_running_stats=track).train(train)
    try:
        want = tbn(torch.from_numpy(x)).detach().numpy()
    except ValueError as e:
        assert "Expected more than 1 value per channel" in str(e)
        want = None
    bn = es.nn.BatchNorm(3, track_running_stats=track, inference=not train)
    bn = es.to_refs(bn) if mode == "ref" else bn
    if want is None:
        why = "in training mode" if train else "in evaluation mode without running"
        with pytest.raises(ValueError, match=f"one value per channel .* {why}"):
            _run(mode, bn, jnp.asarray(x))
    else:
        y, _ = _run(mode, bn, jnp.asarray(x))
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


def test_single_example_without_running_stats_in_evaluation_is_refused():
    bn = es.nn.BatchNorm(4, channel_axis=0, track_running_stats=False)
    with pytest.raises(ValueError, match="evaluation mode without running stat"):
        eqx.nn.inference_mode(bn)(jnp.ones(4))
    # with running statistics, evaluation of one example is fine (as in torch)
    y = es.nn.BatchNorm(4, channel_axis=0, inference=True)(jnp.ones(4))
    np.testing.assert_allclose(y, np.ones(4) / np.sqrt(1 + 1e-5), rtol=1e-6)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_all_masked_channel_gives_nan_like_flax_with_finite_gradients(mode):
    """A channel with no unmasked entry has no batch statistics: its output is NaN,
    as flax.linen.BatchNorm(mask=) gives (both variance algorithms); the other
    channels equal Flax's. The running statistics of that channel are kept (Flax
    writes NaN there; PyTorch keeps them on an empty batch)."""
    flax_nn = pytest.importorskip("flax.linen")
    rng = np.random.default_rng(7)
    x = rng.normal(size=(6, 3)).astype(np.float32) * 2 + 1
    mask = np.broadcast_to(np.array([True, False, True]), x.shape).copy()
    mask[4:, 0] = False
    bn = es.nn.BatchNorm(3, channel_axis=-1, unbiased_running_var=False)
    bn = es.to_refs(bn) if mode == "ref" else bn
    fn = lambda m, x: m(x, mask=jnp.asarray(mask))  # noqa: E731
    xj = jnp.asarray(x)
    y, bn = (fn(bn, xj), bn) if mode == "ref" else es.apply(fn, bn, xj)
    for fast in (True, False):
        fbn = flax_nn.BatchNorm(
            use_running_average=False, momentum=0.9, use_fast_variance=fast
        )
        variables = fbn.init(jax.random.key(0), x, mask=mask)
        fy, fvars = fbn.apply(variables, x, mask=mask, mutable=["batch_stats"])
        assert np.isnan(fy[:, 1]).all()
        np.testing.assert_allclose(np.asarray(y), fy, rtol=1e-5, atol=1e-5)
    assert np.isnan(fvars["batch_stats"]["mean"][1])
    np.testing.assert_allclose(
        bn.running_mean[...],
        [0.1 * x[:4, 0].mean(), 0.0, 0.1 * x[:, 2].mean()],
        rtol=1e-6,
    )
    np.testing.assert_allclose(bn.running_var[...][1], 1.0)

    # gradients of a loss masked with `where`: Flax's are NaN for the empty
    # channel's scale (0 * NaN); here they are 0, and the others equal Flax's.
    def es_loss(wb):
        m = eqx.tree_at(lambda b: (b.weight, b.bias), es.freeze(bn), wb)
        y, _ = es.apply(fn, m, jnp.asarray(x))
        return jnp.sum(jnp.where(mask, y, 0) ** 3)

    def flax_loss(params):
        fy, _ = fbn.apply(
            {**variables, "params": params}, x, mask=mask, mutable=["batch_stats"]
        )
        return jnp.sum(jnp.where(mask, fy, 0) ** 3)

    gw, gb = map(np.asarray, jax.grad(es_loss)((jnp.ones(3), jnp.zeros(3))))
    fg = jax.tree.map(np.asarray, jax.grad(flax_loss)(variables["params"]))
    assert np.isnan(fg["scale"][1])
    np.testing.assert_array_equal([gw[1], gb[1]], [0.0, 0.0])
    np.testing.assert_allclose(gw[[0, 2]], fg["scale"][[0, 2]], rtol=1e-4)
    np.testing.assert_allclose(gb[[0, 2]], fg["bias"][[0, 2]], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_a_wrong_input_inside_a_step_names_the_layer_by_its_path(mode, monkeypatch):
    """Inside a step or an apply the error says which BatchNorm of the model got
    the wrong input (there is no path to give for an eager call on a layer)."""
    # the suite's type checker would refuse the wrong inputs first (a user has none)
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    model = eqx.nn.Sequential(
        [
            es.nn.Batched(eqx.nn.Linear(3, 4, key=jax.random.key(0))),
            es.nn.BatchNorm(4),
            es.nn.BatchNorm(5),
        ]
    )
    model = es.to_refs(model) if mode == "ref" else model
    step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    x = jnp.ones((8, 3))
    with pytest.raises(
        es.EqxStateError,
        match=r"In `model\.layers\[2\]` \(BatchNorm\): BatchNorm\(5\) got",
    ):
        step(model, step.init(model), x)
    with pytest.raises(
        es.EqxStateError,
        match=r"In `model\.layers\[2\]` \(BatchNorm\): BatchNorm\(5\) got",
    ):
        es.apply(lambda m, x: m(x), model, x)
    # every check of the input names it: an integer input, a list, a scalar, complex
    layers = (es.nn.BatchNorm(3), es.nn.BatchNorm(3))
    for bad, kind in [
        (lambda x: x.astype(jnp.int32), "floating-point input"),
        (lambda x: [1.0, 2.0, 3.0], "JAX or NumPy array"),
        (lambda x: x[0, 0], "channel axis"),
        (lambda x: x.astype(jnp.complex64), "complex input"),
    ]:
        two = eqx.nn.Sequential([*layers, eqx.nn.Lambda(bad), es.nn.BatchNorm(3)])
        two = es.to_refs(two) if mode == "ref" else two
        with pytest.raises(
            es.EqxStateError,
            match=r"In `model\.layers\[3\]` \(BatchNorm\): BatchNorm\(3\)",
        ):
            step(two, step.init(two), jnp.ones((8, 3)))
        with pytest.raises(es.EqxStateError, match=kind):
            es.apply(lambda m, x: m(x), two, jnp.ones((8, 3)))


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("gone", ["running_mean", "running_var", "num_batches_tracked"])
def test_a_running_statistic_set_to_none_alone_is_refused_as_torch_refuses_it(
    mode, gone
):
    """The running statistics are kept all together or not at all. One of them set
    to None (`eqx.tree_at`, as one sets a PyTorch buffer to None) silently turned
    the layer into `track_running_stats=False` (running_mean), leaving the other
    cells stale, or failed with a bare `AssertionError`; PyTorch refuses it."""
    tbn = torch.nn.BatchNorm1d(3)
    setattr(tbn, gone, None)
    x = np.random.default_rng(0).normal(size=(6, 3)).astype(np.float32)
    if gone != "num_batches_tracked":  # PyTorch ignores that one being None
        with pytest.raises(ValueError, match="must either both be None"):
            tbn(torch.from_numpy(x))

    model = eqx.nn.Sequential([es.nn.BatchNorm(3), es.nn.BatchNorm(3)])
    model = eqx.tree_at(lambda m: getattr(m[1], gone), model, None, is_leaf=es.is_state)
    model = es.to_refs(model) if mode == "ref" else model
    step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    x = jnp.asarray(x)
    for call in (
        lambda: step(model, step.init(model), x),
        lambda: es.apply(lambda m, x: m(x), model, x),
        lambda: es.apply(lambda m, x: m(x), model[1], x),
    ):
        with pytest.raises(es.EqxStateError, match=f"`{gone}` set to None") as info:
            call()
        assert isinstance(info.value, TypeError)
        assert "track_running_stats=False" in str(info.value)
    with pytest.raises(
        es.EqxStateError,
        match=r"In `model\.layers\[1\]` \(BatchNorm\): BatchNorm\(3\) has",
    ):
        step(model, step.init(model), x)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_all_running_statistics_set_to_none_normalise_as_torch_without_them(mode):
    """All three set to None is `track_running_stats=False`: batch statistics in
    training and in evaluation, as `torch.nn.BatchNorm1d(track_running_stats=False)`."""
    tbn = torch.nn.BatchNorm1d(3, track_running_stats=False)
    bn = es.nn.BatchNorm(3)
    bn = eqx.tree_at(
        lambda b: (b.running_mean, b.running_var, b.num_batches_tracked),
        bn,
        (None, None, None),
        is_leaf=lambda v: v is None or es.is_state(v),
    )
    bn = es.to_refs(bn) if mode == "ref" else bn
    x = np.random.default_rng(1).normal(size=(6, 3)).astype(np.float32)
    want = tbn(torch.from_numpy(x)).detach().numpy()
    out, bn = _run(mode, bn, jnp.asarray(x))
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    tbn.eval()
    want = tbn(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(
        es.inference_mode(bn)(jnp.asarray(x)), want, rtol=1e-6, atol=1e-6
    )


def test_eps_zero_is_refused_with_batch_statistics_as_in_torch():
    """PyTorch 2.13 refuses `eps=0` in training (a constant channel would give NaN)
    and allows it in eval with running statistics; so does BatchNorm."""
    x = jnp.ones((4, 3))
    with pytest.raises(ValueError, match="eps must be positive"):
        torch.nn.BatchNorm1d(3, eps=0.0).train()(torch.ones(4, 3))
    with pytest.raises(es.EqxStateError, match=r"eps=0\.0.*NaN"):
        es.apply(lambda m, x: m(x), es.nn.BatchNorm(3, eps=0.0), x)
    want = torch.nn.BatchNorm1d(3, eps=0.0).eval()(torch.ones(4, 3))
    got = eqx.nn.inference_mode(es.nn.BatchNorm(3, eps=0.0))(x)
    np.testing.assert_array_equal(np.asarray(got), want.detach().numpy())


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize(
    "cell, dtype",
    [
        ("running_mean", jnp.int32),
        ("running_var", jnp.bfloat16),
        ("running_mean", jnp.float16),
        ("num_batches_tracked", jnp.int8),
        ("num_batches_tracked", jnp.float32),
    ],
)
def test_a_statistic_cell_of_a_dtype_it_cannot_hold_is_refused(mode, cell, dtype):
    """A layer casts its updates into its cells' dtypes: a cell replaced by one of
    a dtype that truncates them (found by an outside review: an int32 running mean
    stayed 0) is refused by name, as PyTorch refuses an integer running mean."""
    torch_bn = torch.nn.BatchNorm1d(3)
    torch_bn.running_mean = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(RuntimeError):
        torch_bn(torch.randn(4, 3))
    bn = es.nn.BatchNorm(3)
    bn = eqx.tree_at(
        lambda b: getattr(b, cell).value, bn, getattr(bn, cell).value.astype(dtype)
    )
    if mode == "ref":
        bn = es.to_refs(bn)
    x = jnp.ones((4, 3))
    with pytest.raises(TypeError, match=rf"BatchNorm.*{cell}.*holds") as info:
        es.apply(lambda m, x: m(x), bn, x)
    assert isinstance(info.value, es.EqxStateError)
    # inference reads the statistics, which any float dtype holds (as torch's eval),
    # and no integer does (PyTorch refuses that in eval too)
    if cell != "num_batches_tracked":
        if jnp.issubdtype(dtype, jnp.floating):
            assert eqx.nn.inference_mode(bn)(x).shape == x.shape
        else:
            torch_bn.eval()
            with pytest.raises(RuntimeError):
                torch_bn(torch.randn(4, 3))
            with pytest.raises(TypeError, match=rf"BatchNorm.*{cell}.*holds int"):
                eqx.nn.inference_mode(bn)(x)


def test_a_model_cast_wholesale_to_bfloat16_still_runs_in_inference():
    """Casting every array of a trained model to bfloat16 for deployment (its
    statistics too) keeps working in inference mode, where nothing is updated."""
    bn = es.nn.BatchNorm(3)
    half = jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, bn
    )
    x = jax.random.normal(jax.random.key(0), (4, 3), jnp.bfloat16)
    want = eqx.nn.inference_mode(bn)(x.astype(jnp.float32))  # statistics 0 and 1
    got = eqx.nn.inference_mode(half)(x)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=1e-2, atol=1e-2)


def test_an_evaluation_copy_kept_across_a_step_is_stale_with_the_fix():
    """A ref-mode model switched to evaluation before a step shares the cells (refs)
    but keeps the parameters the step donated: BatchNorm's own read of its affine
    weight raised JAX's bare "Array has been deleted"; it names the fix as a cell
    read does."""
    model = es.to_refs(es.nn.BatchNorm(3))
    step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    opt_state = step.init(model)
    x = jnp.ones((4, 3)) + jnp.arange(4.0)[:, None]
    evaluation = eqx.nn.inference_mode(model)
    model, opt_state = step(model, opt_state, x)
    with pytest.raises(es.StaleModelError, match=r"BatchNorm\(3\) `weight`.*consumed"):
        evaluation(x)
    assert eqx.nn.inference_mode(model)(x).shape == (4, 3)  # the fix


def test_options_read_as_attributes_and_stay_static_like_torchs():
    """The options are held in one static field (cheaper to rebuild every step)
    and read as attributes, as on `torch.nn.BatchNorm1d`; they stay part of the
    structure: a different option is a different compiled program, never a leaf
    that a step would trace or an optimizer would see."""
    kw = dict(eps=1e-3, momentum=None, channel_axis=-1, axis_name="b")
    bn = es.nn.BatchNorm(4, zero_debias=False, unbiased_running_var=False, **kw)
    tbn = torch.nn.BatchNorm1d(4, eps=1e-3, momentum=None)
    for name in ("num_features", "eps", "momentum"):
        assert getattr(bn, name) == getattr(tbn, name), name
    assert (bn.channel_axis, bn.axis_name) == (-1, "b")
    assert (bn.zero_debias, bn.unbiased_running_var) == (False, False)
    assert (bn.affine, bn.track_running_stats) == (tbn.affine, True)
    other = es.nn.BatchNorm(4, unbiased_running_var=False, **{**kw, "eps": 1e-4})
    same = es.nn.BatchNorm(4, unbiased_running_var=False, **kw)
    td = jax.tree_util.tree_structure
    assert td(bn) != td(other) and td(bn) == td(same)
    n_leaves = len(jax.tree_util.tree_leaves(bn))
    assert n_leaves == 6  # weight, bias, 3 statistics, the inference flag
    with pytest.raises(AttributeError):
        bn.eps = 0.1  # type: ignore[misc]
    import copy
    import pickle

    for twin in (copy.deepcopy(bn), pickle.loads(pickle.dumps(bn))):
        assert eqx.tree_equal(twin, bn) and td(twin) == td(bn)


def test_a_pickle_from_before_the_options_were_one_field_loads_and_runs():
    """A BatchNorm pickled when its seven options were fields (its `__dict__`
    held `eps`, `momentum`, ...): it loads, reads its options and normalises as
    a fresh layer does (checked against torch.nn.BatchNorm1d)."""
    import dataclasses
    import pickle

    new = es.nn.BatchNorm(3, eps=1e-3, momentum=0.2)
    state = {k: v for k, v in new.__dict__.items() if k != "_options"}
    state.update(new._options._asdict())  # the old layout: one entry per option
    old = object.__new__(es.nn.BatchNorm)
    object.__getattribute__(old, "__dict__").update(state)
    assert "_options" not in old.__dict__
    loaded = pickle.loads(pickle.dumps(old))
    assert (loaded.eps, loaded.momentum) == (1e-3, 0.2)
    assert [f.name for f in dataclasses.fields(loaded)] == [
        f.name for f in dataclasses.fields(new)
    ]
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    y, bn = es.apply(lambda m, x: m(x), loaded, jnp.asarray(x))
    tbn = torch.nn.BatchNorm1d(3, eps=1e-3, momentum=0.2)
    ty = tbn(torch.from_numpy(x))
    np.testing.assert_allclose(np.asarray(y), ty.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(bn.running_var[...]), tbn.running_var.numpy(), rtol=1e-6
    )


def test_a_subclass_may_set_an_option_in_its_init_and_not_after():
    """As when the options were fields: a subclass's `__init__` may set one after
    `super().__init__()`; afterwards the layer is frozen (Equinox's error, naming
    the option)."""
    import dataclasses

    class LooseBN(es.nn.BatchNorm):
        def __init__(self, n):
            super().__init__(n)
            self.eps = 1e-2

    bn = LooseBN(3)
    assert bn.eps == 1e-2 and jax.tree_util.tree_structure(bn) != (
        jax.tree_util.tree_structure(es.nn.BatchNorm(3))
    )
    x = jnp.asarray([[0.0, 1.0, 2.0], [2.0, 3.0, 6.0]])
    y, _ = es.apply(lambda m, x: m(x), bn, x)
    ty = torch.nn.BatchNorm1d(3, eps=1e-2)(torch.from_numpy(np.array(x)))
    np.testing.assert_allclose(np.asarray(y), ty.detach().numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(dataclasses.FrozenInstanceError, match="'eps'"):
        bn.eps = 0.5
