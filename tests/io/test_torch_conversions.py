"""PyTorch conversions against the real thing: a spectral-normalised discriminator
(both PyTorch spectral-norm APIs), `AveragedModel` into `es.nn.EMA`, weight norm,
user conversions (`es.register_torch_names`), LSTM/GRU bias halves, a Dropout port
into an abstract model, abstract state dicts, and `missing_keys` order."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from torch.nn.utils import parametrizations as tp
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import eqx_state as es


def _t(x):
    return torch.from_numpy(np.asarray(x))


def _torch_sd(sd):
    return {k: torch.from_numpy(np.asarray(v)) for k, v in sd.items()}


def _assert_same(sd, t_sd):
    """Same names, same order, same bits."""
    assert list(sd) == list(t_sd)
    for k, v in t_sd.items():
        got = np.asarray(sd[k])
        assert got.shape == tuple(v.shape), k
        np.testing.assert_array_equal(got, v.numpy().astype(got.dtype), err_msg=k)


# ------------------------------------------------ spectral-normalised discriminator


SN_APIS = {
    "parametrizations": tp.spectral_norm,
    "legacy": torch.nn.utils.spectral_norm,
}
LEGACY_NAMES = {  # parametrizations' names -> torch.nn.utils.spectral_norm's
    "parametrizations.weight.original": "weight_orig",
    "parametrizations.weight.0._u": "weight_u",
    "parametrizations.weight.0._v": "weight_v",
}


class TorchD(torch.nn.Module):
    def __init__(self, sn):
        super().__init__()
        self.conv1 = sn(torch.nn.Conv2d(3, 4, 3, stride=2, padding=1))
        self.conv2 = sn(torch.nn.Conv2d(4, 6, 3, stride=2, padding=1))
        self.fc = sn(torch.nn.Linear(6 * 2 * 2, 1))

    def forward(self, x):
        h = torch.nn.functional.leaky_relu(self.conv1(x), 0.2)
        h = torch.nn.functional.leaky_relu(self.conv2(h), 0.2)
        return self.fc(h.flatten(1))


class D(eqx.Module):
    conv1: es.nn.SpectralNorm
    conv2: es.nn.SpectralNorm
    fc: es.nn.SpectralNorm

    def __init__(self, key, v_first=False):
        k = jax.random.split(key, 6)
        kw = dict(v_first=v_first)  # the older PyTorch API updates v first
        self.conv1 = es.nn.SpectralNorm(
            eqx.nn.Conv2d(3, 4, 3, stride=2, padding=1, key=k[0]), key=k[1], **kw
        )
        self.conv2 = es.nn.SpectralNorm(
            eqx.nn.Conv2d(4, 6, 3, stride=2, padding=1, key=k[2]), key=k[3], **kw
        )
        self.fc = es.nn.SpectralNorm(
            eqx.nn.Linear(6 * 2 * 2, 1, key=k[4]), key=k[5], **kw
        )

    def __call__(self, x):  # [N, 3, 8, 8], like PyTorch
        h = jax.nn.leaky_relu(self.conv1(x), 0.2)
        h = jax.nn.leaky_relu(self.conv2(h), 0.2)
        return self.fc(h.reshape(h.shape[0], -1))


_D_EVAL = eqx.filter_jit(lambda m, x: eqx.nn.inference_mode(m)(x))
_D_CALL = eqx.filter_jit(lambda m, x: m(x))  # ref mode: writes the refs
_D_APPLY = eqx.filter_jit(es.apply)


def _x(seed):
    return np.random.default_rng(seed).normal(size=(5, 3, 8, 8)).astype(np.float32)


def _uv(t_sd, name):
    if f"{name}.weight_u" in t_sd:
        return t_sd[f"{name}.weight_u"].numpy(), t_sd[f"{name}.weight_v"].numpy()
    p = f"{name}.parametrizations.weight.0"
    return t_sd[f"{p}._u"].numpy(), t_sd[f"{p}._v"].numpy()


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("api", list(SN_APIS))
def test_spectral_norm_discriminator_matches_torch(api, mode):
    torch.manual_seed(0)
    tnet = TorchD(SN_APIS[api])
    tnet.train()
    with torch.no_grad():
        for seed in range(3):  # u, v move away from their initial values
            tnet(_t(_x(seed)))
    t_sd = tnet.state_dict()

    abstract = eqx.filter_eval_shape(D, jax.random.key(0), api == "legacy")
    model = es.load_state_dict(abstract, t_sd)
    if mode == "ref":
        model = es.to_refs(model)
    for name in ("conv1", "conv2", "fc"):  # the power-iteration vectors loaded
        tu, tv = _uv(t_sd, name)
        np.testing.assert_array_equal(getattr(model, name).u[...], tu)
        np.testing.assert_array_equal(getattr(model, name).v[...], tv)

    # evaluation: the stored u, v
    x = _x(10)
    tnet.eval()
    with torch.no_grad():
        want = tnet(_t(x)).numpy()
    got = _D_EVAL(model, jnp.asarray(x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    # training: one power iteration per forward, in both
    tnet.train()
    for seed in (11, 12):
        with torch.no_grad():
            want = tnet(_t(_x(seed))).numpy()
        if mode == "ref":
            got = _D_CALL(model, jnp.asarray(_x(seed)))
        else:
            got, model = _D_APPLY(lambda m, x: m(x), model, jnp.asarray(_x(seed)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    t_sd = tnet.state_dict()
    for name in ("conv1", "conv2", "fc"):
        tu, tv = _uv(t_sd, name)
        np.testing.assert_allclose(getattr(model, name).u[...], tu, atol=1e-6)
        np.testing.assert_allclose(getattr(model, name).v[...], tv, atol=1e-6)

    # export: PyTorch's current names; back into PyTorch strictly, bit for bit
    sd = es.state_dict(model)
    fresh = TorchD(tp.spectral_norm)
    assert list(sd) == list(fresh.state_dict())
    fresh.load_state_dict(_torch_sd(sd), strict=True)
    _assert_same(sd, fresh.state_dict())
    if api == "legacy":  # the older API's names: a rename, then strict too
        legacy = {}
        for k, v in sd.items():
            layer, _, local = k.partition(".")
            legacy[f"{layer}.{LEGACY_NAMES.get(local, local)}"] = v
        old = TorchD(torch.nn.utils.spectral_norm)
        old.load_state_dict(_torch_sd(legacy), strict=True)
        np.testing.assert_array_equal(
            old.fc.weight_u.numpy(), sd["fc." + "parametrizations.weight.0._u"]
        )
    # and back into eqx_state, bit for bit
    back = es.load_state_dict(abstract, _torch_sd(sd))
    _assert_same(es.state_dict(back), _torch_sd(sd))


@pytest.mark.parametrize("groups", [1, 2])
def test_spectral_norm_conv_transpose_vectors_convert(groups):
    """A transposed convolution's v is laid out by the kernel, which Equinox keeps
    flipped: loading PyTorch's u, v gives PyTorch's eval outputs and sigma."""
    torch.manual_seed(0)
    t = tp.spectral_norm(torch.nn.ConvTranspose2d(4, 6, 3, groups=groups))
    with torch.no_grad():
        for _ in range(3):
            t(torch.randn(2, 4, 5, 5))
    layer = eqx.nn.ConvTranspose2d(4, 6, 3, groups=groups, key=jax.random.key(0))
    sn = es.nn.SpectralNorm(layer, key=jax.random.key(1))
    sn = es.load_state_dict(sn, t.state_dict())
    x = np.random.default_rng(0).normal(size=(2, 4, 5, 5)).astype(np.float32)
    t.eval()
    with torch.no_grad():
        want = t(_t(x)).numpy()
    ev = eqx.nn.inference_mode(sn)
    np.testing.assert_allclose(ev(jnp.asarray(x)), want, rtol=1e-5, atol=1e-5)
    _assert_same(es.state_dict(sn), t.state_dict())


@pytest.mark.filterwarnings("ignore:.*weight_norm. is deprecated:FutureWarning")
def test_weight_norm_both_apis():
    torch.manual_seed(0)
    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    for wn in (tp.weight_norm, torch.nn.utils.weight_norm):
        t = wn(torch.nn.Linear(3, 5))
        with torch.no_grad():  # g away from ||v||
            g = (
                t.parametrizations.weight.original0
                if wn is tp.weight_norm
                else t.weight_g
            )
            g.mul_(torch.linspace(0.5, 2.0, 5)[:, None])
        layer = eqx.nn.WeightNorm(eqx.nn.Linear(3, 5, key=jax.random.key(0)))
        layer = es.load_state_dict(layer, t.state_dict())
        with torch.no_grad():
            want = t(_t(x)).numpy()
        np.testing.assert_allclose(jax.vmap(layer)(x), want, rtol=1e-5, atol=1e-6)
    sd = es.state_dict(layer)  # the current API's names
    fresh = tp.weight_norm(torch.nn.Linear(3, 5))
    fresh.load_state_dict(_torch_sd(sd), strict=True)
    _assert_same(sd, fresh.state_dict())


# ---------------------------------------------------------- AveragedModel -> EMA


def _torch_net():
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
    )


class Model(eqx.Module):
    net: eqx.nn.Sequential
    ema: es.nn.EMA

    def __init__(self, key, decay):
        k1, k2 = jax.random.split(key)
        self.net = eqx.nn.Sequential(
            [
                es.nn.Batched(eqx.nn.Linear(3, 4, key=k1)),
                eqx.nn.Lambda(jnp.tanh),
                es.nn.Batched(eqx.nn.Linear(4, 2, key=k2)),
            ]
        )
        # AveragedModel(..., multi_avg_fn=get_ema_multi_avg_fn(decay)) copies on
        # its first update: warmup_length=1
        self.ema = es.nn.EMA(self.net, decay=decay, warmup_length=1)


def _torch_steps(tnet, tavg, topt, seeds):
    for seed in seeds:
        rng = np.random.default_rng(seed)
        x, y = (_t(rng.normal(size=s).astype(np.float32)) for s in ((8, 3), (8, 2)))
        topt.zero_grad()
        torch.nn.functional.mse_loss(tnet(x), y).backward()
        topt.step()
        tavg.update_parameters(tnet)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_averaged_model_continues_in_ema(mode):
    decay = 0.8
    torch.manual_seed(0)
    tnet = _torch_net()
    tavg = AveragedModel(tnet, multi_avg_fn=get_ema_multi_avg_fn(decay))
    topt = torch.optim.SGD(tnet.parameters(), lr=0.1)
    _torch_steps(tnet, tavg, topt, range(3))
    assert list(tavg.state_dict())[:2] == ["n_averaged", "module.0.weight"]

    model = eqx.filter_eval_shape(Model, jax.random.key(0), decay)
    ema = es.load_state_dict(model.ema, tavg.state_dict())  # strict
    model = eqx.tree_at(lambda m: m.ema, model, ema)
    model = eqx.tree_at(
        lambda m: m.net, model, es.load_state_dict(model.net, tnet.state_dict())
    )
    if mode == "ref":
        model = es.to_refs(model)
    assert int(model.ema.steps) == 3
    _assert_same(es.state_dict(model.ema), tavg.state_dict())

    # five more steps: PyTorch trains; eqx_state averages the same parameters
    for seed in range(3, 8):
        _torch_steps(tnet, tavg, topt, [seed])
        net = es.load_state_dict(model.net, tnet.state_dict())
        model = eqx.tree_at(lambda m: m.net, model, net)
        if mode == "ref":
            eqx.filter_jit(lambda m: m.ema.update(m.net))(model)
        else:
            _, model = _D_APPLY(lambda m: m.ema.update(m.net), model)
        sd, t_sd = es.state_dict(model.ema), tavg.state_dict()
        assert int(sd["n_averaged"]) == int(t_sd["n_averaged"]) == seed + 1
        for k in t_sd:  # PyTorch's lerp; its CPU kernel fuses a multiply-add
            np.testing.assert_array_max_ulp(sd[k], t_sd[k].numpy(), maxulp=1)
    x = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    with torch.no_grad():
        want = tavg(_t(x)).numpy()
    got = model.ema.averaged(model.net)(jnp.asarray(x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    # exported back into a fresh AveragedModel, strictly, bit for bit
    fresh = AveragedModel(_torch_net(), multi_avg_fn=get_ema_multi_avg_fn(decay))
    fresh.load_state_dict(_torch_sd(es.state_dict(model.ema)), strict=True)
    _assert_same(es.state_dict(model.ema), fresh.state_dict())


def test_ema_trained_in_eqx_state_equals_averaged_model():
    """The other way: eqx_state trains (SGD, averaging after each step) from
    PyTorch's start; PyTorch does the same; the averages agree."""
    decay = 0.7
    torch.manual_seed(1)
    tnet = _torch_net()
    tavg = AveragedModel(tnet, multi_avg_fn=get_ema_multi_avg_fn(decay))
    topt = torch.optim.SGD(tnet.parameters(), lr=0.1)
    model = Model(jax.random.key(0), decay)
    model = eqx.tree_at(
        lambda m: m.net, model, es.load_state_dict(model.net, tnet.state_dict())
    )

    def loss_fn(m, x, y):
        return jnp.mean((m.net(x) - y) ** 2)

    step = es.make_step(loss_fn, optax.sgd(0.1))
    opt_state = step.init(model)
    for seed in range(4):
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(8, 3)).astype(np.float32)
        y = rng.normal(size=(8, 2)).astype(np.float32)
        model, opt_state = step(model, opt_state, jnp.asarray(x), jnp.asarray(y))
        _, model = es.apply(lambda m: m.ema.update(m.net), model)
    _torch_steps(tnet, tavg, topt, range(4))
    sd, t_sd = es.state_dict(model.ema), tavg.state_dict()
    assert list(sd) == list(t_sd) and int(sd["n_averaged"]) == 4
    for k in t_sd:
        np.testing.assert_allclose(sd[k], t_sd[k].numpy(), rtol=1e-5, atol=1e-6)


