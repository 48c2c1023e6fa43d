"""es.state_dict / es.load_state_dict on stacked layers (eqx.filter_vmap: ensembles,
layers stacked for lax.scan) against PyTorch, recordings in abstract models, the
hint for attention biases, and abstract models with metrics. Every reference is
PyTorch's (E torch modules, their state dicts stacked)."""

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import eqx_state as es
from eqx_state._errors import StateValueError


E = 3


def _rng(seed=0):
    return np.random.default_rng(seed)


def _f32(*shape, seed=0):
    return _rng(seed).normal(size=shape).astype(np.float32)


def _member(tree, i):
    return jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, tree)


def _stack(sds):
    return {k: np.stack([sd[k].detach().numpy() for sd in sds]) for k in sds[0]}


def _np(x):
    return x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


# Each case: torch module factory, Equinox factory (a key), inputs (one example,
# NumPy), the torch forward and the Equinox forward of one member on them.
def _mha_eqx(**kw):
    biases = dict(
        use_query_bias=True,
        use_key_bias=True,
        use_value_bias=True,
        use_output_bias=True,
    )
    return lambda k: eqx.nn.MultiheadAttention(2, 8, **kw, **biases, key=k)


def _prelu_torch():
    t = torch.nn.PReLU(4)
    with torch.no_grad():
        t.weight.uniform_(-1, 1)
    return t


CASES = {
    "conv1d": (
        lambda: torch.nn.Conv1d(2, 3, 3, padding=1),
        lambda k: eqx.nn.Conv1d(2, 3, 3, padding=1, key=k),
        lambda: (_f32(2, 7),),
        lambda t, x: t(x[None])[0],
        lambda m, x: m(x),
    ),
    "conv2d": (
        lambda: torch.nn.Conv2d(2, 3, 3, stride=2),
        lambda k: eqx.nn.Conv2d(2, 3, 3, stride=2, key=k),
        lambda: (_f32(2, 7, 6),),
        lambda t, x: t(x[None])[0],
        lambda m, x: m(x),
    ),
    "convtranspose2d_groups": (
        lambda: torch.nn.ConvTranspose2d(4, 6, (2, 3), stride=2, groups=2, padding=1),
        lambda k: eqx.nn.ConvTranspose2d(
            4, 6, (2, 3), stride=2, groups=2, padding=1, key=k
        ),
        lambda: (_f32(4, 4, 5),),
        lambda t, x: t(x[None])[0],
        lambda m, x: m(x),
    ),
    "convtranspose1d": (
        lambda: torch.nn.ConvTranspose1d(3, 2, 3, stride=2, output_padding=1),
        lambda k: eqx.nn.ConvTranspose1d(3, 2, 3, stride=2, output_padding=1, key=k),
        lambda: (_f32(3, 5),),
        lambda t, x: t(x[None])[0],
        lambda m, x: m(x),
    ),
    "convtranspose3d_nobias": (
        lambda: torch.nn.ConvTranspose3d(3, 3, 2, stride=2, bias=False),
        lambda k: eqx.nn.ConvTranspose3d(3, 3, 2, stride=2, use_bias=False, key=k),
        lambda: (_f32(3, 2, 3, 2),),
        lambda t, x: t(x[None])[0],
        lambda m, x: m(x),
    ),
    "mha_packed": (
        lambda: torch.nn.MultiheadAttention(8, 2, batch_first=True),
        _mha_eqx(),
        lambda: (_f32(5, 8),),
        lambda t, x: t(x[None], x[None], x[None], need_weights=False)[0][0],
        lambda m, x: m(x, x, x),
    ),
    "mha_kdim_vdim": (
        lambda: torch.nn.MultiheadAttention(8, 2, kdim=6, vdim=5, batch_first=True),
        _mha_eqx(key_size=6, value_size=5),
        lambda: (_f32(4, 8, seed=1), _f32(7, 6, seed=2), _f32(7, 5, seed=3)),
        lambda t, q, k, v: t(q[None], k[None], v[None], need_weights=False)[0][0],
        lambda m, q, k, v: m(q, k, v),
    ),
    "gru_cell": (
        lambda: torch.nn.GRUCell(3, 5),
        lambda k: eqx.nn.GRUCell(3, 5, key=k),
        lambda: (_f32(3, seed=1), _f32(5, seed=2)),
        lambda t, x, h: t(x[None], h[None])[0],
        lambda m, x, h: m(x, h),
    ),
    "lstm_cell": (
        lambda: torch.nn.LSTMCell(3, 5),
        lambda k: eqx.nn.LSTMCell(3, 5, key=k),
        lambda: (_f32(3, seed=1), _f32(5, seed=2), _f32(5, seed=3)),
        lambda t, x, h, c: torch.cat(t(x[None], (h[None], c[None]))),
        lambda m, x, h, c: jnp.stack(m(x, (h, c))),
    ),
    "prelu": (
        _prelu_torch,
        lambda k: eqx.nn.PReLU(jnp.full((4, 1, 1), 0.25)),
        lambda: (_f32(4, 3, 3),),
        lambda t, x: t(x[None])[0],
        lambda m, x: m(x),
    ),
}
# PyTorch arrays that Equinox keeps as one (summed biases): exported differently,
# with the same outputs
NOT_BITWISE = {"gru_cell", "lstm_cell"}


