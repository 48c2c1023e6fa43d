"""EMA against a hand-written numpy EMA (Haiku's semantics) and
torch.optim.swa_utils.AveragedModel, in both storage modes and under transforms."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import eqx_state as es


CONFIGS = {
    "plain": {},
    "zero_debias": {"zero_debias": True},
    "warmup": {"warmup_length": 2},
    "dynamic": {"dynamic_decay": True},
}


def _net(key):
    return eqx.nn.MLP(3, 2, 4, 1, activation=jnp.tanh, key=key)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(es.params(tree))]


def _perturbed(net, rng, scale):
    """`net` with every parameter moved by independent noise."""
    return jax.tree_util.tree_map(
        lambda x: (
            x + jnp.asarray(rng.normal(size=x.shape) * scale, x.dtype)
            if eqx.is_inexact_array(x)
            else x
        ),
        net,
    )


class NumpyEMA:
    """Haiku's ExponentialMovingAverage, leaf by leaf, written from its definition;
    the start is the initial parameters (zeros with zero_debias)."""

    def __init__(
        self, init, decay, zero_debias=False, warmup_length=0, dynamic_decay=False
    ):
        self.h = [np.zeros_like(x) if zero_debias else x.copy() for x in init]
        self.decay = decay
        self.zero_debias = zero_debias
        self.warmup = warmup_length
        self.dynamic = dynamic_decay
        self.k = 0

    def update(self, leaves):
        self.k += 1
        t = self.k - self.warmup
        if t <= 0:
            d = 0.0
        elif self.dynamic:
            n = t - 1
            d = min(self.decay, (1 + n) / (10 + n))
        else:
            d = self.decay
        self.h = [d * h + (1 - d) * x for h, x in zip(self.h, leaves)]

    def average(self):
        if self.zero_debias and self.k > 0:
            return [h / (1 - self.decay**self.k) for h in self.h]
        return self.h


def _update(mode, ema, net):
    if mode == "ref":
        ema.update(net)
        return ema
    _, ema = es.apply(lambda m, n: m.update(n), ema, net)
    return ema


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_numpy(mode, config, getkey):
    kw = CONFIGS[config]
    rng = np.random.default_rng(0)
    net = _net(getkey())
    ema = es.nn.EMA(net, decay=0.8, **kw)
    ref = NumpyEMA(_leaves(net), 0.8, **kw)
    if mode == "ref":
        ema = es.to_refs(ema)
    for k in range(6):
        current = _perturbed(net, rng, k + 1.0)
        ema = _update(mode, ema, current)
        ref.update(_leaves(current))
        assert int(ema.steps) == k + 1
        for got, want in zip(_leaves(ema.average), ref.average()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        # `averaged` puts the same numbers into the model's structure
        swapped = ema.averaged(current)
        assert jax.tree_util.tree_structure(swapped) == jax.tree_util.tree_structure(
            current
        )
        for got, want in zip(_leaves(swapped), ref.average()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_zero_debias_before_first_update_returns_model(getkey):
    net = _net(getkey())
    ema = es.nn.EMA(net, decay=0.9, zero_debias=True)
    for got, want in zip(_leaves(ema.averaged(net)), _leaves(net)):
        np.testing.assert_array_equal(got, want)
    # After one update, the debiased average is exactly the value seen.
    other = _perturbed(net, np.random.default_rng(1), 1.0)
    _, ema = es.apply(lambda m, n: m.update(n), ema, other)
    for got, want in zip(_leaves(ema.averaged(net)), _leaves(other)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


class Model(eqx.Module):
    net: eqx.nn.MLP
    ema: es.nn.EMA

    def __init__(self, key, **kw):
        self.net = _net(key)
        self.ema = es.nn.EMA(self.net, **kw)


def _loss(model, x, y):
    model.ema.update(model.net)
    return jnp.mean((jax.vmap(model.net)(x) - y) ** 2)


def _torch_from(net):
    t = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
    )
    with torch.no_grad():
        for p, x in zip(t.parameters(), _leaves(net)):
            p.copy_(torch.from_numpy(x.copy()))
    return t


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("warmup_length", [0, 1])
def test_make_step_matches_torch_averaged_model(mode, warmup_length, getkey):
    """Training with the EMA updated inside `loss_fn` equals torch SGD with
    `AveragedModel(..., get_ema_multi_avg_fn)` updated before each optimizer step
    (the step's loss sees the parameters the step starts from)."""
    decay = 0.7
    rng = np.random.default_rng(0)
    model = Model(getkey(), decay=decay, warmup_length=warmup_length)
    tnet = _torch_from(model.net)
    tavg = AveragedModel(tnet, multi_avg_fn=get_ema_multi_avg_fn(decay))
    topt = torch.optim.SGD(tnet.parameters(), lr=0.1)
    if mode == "ref":
        model = es.to_refs(model)
    step = es.make_step(_loss, optax.sgd(0.1))
    opt_state = step.init(model)
    for _ in range(4):
        x = rng.normal(size=(8, 3)).astype(np.float32)
        y = rng.normal(size=(8, 2)).astype(np.float32)
        model, opt_state = step(model, opt_state, jnp.asarray(x), jnp.asarray(y))
        tavg.update_parameters(tnet)
        topt.zero_grad()
        torch.nn.functional.mse_loss(
            tnet(torch.from_numpy(x)), torch.from_numpy(y)
        ).backward()
        topt.step()
        for got, want in zip(_leaves(model.net), tnet.parameters()):
            np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-5, atol=1e-6)
        averaged = model.ema.averaged(model.net)
        for got, want in zip(_leaves(averaged), tavg.module.parameters()):
            np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert step.trace_count == 1
    # evaluating with the averaged weights = torch's averaged model
    x = rng.normal(size=(5, 3)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(jax.vmap(averaged)(jnp.asarray(x))),
        tavg(torch.from_numpy(x)).detach().numpy(),
        rtol=1e-5,
        atol=1e-6,
    )