def test_zero_debias_ema_exports_the_debiased_average():
    net = eqx.nn.Linear(2, 3, key=jax.random.key(0))
    ema = es.to_refs(es.nn.EMA(net, decay=0.5, zero_debias=True))
    for s in (1.0, 3.0):
        ema.update(jax.tree.map(lambda x, s=s: x + s, net))
    sd = es.state_dict(ema)
    assert list(sd) == ["n_averaged", "module.weight", "module.bias"]
    np.testing.assert_allclose(sd["module.weight"], ema.average.weight, rtol=1e-6)
    back = es.load_state_dict(es.nn.EMA(net, decay=0.5, zero_debias=True), sd)
    np.testing.assert_allclose(back.hidden[0][...], ema.hidden[0][...], rtol=1e-6)
    assert int(back.steps) == 2


# ------------------------------------------------------------ user conversions


class Affine(eqx.Module):
    """PyTorch keeps `scale` as its log, in a buffer-like parameter `log_scale`."""

    scale: jax.Array
    shift: jax.Array


class TorchAffine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.log_scale = torch.nn.Parameter(torch.randn(3))
        self.shift = torch.nn.Parameter(torch.randn(3))


def test_register_torch_names_for_a_user_module():
    es.register_torch_names(
        Affine,
        lambda m: {"log_scale": jnp.log(m.scale), "shift": m.shift},
        lambda m, a: Affine(jnp.exp(a["log_scale"]), a["shift"]),
        aliases={"log_scale": ["logscale"]},
    )
    torch.manual_seed(0)
    t = torch.nn.Sequential(TorchAffine())
    m = eqx.nn.Sequential([Affine(jnp.ones(3), jnp.zeros(3))])
    m = es.load_state_dict(m, t.state_dict())
    np.testing.assert_allclose(
        m.layers[0].scale, np.exp(t[0].log_scale.detach().numpy()), rtol=1e-6
    )
    sd = es.state_dict(m)
    assert list(sd) == ["0.log_scale", "0.shift"]
    t.load_state_dict(_torch_sd(sd), strict=True)
    old = {"0.logscale": t[0].log_scale, "0.shift": t[0].shift}  # an alias
    m2 = es.load_state_dict(m, old)
    np.testing.assert_array_equal(m2.layers[0].shift, sd["0.shift"])
    # abstract: names and PyTorch's shapes without arrays
    abstract = eqx.filter_eval_shape(lambda: m)
    assert es.state_dict(abstract)["0.log_scale"].shape == (3,)
    with pytest.raises(TypeError, match="expects a class|'cls'"):  # or beartype's
        es.register_torch_names(m, lambda m: {}, lambda m, a: m)  # pyright: ignore
    with pytest.raises(TypeError, match="must be functions|'to_torch'"):
        es.register_torch_names(Affine, {}, lambda m, a: m)  # pyright: ignore


