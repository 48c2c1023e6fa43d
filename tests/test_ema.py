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
    with pytest.raises(ValueError, match=r"(?s)do not have the structure.*got: "):
        ema.averaged(wider)  # static sizes are part of the structure
    ema_dict = es.nn.EMA({"w": jnp.ones(3)})
    with pytest.raises(ValueError, match=r"parameter 0 has shape \(4,\)"):
        ema_dict.averaged({"w": jnp.ones(4)})
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\)"):
        es.nn.EMA(net, decay=1.0)
    with pytest.raises(ValueError, match="cannot be combined with warmup_length"):
        es.nn.EMA(net, zero_debias=True, warmup_length=3)
    with pytest.raises(ValueError, match="cannot be combined with dynamic_decay"):
        es.nn.EMA(net, zero_debias=True, dynamic_decay=True)
    with pytest.raises(ValueError, match="no parameters to average"):
        es.nn.EMA({"step": jnp.zeros((), jnp.int32)})