def test_state_is_not_trained_by_adamw(getkey):
    """The average is not a parameter: adamw's weight decay (and its gradient
    step) never touch it, even though it is stored in the trained model."""
    model = Model(getkey(), decay=0.5)
    assert len(jax.tree_util.tree_leaves(es.params(model))) == 4  # the MLP only
    x = jnp.ones((4, 3))
    y = jnp.zeros((4, 2))

    def loss_no_update(model, x, y):
        return jnp.mean((jax.vmap(model.net)(x) - y) ** 2)

    step = es.make_step(
        loss_no_update, optax.adamw(0.1, weight_decay=0.5), donate=False
    )
    opt_state = step.init(model)
    new, _ = step(model, opt_state, x, y)
    for got, want in zip(_leaves(new.ema.average), _leaves(model.ema.average)):
        np.testing.assert_array_equal(got, want)
    assert not np.allclose(_leaves(new.net)[0], _leaves(model.net)[0])
    # With the update in the loss: exactly one EMA step of the pre-step params.
    step = es.make_step(_loss, optax.adamw(0.1, weight_decay=0.5), donate=False)
    new, _ = step(model, step.init(model), x, y)
    for got, h, p in zip(
        _leaves(new.ema.average), _leaves(model.ema.average), _leaves(model.net)
    ):
        np.testing.assert_allclose(got, 0.5 * h + 0.5 * p, rtol=1e-6)


def test_donated_step_keeps_average_separate_from_params(getkey):
    """`EMA(net)` copies the parameters: with donation, the cell and the parameter
    must not be one buffer (they would become tied inside the step)."""
    model = Model(getkey(), decay=0.9)
    before = _leaves(model.net)
    step = es.make_step(_loss, optax.sgd(1.0))
    opt_state = step.init(model)
    model, opt_state = step(model, opt_state, jnp.ones((4, 3)), jnp.ones((4, 2)))
    for avg, p0, p1 in zip(_leaves(model.ema.average), before, _leaves(model.net)):
        np.testing.assert_allclose(avg, p0, rtol=1e-6)  # 0.9 * p0 + 0.1 * p0
        assert not np.allclose(p1, p0)