class _Counted(eqx.Module):
    """A user layer whose registered conversion leaves its state cell out."""

    w: jax.Array
    count: es.Buffer


def test_a_ref_mode_load_shares_no_ref_with_the_model_passed_in():
    """A ref-mode cell that a registered conversion leaves out came back holding
    the model's own ref: a write to the loaded model changed the model passed in
    (and the other way round). The loaded one gets a new ref with the same value,
    named by the cell's path."""
    es.register_torch_names(
        _Counted,
        lambda m: {"w": m.w},
        lambda m, a: eqx.tree_at(lambda x: x.w, m, a["w"]),
    )
    model = es.to_refs({"c": _Counted(jnp.ones(3), es.Buffer(jnp.int32(0)))})
    model["c"].count[...] = 5
    w = np.full(3, 2.0, np.float32)
    loaded = es.load_state_dict(model, {"c.w": w})
    np.testing.assert_array_equal(loaded["c"].w, w)
    assert int(loaded["c"].count[...]) == 5  # not in the state dict: kept
    loaded["c"].count[...] = 7
    assert int(model["c"].count[...]) == 5
    model["c"].count[...] = 9
    assert int(loaded["c"].count[...]) == 7
    np.testing.assert_array_equal(model["c"].w, np.ones(3))
    with pytest.raises(es.StateWriteError, match=r"model\['c'\]\.count"):
        loaded["c"].count[...] = jnp.zeros(2, jnp.int32)  # named by its path


