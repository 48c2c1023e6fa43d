"""SpectralNorm against torch.nn.utils.parametrizations.spectral_norm (same initial
u, v), in both storage modes and under transforms."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from torch.nn.utils.parametrizations import spectral_norm as torch_spectral_norm

import eqx_state as es


def _layer(kind, key):
    if kind == "linear":
        return eqx.nn.Linear(5, 3, key=key)
    return eqx.nn.Conv2d(2, 3, 3, padding=1, key=key)


def _input_shape(kind, n=4):
    return (n, 5) if kind == "linear" else (n, 2, 5, 5)


def _torch_twin(sn):
    """A torch layer with `sn`'s weights, spectral-normalised, with its u, v set to
    `sn`'s."""
    layer = sn.layer
    if isinstance(layer, eqx.nn.Linear):
        t = torch.nn.Linear(layer.in_features, layer.out_features)
    else:
        t = torch.nn.Conv2d(layer.in_channels, layer.out_channels, 3, padding=1)
    with torch.no_grad():
        t.weight.copy_(torch.tensor(np.asarray(layer.weight)))
        t.bias.copy_(torch.tensor(np.asarray(layer.bias).reshape(-1)))
    t = torch_spectral_norm(t, n_power_iterations=sn.n_power_iterations)
    par = t.parametrizations.weight[0]
    with torch.no_grad():
        par._u.copy_(torch.tensor(np.asarray(sn.u[...])))
        par._v.copy_(torch.tensor(np.asarray(sn.v[...])))
    return t


def _torch_state(t):
    par = t.parametrizations.weight[0]
    w = t.parametrizations.weight.original.detach()
    mat = w.reshape(w.shape[0], -1)
    sigma = torch.vdot(par._u, mat @ par._v)  # torch's formula, without iterating
    return par._u.numpy().copy(), par._v.numpy().copy(), float(sigma)


def _numpy_power(w, u, v, n, eps=1e-12):
    mat = np.asarray(w, np.float64).reshape(w.shape[0], -1)
    u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
    for _ in range(n):
        u = mat @ v
        u = u / max(np.linalg.norm(u), eps)
        v = mat.T @ u
        v = v / max(np.linalg.norm(v), eps)
    return u, v


def _call(mode, sn, x):
    if mode == "ref":
        return sn(x), sn
    return es.apply(lambda m, x: m(x), sn, x)


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("n_iter", [1, 2])
def test_matches_torch(mode, kind, n_iter, getkey):
    rng = np.random.default_rng(0)
    sn = es.nn.SpectralNorm(
        _layer(kind, getkey()), n_power_iterations=n_iter, key=getkey()
    )
    t = _torch_twin(sn)
    if mode == "ref":
        sn = es.to_refs(sn)
    t.train()
    for _ in range(3):
        x = rng.normal(size=_input_shape(kind)).astype(np.float32)
        y, sn = _call(mode, sn, jnp.asarray(x))
        ty = t(torch.from_numpy(x)).detach().numpy()
        np.testing.assert_allclose(np.asarray(y), ty, rtol=1e-5, atol=1e-5)
        tu, tv, tsigma = _torch_state(t)
        np.testing.assert_allclose(np.asarray(sn.u[...]), tu, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(sn.v[...]), tv, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(sn.sigma), tsigma, rtol=1e-5)
    # evaluation: stored u, v, nothing written; eager in value mode
    t.eval()
    ev = eqx.nn.inference_mode(sn)
    u_before = np.asarray(sn.u[...])
    x = rng.normal(size=_input_shape(kind)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(ev(jnp.asarray(x))),
        t(torch.from_numpy(x)).detach().numpy(),
        rtol=1e-5,
        atol=1e-5,
    )
    np.testing.assert_array_equal(np.asarray(ev.u[...]), u_before)
    np.testing.assert_array_equal(np.asarray(sn.u[...]), u_before)
    # and the eval output really is W / sigma applied with the stored sigma
    np.testing.assert_allclose(
        np.asarray(ev(jnp.asarray(x))),
        np.asarray(
            jax.vmap(eqx.tree_at(lambda m: m.weight, sn.layer, sn.weight / sn.sigma))(x)
        ),
        rtol=1e-5,
        atol=1e-5,
    )