def test_jit_compiles_once_and_matches(getkey):
    rng = np.random.default_rng(2)
    net = _net(getkey())
    ema = es.nn.EMA(net, decay=0.6, zero_debias=True)
    ref = NumpyEMA(_leaves(net), 0.6, zero_debias=True)

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def run(ema, net):
        return es.apply(lambda m, n: m.update(n), ema, net)[1]

    for _ in range(4):
        current = _perturbed(net, rng, 1.0)
        ema = run(ema, current)
        ref.update(_leaves(current))
    for got, want in zip(_leaves(ema.average), ref.average()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_grad_does_not_flow_into_or_through_state(getkey):
    """Under `jax.grad` the update writes, but the gradient of a loss that reads
    the averaged model is zero with respect to the live parameters."""
    net = _net(getkey())
    ema = es.to_refs(es.nn.EMA(net, decay=0.5))
    other = _perturbed(net, np.random.default_rng(3), 1.0)

    def loss(net, x):
        ema.update(net)
        return jnp.sum(jax.vmap(ema.averaged(net))(x) ** 2)

    grads = eqx.filter_grad(loss)(other, jnp.ones((2, 3)))
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree_util.tree_leaves(grads))
    for got, h, p in zip(_leaves(ema.average), _leaves(net), _leaves(other)):
        np.testing.assert_allclose(got, 0.5 * h + 0.5 * p, rtol=1e-6)