class _Scaled(eqx.Module):
    w: jax.Array


@pytest.mark.parametrize(
    "from_torch,what",
    [
        (
            lambda m, a: _Scaled(a["w"][:1]),
            r"float32\[1, 3\] at `\.w`.*float32\[2, 3\]",
        ),
        (lambda m, a: _Scaled(a["w"].astype(jnp.float16)), r"float16\[2, 3\] at `\.w`"),
        (lambda m, a: a["w"], r"returned a \w+, not a _Scaled"),
    ],
    ids=["a slice", "a cast", "a bare array"],
)
def test_what_a_registered_from_torch_returns_is_checked(from_torch, what):
    """A registered `from_torch` that returned a slice, a cast or a bare array
    loaded without a word (the model came back of another shape, dtype or
    structure): refused, naming the module's path and the leaf."""
    es.register_torch_names(_Scaled, lambda m: {"w": m.w}, from_torch)
    model = {"head": _Scaled(jnp.ones((2, 3)))}
    with pytest.raises(
        ValueError, match=r"Loading `head`: `from_torch` " + ".*" + what
    ) as e:
        es.load_state_dict(model, {"head.w": np.zeros((2, 3), np.float32)})
    assert isinstance(e.value, es.EqxStateError)
    es.register_torch_names(_Scaled, lambda m: {"w": m.w}, lambda m, a: _Scaled(a["w"]))
    back = es.load_state_dict(model, {"head.w": np.zeros((2, 3), np.float32)})
    np.testing.assert_array_equal(back["head"].w, np.zeros((2, 3)))