def test_sigma_converges_to_largest_singular_value(getkey):
    sn = es.nn.SpectralNorm(
        eqx.nn.Linear(6, 4, key=getkey()), n_power_iterations=30, key=getkey()
    )
    _, sn = eqx.filter_jit(es.apply)(lambda m, x: m(x), sn, jnp.ones(6))
    top = np.linalg.svd(np.asarray(sn.weight), compute_uv=False)[0]
    np.testing.assert_allclose(float(sn.sigma), top, rtol=1e-5)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_make_step_matches_torch_training(mode, getkey):
    """Gradients flow through W and sigma with u, v constant, as in torch; the step
    trains the weight and advances u, v once per step."""
    rng = np.random.default_rng(1)
    sn = es.nn.SpectralNorm(eqx.nn.Linear(5, 3, key=getkey()), key=getkey())
    t = _torch_twin(sn)
    topt = torch.optim.SGD(t.parameters(), lr=0.5)
    if mode == "ref":
        sn = es.to_refs(sn)

    def loss_fn(sn, x, y):
        return jnp.mean((sn(x) - y) ** 2)

    step = es.make_step(loss_fn, optax.sgd(0.5))
    opt_state = step.init(sn)
    for _ in range(3):
        x = rng.normal(size=(8, 5)).astype(np.float32)
        y = rng.normal(size=(8, 3)).astype(np.float32)
        sn, opt_state = step(sn, opt_state, jnp.asarray(x), jnp.asarray(y))
        topt.zero_grad()
        torch.nn.functional.mse_loss(
            t(torch.from_numpy(x)), torch.from_numpy(y)
        ).backward()
        topt.step()
        tw = t.parametrizations.weight.original.detach().numpy()
        np.testing.assert_allclose(np.asarray(sn.weight), tw, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            np.asarray(sn.layer.bias), t.bias.detach().numpy(), rtol=1e-5, atol=1e-6
        )
        tu, tv, _ = _torch_state(t)
        np.testing.assert_allclose(np.asarray(sn.u[...]), tu, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(sn.v[...]), tv, rtol=1e-5, atol=1e-6)
    assert step.trace_count == 1


def test_state_is_not_trained_by_adamw(getkey):
    sn = es.nn.SpectralNorm(eqx.nn.Linear(5, 3, key=getkey()), key=getkey())
    assert len(jax.tree_util.tree_leaves(es.params(sn))) == 2  # weight, bias

    def loss_fn(sn, x):
        return jnp.sum(sn(x) ** 2)

    step = es.make_step(loss_fn, optax.adamw(0.1, weight_decay=0.5), donate=False)
    new, _ = step(sn, step.init(sn), jnp.ones((4, 5)))
    # u, v are one power iteration on the pre-step weight; no decay, no Adam step
    u, v = _numpy_power(sn.weight, sn.u[...], sn.v[...], 1)
    np.testing.assert_allclose(np.asarray(new.u[...]), u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new.v[...]), v, rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(new.weight), np.asarray(sn.weight))


def test_jit_compiles_once(getkey):
    sn = es.nn.SpectralNorm(eqx.nn.Linear(5, 3, key=getkey()), key=getkey())
    u, v = np.asarray(sn.u[...]), np.asarray(sn.v[...])

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def run(sn, x):
        return es.apply(lambda m, x: m(x), sn, x)

    for _ in range(3):
        _, sn = run(sn, jnp.ones((2, 5)))
    u, v = _numpy_power(sn.weight, u, v, 3)
    np.testing.assert_allclose(np.asarray(sn.u[...]), u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sn.v[...]), v, rtol=1e-5, atol=1e-6)