@pytest.mark.slow
def test_vmap_over_ensemble_equals_solo_runs(getkey):
    keys = jax.random.split(getkey(), 3)
    make = lambda k: Model(k, decay=0.75, zero_debias=True)  # noqa: E731
    models = eqx.filter_jit(eqx.filter_vmap(make))(keys)
    rng = np.random.default_rng(4)
    xs = jnp.asarray(rng.normal(size=(3, 2, 8, 3)), jnp.float32)
    ys = jnp.asarray(rng.normal(size=(3, 2, 8, 2)), jnp.float32)
    step = es.make_step(_loss, optax.sgd(0.1), donate=False)

    def train(model, x, y):
        opt_state = step.init(model)
        for i in range(2):
            model, opt_state = step(model, opt_state, x[i], y[i])
        return model

    trained = eqx.filter_vmap(train)(models, xs, ys)
    for i in range(3):
        solo = train(make(keys[i]), xs[i], ys[i])
        member = jax.tree_util.tree_map(
            lambda a, i=i: a[i] if eqx.is_array(a) else a, trained
        )
        for got, want in zip(_leaves(member.ema.average), _leaves(solo.ema.average)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert int(member.ema.steps) == 2


def test_scan_over_updates(getkey):
    rng = np.random.default_rng(5)
    net = _net(getkey())
    nets = [_perturbed(net, rng, 1.0) for _ in range(5)]
    # scan over the parameters only (`es.params` layout; `update` accepts it)
    stacked = jax.tree_util.tree_map(
        lambda *xs: jnp.stack(xs), *[es.params(n) for n in nets]
    )
    ema = es.nn.EMA(net, decay=0.8, dynamic_decay=True)
    ref = NumpyEMA(_leaves(net), 0.8, dynamic_decay=True)
    for n in nets:
        ref.update(_leaves(n))

    def run(ema, stacked):
        def body(carry, n):
            ema.update(n)
            return carry, None

        return jax.lax.scan(body, None, stacked)

    _, ema = eqx.filter_jit(lambda m, s: es.apply(run, m, s))(ema, stacked)
    assert int(ema.steps) == 5
    for got, want in zip(_leaves(ema.average), ref.average()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_checkpoint_under_grad_updates_once(mode, getkey):
    def remat_loss(model, x, y):
        return eqx.filter_checkpoint(_loss)(model, x, y)

    x, y = jnp.ones((4, 3)), jnp.zeros((4, 2))
    results = []
    for loss in (_loss, remat_loss):
        model = Model(jax.random.key(7), decay=0.5)
        if mode == "ref":
            model = es.to_refs(model)
        step = es.make_step(loss, optax.sgd(0.1))
        opt_state = step.init(model)
        for _ in range(2):
            model, opt_state = step(model, opt_state, x, y)
        assert int(model.ema.steps) == 2
        results.append(_leaves(model.ema.average) + _leaves(model.net))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_save_load_round_trip(mode, tmp_path, getkey):
    key = getkey()
    model = Model(key, decay=0.5, zero_debias=True)
    if mode == "ref":
        model = es.to_refs(model)
    step = es.make_step(_loss, optax.sgd(0.1))
    opt_state = step.init(model)
    for _ in range(2):
        model, opt_state = step(model, opt_state, jnp.ones((4, 3)), jnp.zeros((4, 2)))
    es.save(tmp_path / "ckpt", model)
    fresh = Model(key, decay=0.5, zero_debias=True)
    loaded = es.load(tmp_path / "ckpt", es.to_refs(fresh) if mode == "ref" else fresh)
    assert int(loaded.ema.steps) == 2
    for got, want in zip(_leaves(loaded.ema.average), _leaves(model.ema.average)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(_leaves(loaded.net), _leaves(model.net)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_inference_mode_does_not_update(mode, getkey):
    model = Model(getkey(), decay=0.5)
    if mode == "ref":
        model = es.to_refs(model)
    ev = eqx.nn.inference_mode(model)
    assert ev.ema.inference
    before = _leaves(model.ema.average)
    other = _perturbed(model.net, np.random.default_rng(6), 1.0)
    ev.ema.update(other)  # eager, even in value mode: nothing is written
    _, ev = es.apply(lambda m, n: m.ema.update(n), ev, other)
    assert int(ev.ema.steps) == 0
    for got, want in zip(_leaves(ev.ema.average), before):
        np.testing.assert_array_equal(got, want)
    # back to training: it updates again
    tr = eqx.nn.inference_mode(ev, value=False)
    _, tr = es.apply(lambda m, n: m.ema.update(n), tr, other)
    assert int(tr.ema.steps) == 1


def test_errors(getkey):
    net = _net(getkey())
    ema = es.nn.EMA(net)
    with pytest.raises(es.StateWriteError, match="value mode and no step is running"):
        ema.update(net)
    with pytest.raises(ValueError, match="do not have the structure"):
        es.apply(lambda m, n: m.update(n), ema, eqx.nn.Linear(3, 2, key=getkey()))
    with pytest.raises(ValueError, match="do not have the structure"):
        ema.averaged({"weight": jnp.ones(3)})
    wider = eqx.nn.MLP(3, 2, 5, 1, activation=jnp.tanh, key=getkey())
    with pytest.raises(ValueError, match=r"`model\.width_size` is 5, where the EMA"):
        ema.averaged(wider)  # static sizes are part of the structure
    ema_dict = es.nn.EMA({"w": jnp.ones(3)})
    with pytest.raises(ValueError, match=r"`model\['w'\]` has shape \(4,\), where"):
        ema_dict.averaged({"w": jnp.ones(4)})
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\)"):
        es.nn.EMA(net, decay=1.0)
    with pytest.raises(ValueError, match="cannot be combined with warmup_length"):
        es.nn.EMA(net, zero_debias=True, warmup_length=3)
    with pytest.raises(ValueError, match="cannot be combined with dynamic_decay"):
        es.nn.EMA(net, zero_debias=True, dynamic_decay=True)
    with pytest.raises(ValueError, match="no parameters to average"):
        es.nn.EMA({"step": jnp.zeros((), jnp.int32)})


def test_another_model_names_what_differs(getkey):
    """`EMA.update(Linear(3, 4))` for an EMA of a `Linear(3, 3)` used to say "2
    parameter arrays, expected 2 ... a field that holds no parameter differs"; the
    message names each difference by its path in the model."""
    lin = eqx.nn.Linear(3, 3, key=getkey())
    ema = es.nn.EMA(lin, decay=0.9)
    cases = {
        "out_features": (
            eqx.nn.Linear(3, 4, key=getkey()),
            [
                "`model.out_features` is 4, where the EMA's model had 3",
                "`model.weight` has shape (4, 3), where the EMA keeps an average of "
                "shape (3, 3)",
                "`model.bias` has shape (4,)",
            ],
        ),
        "no bias": (
            eqx.nn.Linear(3, 3, use_bias=False, key=getkey()),
            [
                "`model.use_bias` is False, where the EMA's model had True",
                "`model.bias` is None (no parameter), where the EMA's model had a "
                "parameter of shape (3,)",
            ],
        ),
        "another type": ({"weight": jnp.ones((3, 3))}, ["`model` is a dict"]),
    }
    for name, (other, parts) in cases.items():
        with pytest.raises(ValueError, match="do not have the structure") as info:
            es.apply(lambda e, m: e.update(m), ema, other)
        assert isinstance(info.value, es.EqxStateError)
        for part in parts:
            assert part in str(info.value), (name, part, str(info.value))
        assert "match in number" not in str(info.value)  # the old guess
    keys = es.nn.EMA({"w": jnp.ones(3)})
    with pytest.raises(ValueError, match=r"`model` holds \['v'\], where .* \['w'\]"):
        keys.averaged({"v": jnp.ones(3)})


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_complex_parameters_are_refused_by_a_real_average(mode, getkey):
    """The parameters of a complex model used to be cast into the EMA's float32
    average, dropping their imaginary parts; they are refused (the refusal the
    normalisation layers share) before anything is written. An EMA built from
    complex parameters averages them like NumPy."""
    lin = eqx.nn.Linear(2, 2, key=getkey())
    as_complex = jax.tree.map(
        lambda a: a.astype(jnp.complex64) * (1 + 1j) if eqx.is_array(a) else a, lin
    )
    ema = es.nn.EMA(lin, decay=0.9)
    if mode == "ref":
        ema = es.to_refs(ema)
    with pytest.raises(TypeError, match="does not support complex input") as info:
        _run(mode, ema, as_complex)
    assert isinstance(info.value, es.EqxStateError)
    assert "`model.weight`" in str(info.value)
    assert int(ema.count[...]) == 0
    # an EMA of the complex model: h <- h + (1 - d) (p - h), in complex128 NumPy
    complex_ema = es.nn.EMA(as_complex, decay=0.9)
    if mode == "ref":
        complex_ema = es.to_refs(complex_ema)
    moved = jax.tree.map(lambda a: a * 1j + 2 if eqx.is_array(a) else a, as_complex)
    complex_ema = _run(mode, complex_ema, moved)
    h0 = np.asarray(as_complex.weight, np.complex128)
    want = h0 + 0.1 * (np.asarray(moved.weight, np.complex128) - h0)
    np.testing.assert_allclose(complex_ema.average.weight, want, rtol=1e-6)


def _run(mode, ema, model):
    """`ema.update(model)` in either mode; returns the EMA."""
    if mode == "ref":
        ema.update(model)
        return ema
    return es.apply(lambda e, m: e.update(m), ema, model)[1]


# --- narrow parameter dtypes: the average is kept in float32 ------------------------


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("zero_debias", [False, True])
def test_low_precision_params_average_in_float32(mode, dtype, zero_debias, getkey):
    """bf16 / f16 parameters: the average is kept and computed in float32 and equals
    float64 NumPy on the same (bf16 / f16) values; `average` / `averaged` cast back.
    In bf16 0.999 rounds to 1.0: an average kept in bf16 never moves."""
    net = eqx.nn.Linear(3, 2, key=getkey(), dtype=dtype)
    ema = es.nn.EMA(net, decay=0.999, zero_debias=zero_debias)
    assert all(c.dtype == jnp.float32 for c in ema.hidden)
    if mode == "ref":
        ema = es.to_refs(ema)
    ref = NumpyEMA(
        [x.astype(np.float64) for x in _leaves(net)], 0.999, zero_debias=zero_debias
    )
    current = jax.tree.map(
        lambda x: x + jnp.asarray(1.0, dtype) if eqx.is_inexact_array(x) else x, net
    )
    update = eqx.filter_jit(_update)
    for _ in range(60):
        ema = update(mode, ema, current)
        ref.update([x.astype(np.float64) for x in _leaves(current)])
    want = ref.average()
    # float32 round-off, accumulated over the 60 updates (two roundings each)
    tol = 2 * 60 * float(jnp.finfo(jnp.float32).eps)
    for cell, w in zip(ema.hidden, ref.h):
        np.testing.assert_allclose(np.asarray(cell[...]), w, rtol=0, atol=tol)
    for got, w in zip(jax.tree.leaves(ema.average), want):
        assert got.dtype == dtype
        # within one rounding of the parameter dtype
        np.testing.assert_allclose(
            np.asarray(got, np.float64), w, rtol=float(jnp.finfo(dtype).eps), atol=0
        )
    averaged = ema.averaged(net)
    assert averaged.weight.dtype == dtype
    # it moved: after 60 steps towards +1, about 1 - 0.999**60 = 0.058
    moved = np.asarray(averaged.weight, np.float64) - np.asarray(net.weight, np.float64)
    if not zero_debias:
        np.testing.assert_allclose(moved, 1 - 0.999**60, rtol=0.05)


def test_accumulation_dtype_option(getkey):
    net = eqx.nn.Linear(3, 2, key=getkey())
    ema = es.nn.EMA(net, decay=0.9, accumulation_dtype=jnp.bfloat16)
    assert all(c.dtype == jnp.bfloat16 for c in ema.hidden)
    assert jax.tree.leaves(ema.average)[0].dtype == jnp.float32
    with pytest.raises(ValueError, match="accumulation_dtype must be a floating"):
        es.nn.EMA(net, accumulation_dtype=jnp.int32)


# --- state kinds and reset fills ----------------------------------------------------


def test_cells_are_average_state_with_reset_fills(getkey):
    """Every cell of an EMA is an `es.AverageState` (not a BatchStat: resetting
    BatchNorm statistics must not wipe the average); the count resets to 0, a
    zero-debiased average to 0, a plain one has no fill (it starts at parameters)."""
    net = _net(getkey())
    plain = es.nn.EMA(net, decay=0.9)
    debiased = es.nn.EMA(net, decay=0.9, zero_debias=True)
    for ema, fill in ((plain, None), (debiased, 0)):
        cells = [c for c in jax.tree.leaves(ema, is_leaf=es.is_state) if es.is_state(c)]
        assert {type(c) for c in cells} == {es.AverageState}
        assert [c.init for c in ema.hidden] == [fill] * len(ema.hidden)
        assert ema.count.init == 0


# --- microbatches: an update in the loss runs once per slice ------------------------


def test_update_in_loss_with_microbatches_advances_k_times(getkey):
    """As documented: with `make_step(..., microbatches=k)` an update inside the
    loss averages k times per optimizer step (on the same parameters), so the
    effective decay is d**k; updating after the step averages once."""
    decay, k = 0.8, 2
    model = Model(getkey(), decay=decay)
    p0 = _leaves(model.net)
    step = es.make_step(_loss, optax.sgd(0.1), microbatches=k, donate=False)
    new, _ = step(model, step.init(model), jnp.ones((4, 3)), jnp.zeros((4, 2)))
    assert int(new.ema.steps) == k
    ref = NumpyEMA(p0, decay)
    for _ in range(k):
        ref.update(p0)
    for got, want in zip(_leaves(new.ema.average), ref.average()):
        np.testing.assert_allclose(got, want, rtol=1e-6)

    # once per optimizer step: update outside the loss, after the step
    def plain_loss(model, x, y):
        return jnp.mean((jax.vmap(model.net)(x) - y) ** 2)

    step = es.make_step(plain_loss, optax.sgd(0.1), microbatches=k, donate=False)
    new, _ = step(model, step.init(model), jnp.ones((4, 3)), jnp.zeros((4, 2)))
    _, new = es.apply(lambda m: m.ema.update(m.net), new)
    assert int(new.ema.steps) == 1
    ref = NumpyEMA(p0, decay)
    ref.update(_leaves(new.net))
    for got, want in zip(_leaves(new.ema.average), ref.average()):
        np.testing.assert_allclose(got, want, rtol=1e-6)


# --- cases ported from Haiku's haiku/_src/moving_averages_test.py -------------------
# (Haiku's average starts at zero; `EMA(x)` starts at the x it is built from, so the
# cases build it from zeros.)


def _haiku_ema(decay, **kw):
    return es.to_refs(es.nn.EMA(jnp.zeros((3, 4)), decay=decay, **kw))


def _ema_call(ema, x):
    """Haiku's `ema(x)`: update, then read the average."""
    ema.update(x)
    return np.asarray(ema.average)


def test_haiku_zero_decay():
    ema = _haiku_ema(0.0, zero_debias=True)
    x = jax.random.uniform(jax.random.key(428), (2, 3, 4))
    np.testing.assert_allclose(x[0], _ema_call(ema, x[0]))
    np.testing.assert_allclose(x[1], _ema_call(ema, x[1]))


def test_haiku_warmup():
    ema = _haiku_ema(0.5, warmup_length=2)
    x = jax.random.uniform(jax.random.key(428), (2, 3, 4))
    np.testing.assert_allclose(x[0], _ema_call(ema, x[0]))
    np.testing.assert_allclose(x[0], _ema_call(ema, x[0]))
    np.testing.assert_allclose((x[0] + x[1]) / 2, _ema_call(ema, x[1]), rtol=1e-6)


def test_haiku_call():
    ema = es.to_refs(es.nn.EMA(jnp.zeros(()), decay=0.5, zero_debias=True))
    assert _ema_call(ema, jnp.asarray(3.0)) == pytest.approx(3.0)
    assert _ema_call(ema, jnp.asarray(6.0)) == pytest.approx(5.0)


def test_haiku_fast_slow_decay():
    fast = es.to_refs(es.nn.EMA(jnp.zeros(()), decay=0.2, zero_debias=True))
    slow = es.to_refs(es.nn.EMA(jnp.zeros(()), decay=0.8, zero_debias=True))
    one = jnp.asarray(1.0)
    np.testing.assert_allclose(_ema_call(fast, one), _ema_call(slow, one), rtol=1e-4)
    assert _ema_call(fast, one + 1) > _ema_call(slow, one + 1)


def test_haiku_identity_on_unchanged_data():
    ema = es.to_refs(es.nn.EMA(jnp.zeros(()), decay=0.5, zero_debias=True))
    for _ in range(10):
        np.testing.assert_allclose(_ema_call(ema, jnp.asarray(1.0)), 1.0, rtol=1e-6)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"], ids=lambda h: h)
def test_a_copied_ema_keeps_its_structure_and_averages_like_numpy(how):
    # A PyTreeDef copied by `deepcopy` or `pickle` carries a copy of Equinox's
    # "missing" sentinel and no longer equals the model's structure: a copied EMA
    # rebuilds its own, so it updates the model it was built from and has the
    # structure of the original (one compilation key, combinable, loadable).
    import copy
    import pickle

    net = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    ema = es.nn.EMA(net, decay=0.25)
    twin = copy.deepcopy(ema) if how == "deepcopy" else pickle.loads(pickle.dumps(ema))
    assert twin.treedef == ema.treedef
    assert jax.tree_util.tree_structure(twin) == jax.tree_util.tree_structure(ema)
    moved = jax.tree.map(lambda x: x + 1.0, net)
    _, twin = es.apply(lambda e: e.update(moved), twin)
    got = twin.averaged(net)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(net)):
        want = 0.25 * np.asarray(w, np.float64) + 0.75 * (np.asarray(w, np.float64) + 1)
        np.testing.assert_allclose(np.asarray(g, np.float64), want, rtol=1e-6)


def test_an_averaged_model_with_buffers_is_loaded_with_the_fix_named():
    """`AveragedModel` saves the averaged module's buffers (BatchNorm statistics,
    copies of the source model's); an `EMA` averages parameters only. A strict load
    names the fix (`strict=False`), not the `DataParallel` prefix hint; with it the
    average is loaded, bit for bit."""
    tnet = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    tavg = AveragedModel(tnet, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    tavg.update_parameters(tnet)
    net = eqx.nn.Sequential(
        [es.nn.Batched(eqx.nn.Linear(3, 4, key=jax.random.key(0))), es.nn.BatchNorm(4)]
    )
    ema = es.nn.EMA(net, 0.9, warmup_length=1)
    state = tavg.state_dict()
    with pytest.raises(es.EqxStateError, match=r"AveragedModel.*strict=False") as info:
        es.load_state_dict(ema, state)
    assert "DataParallel" not in str(info.value)
    loaded, _ = es.load_state_dict(ema, state, strict=False)
    got = es.state_dict(loaded)
    for name in ("module.0.weight", "module.0.bias", "module.1.weight"):
        np.testing.assert_array_equal(np.asarray(got[name]), state[name].numpy())


class _CastNet(eqx.Module):
    lin: eqx.nn.Linear
    ema: es.nn.EMA
    mean: es.metrics.Mean
    rec: es.nn.Record

    def __init__(self):
        self.lin = eqx.nn.Linear(2, 2, key=jax.random.key(0))
        self.ema = es.nn.EMA(self.lin, 0.999)
        self.mean = es.metrics.Mean()
        self.rec = es.nn.Record("mean", "max")


def _cast_update(m, values):
    m.ema.update(eqx.tree_at(lambda lin: lin.weight, m.lin, m.lin.weight + 1.0))
    m.mean.update(values)
    m.rec(values)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_a_model_cast_wholesale_is_refused_and_the_parameter_cast_equals_float64(mode):
    """`jax.tree.map(lambda x: x.astype(bf16) if eqx.is_inexact_array(x) else x,
    model)` also casts the EMA's and the metrics' cells: in bfloat16 the average
    stalled (moved 0.02 of the 0.63 a float64 EMA moves in 1000 updates) and a
    Mean of 300 zeros and 300 ones read 1.0 (a probe's finding). Now refused,
    naming the cell and the parameter-only cast, whose numbers equal float64
    NumPy's."""
    bf16 = jnp.bfloat16
    cast = lambda x: x.astype(bf16) if eqx.is_inexact_array(x) else x  # noqa: E731
    update = es.make_apply(_cast_update)
    wholesale = jax.tree.map(cast, _CastNet())
    if mode == "ref":
        wholesale = es.to_refs(wholesale)
    with pytest.raises(TypeError, match=r"is_leaf=es\.is_state") as e:
        update(wholesale, jnp.zeros(4, bf16))
    assert isinstance(e.value, es.EqxStateError) and "`hidden[0]`" in str(e.value)
    net = jax.tree.map(cast, _CastNet(), is_leaf=es.is_state)  # parameters only
    if mode == "ref":
        net = es.to_refs(net)
    start = np.asarray(net.ema.average.weight, np.float64)
    target = np.asarray(net.lin.weight + 1.0, np.float64)  # computed in bf16
    for i in range(600):
        _, net = update(net, jnp.full(4, float(i >= 300), bf16))
    want = start + (1 - 0.999**600) * (target - start)
    np.testing.assert_allclose(net.ema.average.weight, want, rtol=1e-5, atol=1e-5)
    assert float(net.mean.compute()) == 0.5
    assert float(es.recorded(net)["rec.mean"]) == 0.5
