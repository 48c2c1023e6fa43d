"""RunningNorm against numpy mean/var over everything seen (any batch split), in
both storage modes and under transforms."""

import equinox as eqx
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest
from hypothesis import given, settings

import eqx_state as es


def _normalised(x, mean, var, eps=1e-8, clip=5.0):
    y = (np.asarray(x, np.float64) - mean) / np.sqrt(var + eps)
    return y if clip is None else np.clip(y, -clip, clip)


def _call(mode, norm, x):
    if mode == "ref":
        return norm(x), norm
    return es.apply(lambda m, x: m(x), norm, x)


@st.composite
def _data_and_splits(draw):
    n = draw(st.integers(1, 40))
    d = draw(st.integers(1, 3))
    data = draw(
        hnp.arrays(
            np.float32,
            (n, d),
            elements=st.floats(
                -100, 100, width=32, allow_nan=False, allow_infinity=False
            ),
        )
    )
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=6)))
    return data, cuts


@settings(max_examples=10, deadline=None)
@given(_data_and_splits())
@pytest.mark.slow
def test_any_split_equals_numpy_over_everything(case):
    """Chan's parallel update: after any sequence of batches (empty ones included),
    mean/var equal numpy's over the concatenation."""
    data, cuts = case
    norm = es.to_refs(es.nn.RunningNorm(data.shape[1]))
    bounds = [0, *cuts, len(data)]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        y = norm(jnp.asarray(data[lo:hi]))
        assert y.shape == (hi - lo, data.shape[1])
    mean = data.astype(np.float64).mean(0)
    var = data.astype(np.float64).var(0)
    scale = np.abs(data).max() + 1
    np.testing.assert_allclose(norm.mean[...], mean, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(norm.var[...], var, rtol=1e-4, atol=1e-5 * scale**2)
    assert int(norm.count[...]) == len(data)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_outputs_match_numpy_each_step(mode):
    """Training: update first, then normalise with the updated moments, clip."""
    rng = np.random.default_rng(0)
    norm = es.nn.RunningNorm((2, 3))
    if mode == "ref":
        norm = es.to_refs(norm)
    seen = []
    for k in range(4):
        x = (rng.normal(size=(3, 2, 2, 3)) * (k + 1) + k).astype(np.float32)
        y, norm = _call(mode, norm, jnp.asarray(x))
        seen.append(x.reshape(-1, 2, 3).astype(np.float64))
        allx = np.concatenate(seen)
        mean, var = allx.mean(0), allx.var(0)
        np.testing.assert_allclose(norm.mean[...], mean, rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(norm.var[...], var, rtol=1e-5)
        np.testing.assert_allclose(y, _normalised(x, mean, var), rtol=1e-5, atol=1e-5)
    # evaluation: the same moments, nothing written, eager in value mode
    ev = eqx.nn.inference_mode(norm)
    x = rng.normal(size=(5, 2, 3)).astype(np.float32)
    np.testing.assert_allclose(
        ev(jnp.asarray(x)), _normalised(x, mean, var), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(ev.mean[...], mean, rtol=1e-5, atol=1e-3)
    assert int(ev.count[...]) == 4 * 6
    # far inputs are clipped to +-clip
    far = np.where(np.arange(6).reshape(2, 3) % 2, 1e4, -1e4).astype(np.float32)
    np.testing.assert_array_equal(ev(jnp.asarray(far)), np.where(far > 0, 5.0, -5.0))


def test_clip_none_eps_and_single_input():
    norm = es.to_refs(es.nn.RunningNorm(2, clip=None, eps=0.5))
    x = np.array([[0.0, 1.0], [100.0, 3.0], [0.0, 5.0]], np.float32)
    y = norm(jnp.asarray(x))
    mean, var = x.mean(0), x.var(0)
    np.testing.assert_allclose(y, _normalised(x, mean, var, 0.5, None), rtol=1e-5)
    # a single input (no batch axis) is a batch of one
    z = np.array([7.0, -1.0], np.float32)
    yz = norm(jnp.asarray(z))
    allx = np.concatenate([x, z[None]])
    assert yz.shape == (2,)
    np.testing.assert_allclose(norm.mean[...], allx.mean(0), rtol=1e-6)
    np.testing.assert_allclose(
        yz, _normalised(z, allx.mean(0), allx.var(0), 0.5, None), rtol=1e-5
    )
    far = jnp.asarray([1e4, -1e4])  # no clipping
    np.testing.assert_allclose(
        eqx.nn.inference_mode(norm)(far),
        _normalised(far, allx.mean(0), allx.var(0), 0.5, None),
        rtol=1e-5,
    )
    assert float(eqx.nn.inference_mode(norm)(far)[0]) > 100


def test_scalar_inputs_and_integer_dtype():
    norm = es.to_refs(es.nn.RunningNorm())  # scalars: every axis is a batch axis
    x = np.arange(24, dtype=np.uint8).reshape(4, 6)
    y = norm(jnp.asarray(x))
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(norm.mean[...], x.mean(), rtol=1e-6)
    np.testing.assert_allclose(norm.var[...], x.var(), rtol=1e-6)
    np.testing.assert_allclose(y, _normalised(x, x.mean(), x.var()), rtol=1e-5)


class Policy(eqx.Module):
    norm: es.nn.RunningNorm
    linear: eqx.nn.Linear

    def __init__(self, key):
        self.norm = es.nn.RunningNorm(3)
        self.linear = eqx.nn.Linear(3, 1, key=key)

    def __call__(self, obs):
        return jax.vmap(self.linear)(self.norm(obs))[:, 0]


def _loss(model, obs, target):
    return jnp.mean((model(obs) - target) ** 2)


def _hand_threaded(model, batches, targets, lr):
    """The same training written without eqx_state, in numpy: moments threaded by
    hand, the linear layer trained by SGD on the mean squared error with its
    gradient written out."""
    w = np.asarray(model.linear.weight, np.float64)
    b = np.asarray(model.linear.bias, np.float64)
    seen = []
    for obs, target in zip(batches, targets):
        seen.append(np.asarray(obs, np.float64))
        allx = np.concatenate(seen)
        z = _normalised(obs, allx.mean(0), allx.var(0))
        r = z @ w[0] + b[0] - target  # residuals, shape [N]
        w = w - lr * (2 / len(r)) * (r @ z)[None]
        b = b - lr * (2 / len(r)) * np.sum(r, keepdims=True)
    return allx.mean(0), allx.var(0), w, b


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_make_step_matches_hand_threaded(mode, getkey):
    rng = np.random.default_rng(1)
    model = Policy(getkey())
    batches = [rng.normal(size=(6, 3)).astype(np.float32) * 3 + 1 for _ in range(3)]
    targets = [rng.normal(size=(6,)).astype(np.float32) for _ in range(3)]
    mean, var, w, b = _hand_threaded(model, batches, targets, 0.1)
    if mode == "ref":
        model = es.to_refs(model)
    step = es.make_step(_loss, optax.sgd(0.1))
    opt_state = step.init(model)
    for obs, target in zip(batches, targets):
        model, opt_state = step(model, opt_state, jnp.asarray(obs), jnp.asarray(target))
    assert step.trace_count == 1
    np.testing.assert_allclose(model.norm.mean[...], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.norm.var[...], var, rtol=1e-5)
    np.testing.assert_allclose(model.linear.weight, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.linear.bias, b, rtol=1e-5, atol=1e-6)


def test_state_is_not_trained_by_adamw(getkey):
    model = Policy(getkey())
    assert len(jax.tree_util.tree_leaves(es.params(model))) == 2  # the Linear only
    obs = jnp.asarray(np.random.default_rng(2).normal(size=(5, 3)), jnp.float32)
    step = es.make_step(_loss, optax.adamw(0.1, weight_decay=0.5), donate=False)
    new, _ = step(model, step.init(model), obs, jnp.ones(5))
    np.testing.assert_allclose(new.norm.mean[...], np.asarray(obs).mean(0), rtol=1e-6)
    np.testing.assert_allclose(new.norm.var[...], np.asarray(obs).var(0), rtol=1e-5)
    assert int(new.norm.count[...]) == 5
    assert not np.allclose(new.linear.weight, model.linear.weight)


def test_grad_has_no_path_into_state():
    """The output is differentiable in `x` (through the freshly updated moments the
    gradient is that of a fixed affine map: state is not differentiated)."""
    norm = es.to_refs(es.nn.RunningNorm(2, clip=None))
    x = jnp.asarray([[1.0, 2.0], [3.0, 5.0]])
    g = jax.grad(lambda x: jnp.sum(norm(x)))(x)
    var = np.asarray(x).var(0)
    np.testing.assert_allclose(
        g, np.broadcast_to(1 / np.sqrt(var + 1e-8), (2, 2)), rtol=1e-5
    )
    np.testing.assert_allclose(norm.mean[...], np.asarray(x).mean(0))


def test_jit_compiles_once():
    norm = es.nn.RunningNorm(3)

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def run(norm, x):
        return es.apply(lambda m, x: m(x), norm, x)

    xs = np.random.default_rng(3).normal(size=(4, 5, 3)).astype(np.float32)
    for x in xs:
        _, norm = run(norm, jnp.asarray(x))
    flat = xs.reshape(-1, 3)
    np.testing.assert_allclose(norm.mean[...], flat.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norm.var[...], flat.var(0), rtol=1e-5)


def test_vmap_over_ensemble_equals_solo_runs():
    """An ensemble (one normaliser per environment group) under vmap: each member's
    moments are those of its own data."""
    xs = jnp.asarray(np.random.default_rng(4).normal(size=(3, 2, 4, 2)), jnp.float32)
    norms = eqx.filter_vmap(lambda _: es.nn.RunningNorm(2), axis_size=3)(jnp.arange(3))

    def run(norm, batches):
        for x in batches:
            y, norm = es.apply(lambda m, x: m(x), norm, x)
        return norm, y

    trained, ys = eqx.filter_jit(eqx.filter_vmap(run))(norms, xs)
    for i in range(3):
        solo, y = run(es.nn.RunningNorm(2), xs[i])
        np.testing.assert_allclose(trained.mean[...][i], solo.mean[...], rtol=1e-6)
        np.testing.assert_allclose(trained.var[...][i], solo.var[...], rtol=1e-6)
        np.testing.assert_allclose(ys[i], y, rtol=1e-6)
        flat = np.asarray(xs[i]).reshape(-1, 2)
        np.testing.assert_allclose(solo.var[...], flat.var(0), rtol=1e-5)


def test_scan_over_updates():
    xs = np.random.default_rng(5).normal(size=(6, 4, 2)).astype(np.float32) * 2 + 3

    def run(norm, xs):
        return jax.lax.scan(lambda c, x: (c, norm(x)), None, xs)[1]

    ys, norm = eqx.filter_jit(lambda m, xs: es.apply(run, m, xs))(
        es.nn.RunningNorm(2), jnp.asarray(xs)
    )
    flat = xs.reshape(-1, 2).astype(np.float64)
    np.testing.assert_allclose(norm.mean[...], flat.mean(0), rtol=1e-5)
    np.testing.assert_allclose(norm.var[...], flat.var(0), rtol=1e-5)
    assert int(norm.count[...]) == 24
    np.testing.assert_allclose(
        ys[-1], _normalised(xs[-1], flat.mean(0), flat.var(0)), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_checkpoint_under_grad_updates_once(mode, getkey):
    def remat_loss(model, obs, target):
        return eqx.filter_checkpoint(_loss)(model, obs, target)

    obs = jnp.asarray(np.random.default_rng(6).normal(size=(2, 5, 3)), jnp.float32)
    results = []
    key = getkey()
    for loss in (_loss, remat_loss):
        model = Policy(key)
        if mode == "ref":
            model = es.to_refs(model)
        step = es.make_step(loss, optax.sgd(0.1))
        opt_state = step.init(model)
        for o in obs:
            model, opt_state = step(model, opt_state, o, jnp.zeros(5))
        assert int(model.norm.count[...]) == 10
        results.append([model.norm.mean[...], model.norm.var[...], model.linear.weight])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    flat = np.asarray(obs).reshape(-1, 3)
    np.testing.assert_allclose(results[1][1], flat.var(0), rtol=1e-5)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_per_example_es_vmap_with_axis_name_equals_batched_call(mode):
    """`es.vmap(norm, axis_name=...)` over environments (each with a small batch of
    its own) updates the moments once, as a call on all the data."""
    rng = np.random.default_rng(7)
    xs = [rng.normal(size=(4, 2, 3)).astype(np.float32) * 2 + 1 for _ in range(2)]
    norm = es.nn.RunningNorm(3, axis_name="env")
    flat = es.nn.RunningNorm(3)
    if mode == "ref":
        norm, flat = es.to_refs(norm), es.to_refs(flat)
    run = lambda m, x: es.vmap(m, axis_name="env")(x)  # noqa: E731
    for x in xs:
        y, norm = es.apply(run, norm, jnp.asarray(x))
        y_flat, flat = es.apply(lambda m, x: m(x), flat, jnp.asarray(x).reshape(-1, 3))
        np.testing.assert_allclose(y.reshape(-1, 3), y_flat, rtol=1e-5, atol=1e-6)
    allx = np.concatenate(xs).reshape(-1, 3).astype(np.float64)
    assert int(norm.count[...]) == 16
    np.testing.assert_allclose(norm.mean[...], allx.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norm.var[...], allx.var(0), rtol=1e-5)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_save_load_round_trip(mode, tmp_path, getkey):
    key = getkey()
    model = Policy(key)
    if mode == "ref":
        model = es.to_refs(model)
    obs = jnp.asarray(np.random.default_rng(8).normal(size=(2, 5, 3)), jnp.float32)
    step = es.make_step(_loss, optax.sgd(0.1))
    opt_state = step.init(model)
    model, opt_state = step(model, opt_state, obs[0], jnp.zeros(5))
    es.save(tmp_path / "ckpt", model)
    fresh = Policy(key)
    loaded = es.load(tmp_path / "ckpt", es.to_refs(fresh) if mode == "ref" else fresh)
    for a, b in zip(
        jax.tree_util.tree_leaves(es.freeze(loaded)),
        jax.tree_util.tree_leaves(es.freeze(model)),
    ):
        np.testing.assert_array_equal(a, b)
    assert int(loaded.norm.count[...]) == 5


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_inference_mode_does_not_update(mode):
    norm = es.nn.RunningNorm(2)
    if mode == "ref":
        norm = es.to_refs(norm)
    ev = eqx.nn.inference_mode(norm)
    x = jnp.asarray([[3.0, 4.0], [5.0, 6.0]])
    y = ev(x)  # initial moments: mean 0, var 1
    np.testing.assert_allclose(y, np.clip(np.asarray(x) / np.sqrt(1 + 1e-8), -5, 5))
    _, ev = es.apply(lambda m, x: m(x), ev, x)
    assert int(ev.count[...]) == 0
    np.testing.assert_array_equal(ev.mean[...], np.zeros(2))


def test_errors():
    norm = es.to_refs(es.nn.RunningNorm((2, 3)))
    with pytest.raises(
        ValueError,
        match=r"got an input of shape \(4, 3, 2\): expected \[\.\.\., 2, 3\]",
    ):
        norm(jnp.ones((4, 3, 2)))
    with pytest.raises(ValueError, match=r"got an input of shape \(3,\)"):
        norm(jnp.ones(3))
    with pytest.raises(ValueError, match="clip must be positive or None"):
        es.nn.RunningNorm(2, clip=0.0)
    with pytest.raises(ValueError, match="dtype must be floating"):
        es.nn.RunningNorm(2, dtype=jnp.int32)
    value = es.nn.RunningNorm(2)
    with pytest.raises(es.StateWriteError, match="no step is running"):
        value(jnp.ones((3, 2)))
    # per-example jax.vmap in training: the statistic needs the whole batch
    with pytest.raises(es.StateWriteError, match="inside `jax.vmap`"):
        es.apply(lambda m, x: jax.vmap(m)(x), value, jnp.ones((4, 2)))
    # es.vmap without axis_name: each example would write its own moments
    x = jnp.arange(8.0).reshape(4, 2)
    with pytest.raises(eqx.EquinoxRuntimeError, match="wrote different values"):
        es.apply(lambda m, x: es.vmap(m)(x), value, x)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_complex_input_is_refused_and_the_fix_matches_numpy(mode):
    """Complex input used to be cast to the float32 moments, dropping the imaginary
    parts without a word; it is refused (as by BatchNorm, with the same message),
    nothing is written, and the fix the message names normalises the real and
    imaginary parts like NumPy."""
    z = np.array([[1 + 5j, 2 - 3j], [3 + 1j, 4 + 2j], [-2 + 0j, 0.5 - 1j]])
    norm, fix = es.nn.RunningNorm(2), es.nn.RunningNorm((2, 2))
    if mode == "ref":
        norm, fix = es.to_refs(norm), es.to_refs(fix)
    with pytest.raises(TypeError, match="does not support complex input") as info:
        _call(mode, norm, jnp.asarray(z, jnp.complex64))
    assert isinstance(info.value, es.EqxStateError)
    assert "RunningNorm((2, 2))" in str(info.value)  # the fix, for this shape
    assert int(norm.count[...]) == 0  # nothing written
    # the fix: real and imaginary parts as features of their own
    parts = np.stack([z.real, z.imag], axis=-1)  # [3, 2, 2]
    y, fixed = _call(mode, fix, jnp.asarray(parts, jnp.float32))
    mean, var = parts.mean(axis=0), parts.var(axis=0)
    np.testing.assert_allclose(fixed.mean[...], mean, rtol=1e-6)
    np.testing.assert_allclose(fixed.var[...], var, rtol=1e-6)
    np.testing.assert_allclose(y, _normalised(parts, mean, var), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "shape,error,match",
    [
        (0, ValueError, r"must be positive, got \(0,\)"),
        ((2, 0), ValueError, r"must be positive, got \(2, 0\)"),
        (-1, ValueError, r"must be positive, got \(-1,\)"),
        (2.5, TypeError, "shape must be an int .* got 2.5"),
        ((2.5,), TypeError, r"tuple of ints .* got \(2.5,\)"),
        ("ab", TypeError, "got 'ab'"),
        ((True,), TypeError, r"got \(True,\)"),
    ],
)
def test_shape_is_checked_at_construction(shape, error, match, monkeypatch):
    """`RunningNorm(0)` used to build a normaliser of nothing, and `(2.5,)` one of
    2 features. (The suite's jaxtyping hook is off: users see the library's error.)"""
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    with pytest.raises(error, match=match) as info:
        es.nn.RunningNorm(shape)
    assert isinstance(info.value, es.EqxStateError)


def test_valid_shapes_and_eps(monkeypatch):
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)  # NumPy ints
    assert es.nn.RunningNorm().shape == ()
    assert es.nn.RunningNorm(3).shape == (3,)
    assert es.nn.RunningNorm([2, 3]).shape == (2, 3)
    assert es.nn.RunningNorm(np.int64(4)).shape == (4,)
    with pytest.raises(ValueError, match="eps must be non-negative") as info:
        es.nn.RunningNorm(3, eps=-1.0)
    assert isinstance(info.value, es.EqxStateError)


# --- the count near 2**31: saturates, never wraps -----------------------------------


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_count_near_int32_max_saturates_instead_of_wrapping(mode):
    """With 2**31 - 10 inputs seen, a batch of 100 used to wrap the int32 count
    (variance -0.99999, NaN outputs). The count saturates at 2**31 - 1 and the batch
    is folded in with weight 100 / (2**31 - 10 + 100), as float64 NumPy computes."""
    near = 2**31 - 10
    norm = es.nn.RunningNorm(2, clip=None)
    norm = eqx.tree_at(
        lambda m: (m.count.value, m.mean.value, m.var.value),
        norm,
        (jnp.asarray(near, jnp.int32), jnp.array([1.0, -2.0]), jnp.array([4.0, 0.25])),
    )
    if mode == "ref":
        norm = es.to_refs(norm)
    x = np.random.default_rng(0).normal(size=(100, 2)).astype(np.float32) * 3 + 5
    y, norm = _call(mode, norm, jnp.asarray(x))
    assert int(norm.count[...]) == 2**31 - 1
    x64 = x.astype(np.float64)
    n, nb = float(near), 100.0
    wa, wb = n / (n + nb), nb / (n + nb)
    delta = x64.mean(0) - np.array([1.0, -2.0])
    mean = np.array([1.0, -2.0]) + delta * wb
    var = np.array([4.0, 0.25]) * wa + x64.var(0) * wb + delta**2 * wa * wb
    np.testing.assert_allclose(norm.mean[...], mean, rtol=1e-6)
    np.testing.assert_allclose(norm.var[...], var, rtol=1e-6)
    assert np.all(np.asarray(norm.var[...]) > 0)
    np.testing.assert_allclose(y, _normalised(x, mean, var, clip=None), rtol=1e-5)
    # and it stays saturated, still finite, on the next batch
    y, norm = _call(mode, norm, jnp.asarray(x))
    assert int(norm.count[...]) == 2**31 - 1
    assert np.all(np.isfinite(np.asarray(y)))


# --- merge: Chan's formula, exact against NumPy on the concatenation ----------------


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("sizes", [(5, 7), (1, 30), (0, 4), (0, 0), (12, 0)])
def test_merge_equals_numpy_on_the_concatenation(mode, sizes):
    rng = np.random.default_rng(1)
    parts = [
        (rng.normal(size=(n, 3)) * (i + 1) + 10 * i).astype(np.float32)
        for i, n in enumerate(sizes)
    ]
    norms = []
    for part in parts:
        norm = es.nn.RunningNorm(3)
        if mode == "ref":
            norm = es.to_refs(norm)
        for chunk in np.array_split(part, 2):  # several updates each
            _, norm = _call(mode, norm, jnp.asarray(chunk))
        norms.append(norm)
    merged = norms[0].merge(norms[1])
    assert not isinstance(merged.mean.value, jax.Ref)  # a value-mode result
    allx = np.concatenate(parts).astype(np.float64)
    assert int(merged.count[...]) == len(allx)
    if len(allx) == 0:  # nothing seen: the initial moments
        np.testing.assert_array_equal(merged.mean[...], np.zeros(3))
        np.testing.assert_array_equal(merged.var[...], np.ones(3))
        return
    np.testing.assert_allclose(merged.mean[...], allx.mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(merged.var[...], allx.var(0), rtol=1e-5)
    # the inputs are unchanged
    assert int(norms[0].count[...]) == sizes[0]
    # and the merged normaliser normalises with the combined moments
    x = rng.normal(size=(4, 3)).astype(np.float32)
    np.testing.assert_allclose(
        eqx.nn.inference_mode(merged)(jnp.asarray(x)),
        _normalised(x, allx.mean(0), allx.var(0)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_merge_is_associative_and_saturates():
    rng = np.random.default_rng(2)
    parts = [rng.normal(size=(n, 2)).astype(np.float32) + 3 for n in (3, 8, 5)]
    norms = []
    for part in parts:
        norm = es.to_refs(es.nn.RunningNorm(2))
        norm(jnp.asarray(part))
        norms.append(es.freeze(norm))
    left = norms[0].merge(norms[1]).merge(norms[2])
    right = norms[0].merge(norms[1].merge(norms[2]))
    for a, b in ((left.mean, right.mean), (left.var, right.var)):
        np.testing.assert_allclose(a[...], b[...], rtol=1e-6)
    big = eqx.tree_at(lambda m: m.count.value, norms[0], jnp.asarray(2**31 - 2))
    assert int(big.merge(big).count[...]) == 2**31 - 1


def test_merge_errors():
    a = es.nn.RunningNorm(2)
    with pytest.raises(ValueError, match="same shape and dtype"):
        a.merge(es.nn.RunningNorm(3))
    with pytest.raises(TypeError, match="needs another RunningNorm"):
        a.merge(es.nn.BatchNorm(2))  # type: ignore[arg-type]


def test_cells_are_batch_stats_with_reset_fills():
    norm = es.nn.RunningNorm(2)
    cells = [c for c in jax.tree.leaves(norm, is_leaf=es.is_state) if es.is_state(c)]
    assert {type(c) for c in cells} == {es.BatchStat}
    assert (norm.mean.init, norm.var.init, norm.count.init) == (0, 1, 0)


def test_unbound_axis_name_is_a_clear_error():
    norm = es.nn.RunningNorm(2, axis_name="env")
    with pytest.raises(NameError, match=r"RunningNorm\(axis_name='env'\).*no axis"):
        es.apply(lambda m, x: m(x), norm, jnp.ones((3, 2)))


@pytest.mark.parametrize(
    "cell, dtype",
    [
        ("mean", jnp.int32),
        ("count", jnp.int8),
        ("count", jnp.float32),
        ("var", jnp.float16),
    ],
)
def test_a_statistic_cell_of_a_dtype_it_cannot_hold_is_refused(cell, dtype):
    norm = es.nn.RunningNorm(3)
    norm = eqx.tree_at(
        lambda n: getattr(n, cell).value, norm, getattr(norm, cell).value.astype(dtype)
    )
    with pytest.raises(TypeError, match=rf"RunningNorm.*{cell}.*holds"):
        es.apply(lambda m, x: m(x), norm, jnp.ones((4, 3)))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_moments_narrower_than_32_bits_are_refused_and_float16_inputs_work(dtype):
    """`RunningNorm(dtype=float16)` went to variance 0, then NaN, after 65,504
    inputs (the count's weights overflow float16), silently. Narrow moments are
    refused, naming the fix; float16 inputs with float32 moments stay equal to
    float64 NumPy past that count."""
    with pytest.raises(ValueError, match=r"32 bits or more.*float16: NaN"):
        es.nn.RunningNorm(3, dtype=dtype)
    norm = es.nn.RunningNorm(3)
    feed = es.make_apply(lambda m, x: m(x))
    rng = np.random.default_rng(0)
    seen = []
    for _ in range(18):  # 73,728 inputs
        x = (rng.normal(size=(4096, 3)) * 2 + 5).astype(np.float16)
        seen.append(x.astype(np.float64))
        y, norm = feed(norm, jnp.asarray(x))
    exact = np.concatenate(seen)
    np.testing.assert_allclose(norm.mean[...], exact.mean(0), rtol=1e-4)
    np.testing.assert_allclose(norm.var[...], exact.var(0), rtol=1e-3)
    assert np.isfinite(np.asarray(y, np.float32)).all()


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "uint32"])
def test_the_layers_counts_saturate_in_every_integer_dtype(dtype):
    """The one rule of the layers' counts (BatchNorm, RunningNorm, EMA, Capture):
    `count + n` stops at the dtype's largest value, against NumPy in int64. A
    uint32 count crashed on a Python int past int32."""
    from eqx_state.nn._counter import saturating_add

    top = int(np.iinfo(dtype).max)
    counts = np.array([0, 5, top - 3, top - 1, top], dtype)
    for n in (0, 1, 3, 7, top - 1, top):
        want = np.minimum(counts.astype(np.int64) + n, top).astype(dtype)
        # a Python int (a layer's `+ 1`), an array of the count's dtype (a
        # merge's count), and both inside a compiled function
        for got in (
            saturating_add(jnp.asarray(counts), n),
            saturating_add(jnp.asarray(counts), jnp.asarray(n, dtype)),
            jax.jit(lambda c, n=n: saturating_add(c, n))(jnp.asarray(counts)),
            jax.jit(saturating_add)(jnp.asarray(counts), jnp.asarray(n, dtype)),
        ):
            assert got.dtype == jnp.dtype(dtype)
            np.testing.assert_array_equal(got, want)


def test_a_merge_of_wide_counts_saturates_at_int32():
    """A uint32 count past int32 (a cell hand-edited or loaded so) merged into a
    RunningNorm saturates at 2**31 - 1, as before the shared rule (it wrapped to
    a negative count)."""
    norm = es.nn.RunningNorm(2)
    wide = eqx.tree_at(
        lambda m: m.count.value, norm, jnp.asarray(3_000_000_000, jnp.uint32)
    )
    small = eqx.tree_at(lambda m: m.count.value, norm, jnp.asarray(5, jnp.int32))
    merged = wide.merge(small)
    assert merged.count[...].dtype == jnp.int32
    assert int(merged.count[...]) == 2**31 - 1