def _torch_out(case, tm, xs):
    with torch.no_grad():
        return _np(case[3](tm, *(torch.from_numpy(x) for x in xs)))


def _eqx_out(case, m, xs):
    return np.asarray(case[4](m, *(jnp.asarray(x) for x in xs)))


def _torch_members(case, n=E):
    torch.manual_seed(0)
    return [case[0]() for _ in range(n)]


def _check_members(case, ens, tms, xs):
    for i, tm in enumerate(tms):
        got = _eqx_out(case, _member(ens, i), xs)
        np.testing.assert_allclose(got, _torch_out(case, tm, xs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("abstract", [False, True])
def test_stacked_load_matches_torch_members(name, abstract):
    case = CASES[name]
    tms = _torch_members(case)
    keys = jax.random.split(jax.random.key(1), E)

    def build():
        return eqx.filter_vmap(case[1])(keys)

    ens = eqx.filter_eval_shape(build) if abstract else build()
    ens = es.load_state_dict(ens, _stack([t.state_dict() for t in tms]))
    _check_members(case, ens, tms, case[2]())


@pytest.mark.parametrize("name", sorted(CASES))
def test_stacked_export_is_torch_members_stacked(name):
    case = CASES[name]
    tms = _torch_members(case)
    want = _stack([t.state_dict() for t in tms])
    ens = eqx.filter_vmap(case[1])(jax.random.split(jax.random.key(1), E))
    ens = es.load_state_dict(ens, want)
    sd = es.state_dict(ens)
    assert list(sd) == list(want)
    for k in want:
        assert sd[k].shape == want[k].shape, k
        if name not in NOT_BITWISE:
            np.testing.assert_array_equal(sd[k], want[k], err_msg=k)
    # each member's slice loads into PyTorch and computes what the member did
    xs = case[2]()
    for i, tm in enumerate(tms):
        fresh = case[0]()
        fresh.load_state_dict(
            {k: torch.from_numpy(np.array(v[i])) for k, v in sd.items()}
        )
        np.testing.assert_allclose(
            _torch_out(case, fresh, xs), _torch_out(case, tm, xs), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("name", ["convtranspose2d_groups", "mha_packed", "gru_cell"])
def test_two_stacked_axes(name):
    # filter_vmap twice (e.g. an ensemble of scanned layer stacks): [2, 3, ...]
    case = CASES[name]
    tms = _torch_members(case, 6)
    sd = _stack([t.state_dict() for t in tms])
    sd = {k: v.reshape((2, 3) + v.shape[1:]) for k, v in sd.items()}
    keys = jax.random.split(jax.random.key(1), 6).reshape(2, 3)
    ens = eqx.filter_vmap(eqx.filter_vmap(case[1]))(keys)
    ens = es.load_state_dict(ens, sd)
    xs = case[2]()
    for i in range(2):
        for j in range(3):
            got = _eqx_out(case, _member(_member(ens, i), j), xs)
            want = _torch_out(case, tms[3 * i + j], xs)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    out = es.state_dict(ens)
    assert {k: v.shape for k, v in out.items()} == {k: v.shape for k, v in sd.items()}


def test_stacked_in_a_model_and_scan():
    # layers stacked for lax.scan inside a model: the state dict of a
    # torch.nn.ModuleList's members, stacked
    class TorchBlocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                [torch.nn.Conv1d(3, 3, 3, padding=1) for _ in range(E)]
            )

        def forward(self, x):
            for b in self.blocks:
                x = torch.tanh(b(x))
            return x

    class Blocks(eqx.Module):
        blocks: eqx.nn.Conv1d

        def __init__(self, key):
            make = lambda k: eqx.nn.Conv1d(3, 3, 3, padding=1, key=k)  # noqa: E731
            self.blocks = eqx.filter_vmap(make)(jax.random.split(key, E))

        def __call__(self, x):
            params, static = eqx.partition(self.blocks, eqx.is_array)

            def body(x, p):
                return jnp.tanh(eqx.combine(p, static)(x)), None

            return jax.lax.scan(body, x, params)[0]

    torch.manual_seed(0)
    tnet = TorchBlocks()
    tsd = tnet.state_dict()
    sd = {
        f"blocks.{n}": np.stack([tsd[f"blocks.{i}.{n}"].numpy() for i in range(E)])
        for n in ("weight", "bias")
    }
    net = es.load_state_dict(eqx.filter_eval_shape(Blocks, jax.random.key(0)), sd)
    x = _f32(3, 6)
    with torch.no_grad():
        want = tnet(torch.from_numpy(x)[None])[0].numpy()
    np.testing.assert_allclose(net(jnp.asarray(x)), want, rtol=1e-5, atol=1e-5)
    out = es.state_dict(net)
    for k in sd:
        np.testing.assert_array_equal(out[k], sd[k])


@pytest.mark.parametrize("zero_debias", [False, True])
def test_stacked_ema_matches_averaged_model(zero_debias):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    avgs, srcs = [], []
    for i in range(E):
        src = torch.nn.Conv1d(2, E, 3)  # bias [E]: broadcasting on the wrong axis fits
        avg = AveragedModel(src, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        for _ in range(i + 1):  # a different count per member
            with torch.no_grad():
                for p in src.parameters():
                    p.add_(torch.randn_like(p))
            avg.update_parameters(src)
        avgs.append(avg)
        srcs.append(src)
    sd = _stack([a.state_dict() for a in avgs])

    def make(k):
        conv = eqx.nn.Conv1d(2, E, 3, key=k)
        if zero_debias:
            return conv, es.nn.EMA(conv, 0.9, zero_debias=True)
        return conv, es.nn.EMA(conv, 0.9, warmup_length=1)

    convs, ema = eqx.filter_vmap(make)(jax.random.split(jax.random.key(0), E))
    ema = es.load_state_dict(ema, sd)
    x = _f32(2, 6)
    for i, avg in enumerate(avgs):
        averaged = _member(ema, i).averaged(_member(convs, i))
        with torch.no_grad():
            want = avg.module(torch.from_numpy(x)[None])[0].numpy()
        np.testing.assert_allclose(averaged(jnp.asarray(x)), want, rtol=1e-5, atol=1e-5)
    out = es.state_dict(ema)
    assert list(out) == list(sd)
    for k in sd:
        np.testing.assert_allclose(
            out[k], sd[k].astype(out[k].dtype), rtol=1e-6, atol=1e-6, err_msg=k
        )


def test_stacked_spectral_norm_convtranspose_v():
    # SpectralNorm's v of a transposed convolution is flipped in space per member
    torch.manual_seed(0)
    tms = []
    for _ in range(E):
        t = torch.nn.utils.parametrizations.spectral_norm(
            torch.nn.ConvTranspose2d(2, 3, (2, 3), stride=2)
        )
        t.train()
        with torch.no_grad():
            t(torch.randn(1, 2, 4, 4))
        t.eval()
        tms.append(t)
    sd = _stack([t.state_dict() for t in tms])

    def make(k):
        return es.nn.SpectralNorm(
            eqx.nn.ConvTranspose2d(2, 3, (2, 3), stride=2, key=k), key=k
        )

    ens = eqx.filter_vmap(make)(jax.random.split(jax.random.key(0), E))
    ens = es.load_state_dict(ens, sd)
    x = _f32(2, 4, 4)
    for i, t in enumerate(tms):
        m = eqx.nn.inference_mode(_member(ens, i))
        with torch.no_grad():
            want = t(torch.from_numpy(x)[None])[0].numpy()
        np.testing.assert_allclose(m(jnp.asarray(x)), want, rtol=1e-5, atol=1e-5)
    out = es.state_dict(ens)
    for k in sd:
        np.testing.assert_allclose(out[k], sd[k], rtol=1e-6, atol=1e-6, err_msg=k)


# ---------------------------------------------------------- recordings, abstract


class RecNet(eqx.Module):
    fc: es.nn.Batched
    act: es.nn.Record
    cap: es.nn.Capture

    def __init__(self, key):
        self.fc = es.nn.Batched(eqx.nn.Linear(3, 2, key=key))
        self.act = es.nn.Record("std", "max_abs")
        self.cap = es.nn.Capture((2,))

    def __call__(self, x):
        y = self.act(self.fc(x))
        self.cap(y[0])
        return y


def test_abstract_load_fills_recordings_with_initial_values():
    torch.manual_seed(0)
    t = torch.nn.Module()
    t.fc = torch.nn.Linear(3, 2)
    model = es.load_state_dict(
        eqx.filter_eval_shape(RecNet, jax.random.key(0)), t.state_dict()
    )
    fresh = RecNet(jax.random.key(5))

    def arrays(tree):
        return [x for x in jax.tree.leaves(tree) if not isinstance(x, bool)]

    got, want = arrays((model.act, model.cap)), arrays((fresh.act, fresh.cap))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert not isinstance(a, jax.ShapeDtypeStruct)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(model.fc.layer.weight, t.fc.weight.detach().numpy())

    x = jnp.asarray(_f32(4, 3))
    step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    opt_state = step.init(model)
    model, opt_state = step(model, opt_state, x)
    buf = io.BytesIO()
    es.save(buf, (model, opt_state))
    buf.seek(0)
    back = es.load(buf, like=(RecNet(jax.random.key(0)), opt_state))
    assert int(back[0].cap.count[...]) == 1


def test_abstract_load_refuses_metric_statistics():
    class Net(eqx.Module):
        fc: es.nn.Batched
        acc: es.metrics.Accuracy

    t = torch.nn.Module()
    t.fc = torch.nn.Linear(3, 2)
    abstract = eqx.filter_eval_shape(
        lambda: Net(
            es.nn.Batched(eqx.nn.Linear(3, 2, key=jax.random.key(0))),
            es.metrics.Accuracy(),
        )
    )
    with pytest.raises(StateValueError, match=r"acc\.correct"):
        es.load_state_dict(abstract, t.state_dict(), strict=False)


# ------------------------------------------------------------------ bias hints


def test_mha_without_biases_hint_names_equinox_options():
    m = eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(0))
    with pytest.raises(StateValueError) as e:
        es.load_state_dict(m, torch.nn.MultiheadAttention(8, 2).state_dict())
    msg = str(e.value)
    assert "in_proj_bias" in msg and "out_proj.bias" in msg
    for flag in ("use_query_bias", "use_key_bias", "use_value_bias", "use_output_bias"):
        assert f"{flag}=True" in msg
    assert "drop" in msg


def test_nested_mha_and_linear_without_bias_hint():
    class Net(eqx.Module):
        attn: eqx.nn.MultiheadAttention
        fc: eqx.nn.Linear

    class TNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(8, 2)
            self.fc = torch.nn.Linear(8, 3)

    k1, k2 = jax.random.split(jax.random.key(0))
    net = Net(
        eqx.nn.MultiheadAttention(2, 8, key=k1),
        eqx.nn.Linear(8, 3, use_bias=False, key=k2),
    )
    with pytest.raises(StateValueError) as e:
        es.load_state_dict(net, TNet().state_dict())
    msg = str(e.value)
    assert "`eqx.nn.MultiheadAttention` at `attn`" in msg
    assert "use_query_bias=True" in msg
    assert "`fc`" in msg and "use_bias=True" in msg