class _Viewed(eqx.Module):
    w: jax.Array


@pytest.mark.parametrize(
    "to_torch,error,what",
    [
        (
            lambda m: [m.w],
            TypeError,
            r"`to_torch` registered for _Viewed, at `head` returned a list that is "
            r"no mapping: it must return a dict from local PyTorch names \(str",
        ),
        (
            lambda m: {0: m.w},
            TypeError,
            r"_Viewed, at `head` returned a name that is not a str",
        ),
        (lambda m: [("w", jnp.log(m.w))], None, None),
        (lambda m: {"w": np.log(m.w)}, None, None),
    ],
    ids=["a list of arrays", "an int key", "pairs", "NumPy"],
)
def test_what_a_registered_to_torch_returns_is_checked(to_torch, error, what):
    """A registered `to_torch` that returned a list of arrays failed with Python's
    bare `dict()` error ("unhashable type"), and an int name was not refused with
    the fix; one that used NumPy failed, on an abstract model only,
    with JAX's bare tracer error. Refused naming the module's path; the error
    raised inside `to_torch` carries a note naming the module and, for NumPy on an
    abstract model, the fix. `(name, value)` pairs, which `dict()` takes, work as
    before. Reference: NumPy's own log."""
    es.register_torch_names(_Viewed, to_torch, lambda m, a: _Viewed(jnp.exp(a["w"])))
    try:
        model = {"head": _Viewed(jnp.full((2, 3), 2.0))}
        abstract = eqx.filter_eval_shape(lambda: model)
        if error is not None:
            for call in (
                lambda: es.state_dict(model),
                lambda: es.state_dict(abstract),
                lambda: es.load_state_dict(model, {"head.w": np.zeros((2, 3))}),
            ):
                with pytest.raises(error, match=what) as e:
                    call()
                assert isinstance(e.value, es.EqxStateError)
            return
        np.testing.assert_allclose(
            es.state_dict(model)["head.w"],
            np.log(np.full((2, 3), 2.0, np.float32)),
            rtol=1e-6,
        )
        if isinstance(to_torch(model["head"]), list):  # pairs: abstract too
            assert es.state_dict(abstract)["head.w"].shape == (2, 3)
            return
        with pytest.raises(Exception) as e:  # JAX's tracer error, kept as it is
            es.state_dict(abstract)
        notes = "\n".join(getattr(e.value, "__notes__", []))
        assert "in the `to_torch` of _Viewed, at `head`" in notes
        assert "must use `jnp`, not NumPy" in notes
    finally:
        es.register_torch_names(
            _Viewed, lambda m: {"w": m.w}, lambda m, a: _Viewed(a["w"])
        )