def test_vmap_over_ensemble_equals_solo_runs(getkey):
    keys = jax.random.split(getkey(), 3)

    def make(k):
        k1, k2 = jax.random.split(k)
        return es.nn.SpectralNorm(eqx.nn.Linear(5, 3, key=k1), key=k2)

    def run(sn, xs):
        for x in xs:
            _, sn = es.apply(lambda m, x: m(x), sn, x)
        return sn, es.apply(lambda m, x: m(x), sn, xs[0])[0]

    models = eqx.filter_jit(eqx.filter_vmap(make))(keys)
    xs = jax.random.normal(getkey(), (3, 2, 4, 5))
    trained, ys = eqx.filter_jit(eqx.filter_vmap(run))(models, xs)
    solo_run = eqx.filter_jit(run)
    for i in range(3):
        solo, y = solo_run(make(keys[i]), xs[i])
        np.testing.assert_allclose(trained.u[...][i], solo.u[...], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(trained.v[...][i], solo.v[...], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ys[i], y, rtol=1e-5, atol=1e-5)


def test_scan_over_calls(getkey):
    sn = es.nn.SpectralNorm(
        eqx.nn.Linear(5, 3, key=getkey()), n_power_iterations=2, key=getkey()
    )
    u0, v0 = np.asarray(sn.u[...]), np.asarray(sn.v[...])
    xs = jax.random.normal(getkey(), (4, 6, 5))

    def run(sn, xs):
        return jax.lax.scan(lambda c, x: (c, sn(x)), None, xs)[1]

    ys, sn = eqx.filter_jit(lambda m, xs: es.apply(run, m, xs))(sn, xs)
    u, v = _numpy_power(sn.weight, u0, v0, 8)
    np.testing.assert_allclose(np.asarray(sn.u[...]), u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sn.v[...]), v, rtol=1e-5, atol=1e-6)
    # the last output used the last u, v
    w = np.asarray(sn.weight) / (u @ np.asarray(sn.weight) @ v)
    np.testing.assert_allclose(
        ys[-1], xs[-1] @ w.T + np.asarray(sn.layer.bias), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_checkpoint_under_grad_updates_once(mode, getkey):
    def loss_fn(sn, x):
        return jnp.sum(sn(x) ** 2)

    def remat_loss(sn, x):
        return eqx.filter_checkpoint(loss_fn)(sn, x)

    x = jnp.ones((4, 5))
    k1, k2 = getkey(), getkey()
    results = []
    for loss in (loss_fn, remat_loss):
        sn = es.nn.SpectralNorm(eqx.nn.Linear(5, 3, key=k1), key=k2)
        u, v = _numpy_power(sn.weight, sn.u[...], sn.v[...], 1)
        if mode == "ref":
            sn = es.to_refs(sn)
        step = es.make_step(loss, optax.sgd(0.01))
        sn, _ = step(sn, step.init(sn), x)
        np.testing.assert_allclose(np.asarray(sn.u[...]), u, rtol=1e-5, atol=1e-6)
        results.append([np.asarray(sn.v[...]), np.asarray(sn.weight)])
        np.testing.assert_allclose(results[-1][0], v, rtol=1e-5, atol=1e-6)
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_per_example_es_vmap_equals_batched_call(mode, getkey):
    """Equinox-style per-example code through `es.vmap`: every example computes the
    same u, v, written once: the same as one call on the batch."""
    k1, k2 = getkey(), getkey()
    a = es.nn.SpectralNorm(eqx.nn.Linear(5, 3, key=k1), key=k2)
    b = es.nn.SpectralNorm(eqx.nn.Linear(5, 3, key=k1), key=k2)
    if mode == "ref":
        a, b = es.to_refs(a), es.to_refs(b)
    x = jax.random.normal(getkey(), (4, 5))
    for _ in range(2):
        ya, a = es.apply(lambda m, x: es.vmap(m)(x), a, x)
        yb, b = es.apply(lambda m, x: m(x), b, x)
        np.testing.assert_allclose(ya, yb, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a.u[...], b.u[...], rtol=1e-6)
    np.testing.assert_allclose(a.v[...], b.v[...], rtol=1e-6)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_save_load_round_trip(mode, tmp_path, getkey):
    k1, k2 = getkey(), getkey()
    make = lambda: es.nn.SpectralNorm(_layer("conv", k1), key=k2)  # noqa: E731
    sn = make()
    if mode == "ref":
        sn = es.to_refs(sn)
    _, sn = es.apply(lambda m, x: m(x), sn, jnp.ones((2, 2, 5, 5)))
    es.save(tmp_path / "ckpt", sn)
    loaded = es.load(tmp_path / "ckpt", es.to_refs(make()) if mode == "ref" else make())
    for a, b in zip(
        jax.tree_util.tree_leaves(es.freeze(loaded)),
        jax.tree_util.tree_leaves(es.freeze(sn)),
    ):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(loaded.u[...], make().u[...])


def test_single_example_and_scalar_linear(getkey):
    sn = es.to_refs(es.nn.SpectralNorm(eqx.nn.Linear(5, 3, key=getkey()), key=getkey()))
    x = jax.random.normal(getkey(), (5,))
    y = sn(x)
    assert y.shape == (3,)
    w = np.asarray(sn.weight) / float(sn.sigma)
    np.testing.assert_allclose(
        y, w @ np.asarray(x) + np.asarray(sn.layer.bias), rtol=1e-5
    )
    sc = es.to_refs(
        es.nn.SpectralNorm(eqx.nn.Linear("scalar", 4, key=getkey()), key=getkey())
    )
    assert sc(jnp.ones((2, 3))).shape == (2, 3, 4)


def test_errors(getkey):
    lin = es.to_refs(
        es.nn.SpectralNorm(eqx.nn.Linear(5, 3, key=getkey()), key=getkey())
    )
    with pytest.raises(
        ValueError, match=r"got an input of shape \(4, 6\): expected \[\.\.\., 5\]"
    ):
        lin(jnp.ones((4, 6)))
    conv = es.to_refs(es.nn.SpectralNorm(_layer("conv", getkey()), key=getkey()))
    with pytest.raises(
        ValueError, match=r"2 input channels\) got an input of shape \(4, 3, 5, 5\)"
    ):
        conv(jnp.ones((4, 3, 5, 5)))
    with pytest.raises(ValueError, match=r"shape \(5, 5\).*\[2, \.\.\., \.\.\.\]"):
        conv(jnp.ones((5, 5)))
    with pytest.raises(ValueError, match="no floating-point array field 'kernel'"):
        es.nn.SpectralNorm(eqx.nn.Linear(5, 3, key=getkey()), "kernel", key=getkey())
    with pytest.raises(ValueError, match="needs a matrix"):
        es.nn.SpectralNorm(eqx.nn.LayerNorm(4), key=getkey())
    with pytest.raises(ValueError, match="n_power_iterations must be >= 1"):
        es.nn.SpectralNorm(
            eqx.nn.Linear(5, 3, key=getkey()), n_power_iterations=0, key=getkey()
        )
    value = es.nn.SpectralNorm(eqx.nn.Linear(5, 3, key=getkey()), key=getkey())
    with pytest.raises(es.StateWriteError, match="no step is running"):
        value(jnp.ones(5))
    # per-example jax.vmap in training cannot write state: a clear error
    with pytest.raises(es.StateWriteError, match="inside `jax.vmap`"):
        es.apply(lambda m, x: jax.vmap(m)(x), value, jnp.ones((4, 5)))
    # ...while in evaluation per-example vmap is fine
    ev = eqx.nn.inference_mode(value)
    np.testing.assert_allclose(
        jax.vmap(ev)(jnp.ones((4, 5))), ev(jnp.ones((4, 5))), rtol=1e-6
    )


# --- one batching rule for every wrapped layer --------------------------------------


class RowMix(eqx.Module):
    """A layer that is neither Linear nor Conv: one example is a matrix [in, k],
    mixed along its rows, `weight @ x`."""

    weight: jax.Array

    def __init__(self, key):
        self.weight = jax.random.normal(key, (4, 3))

    def __call__(self, x):
        return self.weight @ x


class TorchRowMix(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(np.asarray(weight)))

    def forward(self, x):  # batched natively: [N, in, k] -> [N, out, k]
        return self.weight @ x


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_any_layer_with_input_ndim_batches_like_torch(mode, getkey):
    """A custom layer taking [in, k] per example, called on a batch [N, in, k]:
    mapped over N (a plain call would compute weight @ x on the batch, which for
    this layer does not even fail). Against torch spectral_norm on the same
    module: outputs, u, v, sigma over several training calls; then one example."""
    sn = es.nn.SpectralNorm(RowMix(getkey()), input_ndim=2, key=getkey())
    t = torch_spectral_norm(TorchRowMix(sn.weight))
    par = t.parametrizations.weight[0]
    with torch.no_grad():
        par._u.copy_(torch.tensor(np.asarray(sn.u[...])))
        par._v.copy_(torch.tensor(np.asarray(sn.v[...])))
    if mode == "ref":
        sn = es.to_refs(sn)
    rng = np.random.default_rng(1)
    for _ in range(3):
        x = rng.normal(size=(5, 3, 2)).astype(np.float32)
        y, sn = _call(mode, sn, jnp.asarray(x))
        assert y.shape == (5, 4, 2)
        np.testing.assert_allclose(
            y, t(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-5
        )
        tu, tv, tsigma = _torch_state(t)
        np.testing.assert_allclose(sn.u[...], tu, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(sn.v[...], tv, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(sn.sigma), tsigma, rtol=1e-5)
    # one example (rank input_ndim) is called as is; several batch axes flatten
    ev = eqx.nn.inference_mode(sn)
    t.eval()
    x = rng.normal(size=(2, 3, 3, 2)).astype(np.float32)
    want = t(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(ev(jnp.asarray(x)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ev(jnp.asarray(x[0, 0])), want[0, 0], rtol=1e-5)
    with pytest.raises(
        ValueError, match=r"input_ndim=2\) got an input of shape \(3,\)"
    ):
        ev(jnp.ones(3))


def test_square_linear_on_a_square_batch_is_mapped(getkey):
    """Linear(5, 5) on a batch [5, 5]: `weight @ x` would run without error and
    be wrong; the rule (input_ndim 1 for Linear) maps over the rows, as torch."""
    sn = es.nn.SpectralNorm(eqx.nn.Linear(5, 5, key=getkey()), key=getkey())
    assert sn.input_ndim == 1
    t = torch.nn.Linear(5, 5)
    with torch.no_grad():
        t.weight.copy_(torch.tensor(np.asarray(sn.weight)))
        t.bias.copy_(torch.tensor(np.asarray(sn.layer.bias)))
    t = torch_spectral_norm(t)
    par = t.parametrizations.weight[0]
    with torch.no_grad():
        par._u.copy_(torch.tensor(np.asarray(sn.u[...])))
        par._v.copy_(torch.tensor(np.asarray(sn.v[...])))
    x = np.random.default_rng(2).normal(size=(5, 5)).astype(np.float32)
    y, sn = _call("value", sn, jnp.asarray(x))
    np.testing.assert_allclose(
        y, t(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-5
    )


def test_other_layers_need_input_ndim(getkey):
    with pytest.raises(ValueError, match="cannot tell the rank of one input of RowMix"):
        es.nn.SpectralNorm(RowMix(getkey()), key=getkey())
    with pytest.raises(ValueError, match="input_ndim must be >= 0"):
        es.nn.SpectralNorm(RowMix(getkey()), input_ndim=-1, key=getkey())
    conv = es.nn.SpectralNorm(eqx.nn.Conv1d(2, 3, 3, key=getkey()), key=getkey())
    assert conv.input_ndim == 2
    sc = es.nn.SpectralNorm(eqx.nn.Linear("scalar", 3, key=getkey()), key=getkey())
    assert sc.input_ndim == 0


def test_cells_are_power_iteration_state_without_reset_fill(getkey):
    sn = es.nn.SpectralNorm(eqx.nn.Linear(3, 2, key=getkey()), key=getkey())
    cells = [c for c in jax.tree.leaves(sn, is_leaf=es.is_state) if es.is_state(c)]
    assert [type(c) for c in cells] == [es.PowerIterationState] * 2
    assert [c.init for c in cells] == [None, None]  # random: nothing to reset to


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("groups", [1, 2])
def test_conv_transpose_matches_torch_grouped_too(mode, groups):
    """PyTorch normalises a ConvTranspose's weight `[in, out/g, *k]` along dim 1, so
    for `groups > 1` its matrix is `(out/g, in * k)`, not `(out, in/g * k)`. Both
    sides power-iterated to convergence from their own starts: sigma equals the
    top singular value of PyTorch's matrix (float64 NumPy), and so do the outputs."""
    torch.manual_seed(0)
    t = torch.nn.ConvTranspose2d(4, 6, 3, groups=groups)
    layer = eqx.nn.ConvTranspose2d(4, 6, 3, groups=groups, key=jax.random.key(0))
    layer = es.load_state_dict(layer, t.state_dict())
    w = t.weight.detach().numpy().astype(np.float64)
    top = np.linalg.svd(np.moveaxis(w, 1, 0).reshape(w.shape[1], -1))[1][0]
    t = torch_spectral_norm(t, n_power_iterations=200)
    sn = es.nn.SpectralNorm(layer, n_power_iterations=200, key=jax.random.key(1))
    if mode == "ref":
        sn = es.to_refs(sn)
    x = np.random.default_rng(0).normal(size=(2, 4, 5, 5)).astype(np.float32)
    y, sn = _call(mode, sn, jnp.asarray(x))
    with torch.no_grad():
        ty = t(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(float(sn.sigma), top, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(y), ty, rtol=1e-4, atol=1e-5)


def test_a_transposed_convolution_port_with_pytorchs_dim_is_told_ours():
    """PyTorch's default `dim=1` for a ConvTranspose counts the axes of its layout
    `[in, out, *k]`; ours counts Equinox's `[out, in, *k]`, so PyTorch's default is
    our default 0. Given PyTorch's number, `u` has the input size, not the output
    size: the size error says what `dim` counts. With our default, PyTorch's state
    dict loads and the output equals PyTorch's."""
    torch.manual_seed(0)
    t = torch_spectral_norm(torch.nn.ConvTranspose2d(4, 6, 3))  # its dim=1
    x = np.random.default_rng(0).normal(size=(2, 4, 5, 5)).astype(np.float32)
    with torch.no_grad():
        t.eval()
        ty = t(torch.from_numpy(x)).numpy()
    layer = eqx.nn.ConvTranspose2d(4, 6, 3, key=jax.random.key(0))
    bad = es.nn.SpectralNorm(layer, dim=1, key=jax.random.key(1))
    with pytest.raises(ValueError, match="Size mismatch") as info:
        es.load_state_dict(bad, t.state_dict())
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "dim=1 of a transposed convolution is dim=0 here" in notes
    good = es.nn.SpectralNorm(layer, key=jax.random.key(1))
    good = eqx.nn.inference_mode(es.load_state_dict(good, t.state_dict()))
    y, _ = es.apply(lambda m, x: m(x), good, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(y), ty, rtol=1e-5, atol=1e-6)