# ------------------------------------------- LSTM/GRU: two biases summed into one


@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell"])
def test_half_of_a_summed_bias_is_refused(kind):
    torch.manual_seed(0)
    t = getattr(torch.nn, kind)(3, 4)
    cell = getattr(eqx.nn, kind)(3, 4, key=jax.random.key(0))
    cell = es.load_state_dict(cell, t.state_dict())
    new_ih, new_hh = torch.randn_like(t.bias_ih), torch.randn_like(t.bias_hh)
    # PyTorch adds the new bias_ih to its old bias_hh, which Equinox does not keep
    with pytest.raises(
        ValueError, match=r"`bias_ih` but not `bias_hh`.*`bias_ih`, `bias_hh`"
    ):
        es.load_state_dict(cell, {"bias_ih": new_ih}, strict=False)
    with pytest.raises(ValueError, match=r"`bias_hh` but not `bias_ih`"):
        es.load_state_dict(cell, {"bias_hh": new_hh}, strict=False)
    # both halves: exactly PyTorch's layer after the same partial load
    partial = {"bias_ih": new_ih, "bias_hh": new_hh}
    expected = t.load_state_dict(partial, strict=False)
    cell, keys = es.load_state_dict(cell, partial, strict=False)
    assert keys.missing_keys == expected.missing_keys == ["weight_ih", "weight_hh"]
    rng = np.random.default_rng(0)
    x, h = rng.normal(size=3).astype(np.float32), rng.normal(size=4).astype(np.float32)
    with torch.no_grad():
        if kind == "LSTMCell":
            want = torch.cat(t(_t(x)[None], (_t(h)[None], _t(h)[None]))).numpy()
            got = jnp.stack(cell(jnp.asarray(x), (jnp.asarray(h), jnp.asarray(h))))
        else:
            want = t(_t(x)[None], _t(h)[None]).numpy()[0]
            got = cell(jnp.asarray(x), jnp.asarray(h))
    np.testing.assert_allclose(
        np.asarray(got).reshape(want.shape), want, rtol=1e-5, atol=1e-6
    )


# ------------------------------------------ Dropout: an abstract port, strict=False


class TorchDrop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


class Drop(eqx.Module):
    fc: es.nn.Batched
    drop: es.nn.Dropout

    def __init__(self, key):
        self.fc = es.nn.Batched(eqx.nn.Linear(6, 6, key=key))
        self.drop = es.nn.Dropout(0.5, key=key)

    def __call__(self, x):
        return self.drop(self.fc(x))


def test_dropout_port_into_an_abstract_model_with_strict_false():
    tnet = TorchDrop()
    abstract = eqx.filter_eval_shape(Drop, jax.random.key(0))
    expected = tnet.load_state_dict(tnet.state_dict(), strict=False)
    model, keys = es.load_state_dict(abstract, tnet.state_dict(), strict=False)
    rng_names = [k for k in es.state_dict(abstract) if k not in tnet.state_dict()]
    assert rng_names and keys.missing_keys == expected.missing_keys + rng_names
    assert keys.unexpected_keys == []
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    tnet.eval()
    with torch.no_grad():
        want = tnet(_t(x)).numpy()
    np.testing.assert_allclose(
        eqx.nn.inference_mode(model)(jnp.asarray(x)), want, rtol=1e-5, atol=1e-6
    )
    # training draws masks: about half the entries dropped, the rest scaled by 2
    y, model = es.apply(lambda m, x: m(x), model, jnp.asarray(x))
    kept = np.asarray(y) != 0
    np.testing.assert_allclose(np.asarray(y)[kept], 2 * want[kept], rtol=1e-5)
    assert 0.2 < kept.mean() < 0.8
    # seeded from the name: the same in every load, so runs are reproducible
    again, _ = es.load_state_dict(abstract, tnet.state_dict(), strict=False)
    sd1, sd2 = (
        es.state_dict(again),
        es.state_dict(es.load_state_dict(abstract, tnet.state_dict(), strict=False)[0]),
    )
    np.testing.assert_array_equal(sd1[rng_names[0]], sd2[rng_names[0]])
    # and a seed in the state dict wins
    seeded = dict(tnet.state_dict())
    seeded[rng_names[0]] = jax.random.key_data(jax.random.key(7))
    seeded_model = es.load_state_dict(abstract, seeded)
    np.testing.assert_array_equal(
        es.state_dict(seeded_model)[rng_names[0]],
        jax.random.key_data(jax.random.key(7)),
    )


# ------------------------------------------------- abstract names, missing order


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.attn = torch.nn.MultiheadAttention(4, 2, batch_first=True)
        self.fc = torch.nn.Linear(4, 2)


class Net(eqx.Module):
    conv: es.nn.Batched
    bn: es.nn.BatchNorm
    attn: eqx.nn.MultiheadAttention
    fc: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.conv = es.nn.Batched(eqx.nn.Conv2d(3, 4, 3, key=k[0]))
        self.bn = es.nn.BatchNorm(4)
        self.attn = eqx.nn.MultiheadAttention(
            2,
            4,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            key=k[1],
        )
        self.fc = eqx.nn.Linear(4, 2, key=k[2])


def test_abstract_state_dict_names_like_the_meta_device():
    with torch.device("meta"):
        meta = TorchNet().state_dict()
    sd = es.state_dict(eqx.filter_eval_shape(Net, jax.random.key(0)))
    assert list(sd) == list(meta)
    for k, v in sd.items():
        assert isinstance(v, jax.ShapeDtypeStruct), k
        assert v.shape == tuple(meta[k].shape), k
    assert sd["bn.num_batches_tracked"].dtype == jnp.int32


@pytest.mark.parametrize("drop", ["conv.", "attn.", "fc.", "bn."])
def test_missing_keys_in_torchs_order(drop):
    t_sd = TorchNet().state_dict()
    partial = {k: v for k, v in t_sd.items() if not k.startswith(drop)}
    expected = TorchNet().load_state_dict(partial, strict=False)  # the reference
    _, keys = es.load_state_dict(Net(jax.random.key(0)), partial, strict=False)
    assert keys.missing_keys == expected.missing_keys
    assert len(keys.missing_keys) >= 2


def test_torch_path_name_follows_state_dict_names():
    from eqx_state._torch_names import torch_path_name

    model = eqx.nn.Sequential(
        [es.nn.Batched(eqx.nn.Linear(2, 2, key=jax.random.key(0))), es.nn.BatchNorm(2)]
    )
    names = [
        torch_path_name(model, p)
        for p, x in jax.tree_util.tree_flatten_with_path(model)[0]
        if eqx.is_array(x)
    ]
    assert names == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "1.running_mean.value",
        "1.running_var.value",
        "1.num_batches_tracked.value",
    ]
    # a key path into a Record inside a Sequential, as `es.recorded` needs
    path = (jax.tree_util.GetAttrKey("layers"), jax.tree_util.SequenceKey(1))
    assert torch_path_name(model, path) == "1"


# ------------------------------- the docs' bidirectional LSTM, against torch.nn.LSTM


def _docs_bilstm():
    """The `BiLSTM` of docs/pytorch.md (a user conversion), run from the page."""
    import pathlib
    import re

    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "pytorch.md"
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)
    block = next(b for b in blocks if "class BiLSTM" in b)
    code = block[: block.index("tlstm = ")]  # the definitions and the registration
    namespace = {"eqx": eqx, "jax": jax, "jnp": jnp, "np": np, "torch": torch, "es": es}
    exec(compile(code, "pytorch.md[BiLSTM]", "exec"), namespace)
    return namespace["BiLSTM"]


def test_docs_bidirectional_lstm_equals_torch_lstm():
    BiLSTM = _docs_bilstm()
    torch.manual_seed(0)
    t = torch.nn.LSTM(4, 6, num_layers=2, bidirectional=True, batch_first=True)
    model = es.load_state_dict(
        eqx.filter_eval_shape(BiLSTM, 4, 6, 2, key=jax.random.key(0)), t.state_dict()
    )
    x = np.random.default_rng(1).normal(size=(3, 9, 4)).astype(np.float32)
    with torch.no_grad():
        ty, (th, tc) = t(_t(x))
    y, (h, c) = jax.jit(jax.vmap(model))(jnp.asarray(x))
    np.testing.assert_allclose(y, ty.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h.swapaxes(0, 1), th.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(c.swapaxes(0, 1), tc.numpy(), rtol=1e-5, atol=1e-5)
    assert float(np.abs(th.numpy()).max()) > 0.05  # a real output

    sd = es.state_dict(model)  # round trip: PyTorch loads it strictly, same outputs
    t2 = torch.nn.LSTM(4, 6, num_layers=2, bidirectional=True, batch_first=True)
    t2.load_state_dict(_torch_sd(sd), strict=True)
    with torch.no_grad():
        np.testing.assert_allclose(t2(_t(x))[0].numpy(), ty.numpy(), atol=1e-5)
    back = es.load_state_dict(model, t2.state_dict())
    _assert_same(es.state_dict(back), _torch_sd(sd))
    with pytest.raises(ValueError, match=r"`bias_ih_l1_reverse` but not"):
        es.load_state_dict(
            model, {"bias_ih_l1_reverse": t.bias_ih_l1_reverse}, strict=False
        )
