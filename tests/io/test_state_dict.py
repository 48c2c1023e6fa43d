"""es.state_dict / es.load_state_dict against torch.nn.Module.state_dict /
load_state_dict: names, layouts (checked by running the same layer in both), bit-exact
round trips in both storage modes, and the errors."""

import enum
import re
import textwrap
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import eqx_state as es


# ----------------------------------------------------------------- the models


class TorchNet(torch.nn.Module):
    def __init__(self, bn1d_momentum=0.1):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn2d = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 5)
        self.bn1d = torch.nn.BatchNorm1d(5, momentum=bn1d_momentum)

    def forward(self, x):
        h = torch.relu(self.bn2d(self.conv(x))).mean(dim=(2, 3))
        return self.bn1d(self.fc(h))


class Net(eqx.Module):
    conv: es.nn.Batched
    bn2d: es.nn.BatchNorm
    fc: es.nn.Batched
    bn1d: es.nn.BatchNorm

    def __init__(self, key, bn1d_momentum=0.1):
        k1, k2 = jax.random.split(key)
        self.conv = es.nn.Batched(eqx.nn.Conv2d(3, 4, 3, padding=1, key=k1))
        self.bn2d = es.nn.BatchNorm(4)
        self.fc = es.nn.Batched(eqx.nn.Linear(4, 5, key=k2))
        self.bn1d = es.nn.BatchNorm(5, momentum=bn1d_momentum)

    def __call__(self, x):
        h = jnp.mean(jax.nn.relu(self.bn2d(self.conv(x))), axis=(2, 3))
        return self.bn1d(self.fc(h))


def _x(seed=0, n=6):
    return np.random.default_rng(seed).normal(size=(n, 3, 5, 5)).astype(np.float32)


def _mode(model, mode):
    return es.to_refs(model) if mode == "ref" else model


def _forward(model, x, mode):
    """A train-mode forward that writes state, in either mode."""
    if mode == "ref":
        return model(x), model
    return es.apply(lambda m, x: m(x), model, x)


def _torch_sd(sd):
    return {k: torch.from_numpy(v) for k, v in sd.items()}


def _eval(model, x):
    return np.asarray(eqx.nn.inference_mode(model)(jnp.asarray(x)))


def _teval(tnet, x):
    tnet.eval()
    with torch.no_grad():
        out = tnet(torch.from_numpy(x)).numpy()
    tnet.train()
    return out


TORCH_NAMES = [
    "conv.weight",
    "conv.bias",
    "bn2d.weight",
    "bn2d.bias",
    "bn2d.running_mean",
    "bn2d.running_var",
    "bn2d.num_batches_tracked",
    "fc.weight",
    "fc.bias",
    "bn1d.weight",
    "bn1d.bias",
    "bn1d.running_mean",
    "bn1d.running_var",
    "bn1d.num_batches_tracked",
]


def test_names_and_layouts_are_pytorchs():
    assert list(TorchNet().state_dict()) == TORCH_NAMES  # the reference
    sd = es.state_dict(Net(jax.random.key(0)))
    assert list(sd) == TORCH_NAMES
    t_sd = TorchNet().state_dict()
    for k, v in sd.items():
        assert isinstance(v, np.ndarray)
        assert v.shape == tuple(t_sd[k].shape), k  # conv bias [C], not [C, 1, 1]
    assert sd["bn1d.num_batches_tracked"].dtype == np.int32


# --------------------------------------------------------- round trips


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_round_trip_through_torch_is_bit_exact(mode):
    model = _mode(Net(jax.random.key(1)), mode)
    for seed in range(2):  # non-trivial statistics, num_batches_tracked == 2
        _, model = _forward(model, jnp.asarray(_x(seed)), mode)
    sd = es.state_dict(model)
    assert int(sd["bn2d.num_batches_tracked"]) == 2

    tnet = TorchNet()
    tnet.load_state_dict(_torch_sd(sd))  # strict: PyTorch accepts every name
    t_sd = tnet.state_dict()
    assert list(t_sd) == list(sd)
    for k in sd:
        np.testing.assert_array_equal(t_sd[k].numpy(), sd[k], err_msg=k)

    back = es.load_state_dict(_mode(Net(jax.random.key(2)), mode), t_sd)
    sd2 = es.state_dict(back)
    for k in sd:
        np.testing.assert_array_equal(sd2[k], sd[k], err_msg=k)
        assert sd2[k].dtype == sd[k].dtype, k
    assert type(back.bn2d.running_mean) is es.BatchStat
    assert type(back.bn2d.num_batches_tracked) is es.BatchStat
    assert isinstance(back.bn1d.running_var.value, jax.Ref) == (mode == "ref")
    # the layouts are right: the same network, the same outputs
    x = _x(5)
    np.testing.assert_allclose(_eval(back, x), _teval(tnet, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_torch_trained_model_continues_training_identically(mode):
    # momentum=None: the running average weights batches by 1/num_batches_tracked,
    # so the loaded count matters for every later update.
    torch.manual_seed(0)
    tnet = TorchNet(bn1d_momentum=None)
    tnet.train()
    with torch.no_grad():
        for seed in range(3):
            tnet(torch.from_numpy(_x(seed)))
    model = Net(jax.random.key(0), bn1d_momentum=None)
    model = es.load_state_dict(_mode(model, mode), tnet.state_dict())
    assert int(model.bn1d.num_batches_tracked[...]) == 3
    x = _x(10)
    np.testing.assert_allclose(_eval(model, x), _teval(tnet, x), rtol=1e-5, atol=1e-5)

    y, model = _forward(model, jnp.asarray(x), mode)
    with torch.no_grad():
        ty = tnet(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(y), ty, rtol=1e-5, atol=1e-5)
    sd, t_sd = es.state_dict(model), tnet.state_dict()
    for k in sd:
        np.testing.assert_allclose(sd[k], t_sd[k].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_a_negative_batch_count_is_refused(mode):
    # PyTorch raises ZeroDivisionError at the next momentum=None batch for -1; here
    # it made every statistic NaN without a word. Refused at the load, naming the
    # entry; the model passed in is left as it was.
    model = _mode(Net(jax.random.key(0), bn1d_momentum=None), mode)
    for bad in (-1, -5):
        sd = dict(TorchNet(bn1d_momentum=None).state_dict())
        sd["bn1d.num_batches_tracked"] = torch.tensor(bad)
        with pytest.raises(
            ValueError, match=r"bn1d\.num_batches_tracked.*never negative"
        ) as e:
            es.load_state_dict(model, sd)
        assert isinstance(e.value, es.EqxStateError)
    assert int(model.bn1d.num_batches_tracked[...]) == 0
    sd["bn1d.num_batches_tracked"] = torch.tensor(float("nan"))  # its dtype first
    with pytest.raises(TypeError, match=r"Dtype mismatch for `bn1d\.num_batches_t"):
        es.load_state_dict(model, sd)
    sd["bn1d.num_batches_tracked"] = torch.tensor(0)  # 0 and up load
    assert int(es.load_state_dict(model, sd).bn1d.num_batches_tracked[...]) == 0


def test_a_step_after_loading_numpy_into_cells():
    # Loading writes the cell's value and keeps the cell: the model still trains.
    sd = {k: v.numpy() for k, v in TorchNet().state_dict().items()}
    model = es.load_state_dict(Net(jax.random.key(0)), sd)
    assert type(model.bn1d.running_mean) is es.BatchStat

    def loss_fn(model, x):
        return jnp.mean(model(x) ** 2)

    step = es.make_step(loss_fn, optax.sgd(0.1))
    opt_state = step.init(model)
    model, opt_state = step(model, opt_state, jnp.asarray(_x()))
    assert int(model.bn1d.num_batches_tracked[...]) == 1


def test_ref_mode_load_returns_new_refs_and_leaves_the_model_alone():
    model = es.to_refs(Net(jax.random.key(0)))
    sd = es.state_dict(model)
    sd["bn2d.running_mean"] = np.full(4, 7.0, np.float32)
    new = es.load_state_dict(model, sd)
    assert isinstance(new.bn2d.running_mean.value, jax.Ref)
    assert new.bn2d.running_mean.value is not model.bn2d.running_mean.value
    np.testing.assert_array_equal(new.bn2d.running_mean[...], np.full(4, 7.0))
    np.testing.assert_array_equal(model.bn2d.running_mean[...], np.zeros(4))
    new(jnp.asarray(_x()))  # writes the new refs only
    assert int(new.bn2d.num_batches_tracked[...]) == 1
    assert int(model.bn2d.num_batches_tracked[...]) == 0


class _Recorded(eqx.Module):
    fc: es.nn.Batched
    rec: es.nn.Record
    cap: es.nn.Capture
    bn: es.nn.BatchNorm

    def __call__(self, x):
        return self.bn(self.cap(self.rec(self.fc(x))))


def test_ref_mode_load_gives_recordings_new_refs_too():
    """Recordings (`Record`, `Capture`: in no state dict) came back holding the
    refs of the model passed in, so calling or resetting the loaded model wrote
    the old model's recordings, against the docstring's "new refs"."""
    old = es.to_refs(
        _Recorded(
            es.nn.Batched(eqx.nn.Linear(4, 3, key=jax.random.key(0))),
            es.nn.Record("mean"),
            es.nn.Capture((2, 3)),
            es.nn.BatchNorm(3),
        )
    )
    tm = torch.nn.Module()
    tm.fc, tm.bn = torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)
    before = {k: np.asarray(v) for k, v in es.recorded(old).items()}
    new = es.load_state_dict(old, tm.state_dict())
    refs = lambda m: [  # noqa: E731
        x for x in jax.tree.leaves(m) if isinstance(x, jax.Ref)
    ]
    assert not {id(r) for r in refs(new)} & {id(r) for r in refs(old)}
    new(jnp.ones((2, 4)))
    es.reset(new, es.RecordState)
    after = {k: np.asarray(v) for k, v in es.recorded(old).items()}
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])
    assert int(old.cap.count[...]) == 0


def test_ref_mode_load_keeps_the_cells_names():
    """A ref-mode model loaded from a state dict names its cells in eager errors
    as the model it replaces did (as after `es.load`): its new refs had no name,
    and a converted layer's (SpectralNorm's `u`, `v`) were named by their path
    inside the layer (`model.u`)."""
    tm = torch.nn.Module()
    tm.fc, tm.bn = torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)
    tm.sn = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(4, 3))
    old = es.to_refs(
        {
            "fc": es.nn.Batched(eqx.nn.Linear(4, 3, key=jax.random.key(0))),
            "bn": es.nn.BatchNorm(3),
            "cap": es.nn.Capture((2, 3)),  # in no state dict: a fresh ref
            "sn": es.nn.SpectralNorm(
                eqx.nn.Linear(4, 3, key=jax.random.key(1)), key=jax.random.key(2)
            ),
        }
    )
    new = es.load_state_dict(old, tm.state_dict())
    for path, cell in [
        ("model['bn'].running_mean", new["bn"].running_mean),
        ("model['bn'].num_batches_tracked", new["bn"].num_batches_tracked),
        ("model['cap'].count", new["cap"].count),
        ("model['sn'].u", new["sn"].u),
    ]:
        before = np.asarray(cell[...])
        with pytest.raises(
            es.StateWriteError, match=re.escape(f"cell at `{path}` (ref")
        ):
            cell[...] = jnp.zeros((7,), jnp.float32)
        np.testing.assert_array_equal(cell[...], before)
    np.testing.assert_array_equal(new["sn"].u[...], tm.sn.parametrizations.weight[0]._u)


@pytest.mark.parametrize("kind", ["torch", "numpy", "jax"])
def test_accepts_torch_numpy_and_jax_values(kind):
    t_sd = TorchNet().state_dict()
    conv = {
        "torch": lambda t: t.clone().requires_grad_(t.is_floating_point()),
        "numpy": lambda t: t.numpy(),
        "jax": lambda t: jnp.asarray(t.numpy()),
    }[kind]
    sd = {k: conv(v) for k, v in t_sd.items()}
    model = es.load_state_dict(Net(jax.random.key(0)), sd)
    for k, v in es.state_dict(model).items():
        np.testing.assert_array_equal(v, t_sd[k].numpy())
    if kind == "jax":
        # loaded arrays are copies: a donating step does not delete the inputs
        step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
        step(model, step.init(model), jnp.asarray(_x()))
        assert not sd["fc.weight"].is_deleted()
        assert not sd["bn2d.running_mean"].is_deleted()


def test_bfloat16_is_loaded_bit_exactly():
    tlin = torch.nn.Linear(3, 2).to(torch.bfloat16)
    lin = eqx.nn.Linear(3, 2, dtype=jnp.bfloat16, key=jax.random.key(0))
    lin = es.load_state_dict(lin, tlin.state_dict())
    assert lin.weight.dtype == jnp.bfloat16
    bits = tlin.weight.detach().view(torch.int16).numpy()
    np.testing.assert_array_equal(np.asarray(lin.weight).view(np.int16), bits)
    sd = es.state_dict(lin)
    assert sd["weight"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(sd["weight"].view(np.int16), bits)


# ------------------------------------------------------- strict=False, errors


class TorchWider(torch.nn.Module):
    """TorchNet without `bn1d`, with an extra `head`."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn2d = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 5)
        self.head = torch.nn.Linear(5, 2)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_strict_false_reports_what_torch_reports(mode):
    other = TorchWider().state_dict()
    expected = TorchNet().load_state_dict(other, strict=False)  # the reference
    model = _mode(Net(jax.random.key(0)), mode)
    before = es.state_dict(model)
    new, keys = es.load_state_dict(model, other, strict=False)
    assert isinstance(keys, es.IncompatibleKeys)
    assert keys.missing_keys == expected.missing_keys
    assert keys.unexpected_keys == expected.unexpected_keys
    assert keys.missing_keys[0] == "bn1d.weight" and keys.unexpected_keys
    after = es.state_dict(new)
    np.testing.assert_array_equal(after["fc.weight"], other["fc.weight"].numpy())
    np.testing.assert_array_equal(after["bn1d.running_var"], before["bn1d.running_var"])

    with pytest.raises(
        ValueError, match=r"Missing key\(s\) in state_dict: bn1d\.weight"
    ):
        es.load_state_dict(model, other)
    with pytest.raises(
        ValueError, match=r"Unexpected key\(s\) in state_dict: head\.weight"
    ):
        es.load_state_dict(model, other)


@pytest.mark.parametrize("metadata", [True, False])
def test_missing_num_batches_tracked_follows_torchs_version_rule(metadata):
    t_sd = TorchNet().state_dict()
    t_sd["bn1d.num_batches_tracked"] = torch.tensor(4)
    sd = type(t_sd)((k, v) for k, v in t_sd.items() if k != "bn2d.num_batches_tracked")
    if metadata:  # saved by a PyTorch >= 0.4.1: version 2, the count is required
        sd._metadata = t_sd._metadata  # pyright: ignore
    tnet = TorchNet()
    with torch.no_grad():
        tnet.bn2d.num_batches_tracked.fill_(9)
    expected = tnet.load_state_dict(sd, strict=False)  # the reference
    model = eqx.tree_at(
        lambda m: m.bn2d.num_batches_tracked.value,
        Net(jax.random.key(0)),
        jnp.asarray(9, jnp.int32),
    )
    new, keys = es.load_state_dict(model, sd, strict=False)
    assert keys.missing_keys == expected.missing_keys
    assert keys.missing_keys == (["bn2d.num_batches_tracked"] if metadata else [])
    assert (
        int(new.bn2d.num_batches_tracked[...])
        == 9
        == int(tnet.bn2d.num_batches_tracked)
    )
    assert int(new.bn1d.num_batches_tracked[...]) == 4
    if not metadata:  # an old checkpoint loads strictly, in both libraries
        es.load_state_dict(model, sd)
        abstract = eqx.filter_eval_shape(Net, jax.random.key(0))
        loaded = es.load_state_dict(abstract, sd)
        assert int(loaded.bn2d.num_batches_tracked[...]) == 0


def test_shape_mismatch_names_the_key_even_when_not_strict():
    sd = TorchNet().state_dict()
    sd["fc.weight"] = torch.zeros(3, 4)
    with pytest.raises(RuntimeError, match="size mismatch for fc.weight"):
        TorchNet().load_state_dict(sd, strict=False)  # PyTorch refuses too
    for strict in (True, False):
        with pytest.raises(ValueError, match=r"`fc\.weight`.*\(3, 4\).*\(5, 4\)"):
            es.load_state_dict(Net(jax.random.key(0)), sd, strict=strict)
    sd = TorchNet().state_dict()
    sd["conv.bias"] = torch.zeros(4, 1, 1)  # Equinox's layout is not PyTorch's
    with pytest.raises(ValueError, match=r"`conv\.bias`.*\(4, 1, 1\).*\(4,\)"):
        es.load_state_dict(Net(jax.random.key(0)), sd)


def test_dtype_mismatches_raise_naming_the_key():
    net = Net(jax.random.key(0))
    sd = TorchNet().state_dict()
    with pytest.raises(TypeError, match=r"`fc\.weight`.*float64.*float32"):
        es.load_state_dict(net, {**sd, "fc.weight": sd["fc.weight"].double()})
    with pytest.raises(TypeError, match=r"`bn2d\.running_var`.*int64.*float32"):
        es.load_state_dict(
            net, {**sd, "bn2d.running_var": torch.ones(4, dtype=torch.int64)}
        )
    big = torch.tensor(2**40)
    with pytest.raises(TypeError, match=r"`bn1d\.num_batches_tracked`.*do not fit"):
        es.load_state_dict(net, {**sd, "bn1d.num_batches_tracked": big})
    # an int64 count that fits is PyTorch's own dtype: it loads
    model = es.load_state_dict(net, {**sd, "bn1d.num_batches_tracked": torch.tensor(7)})
    assert model.bn1d.num_batches_tracked[...].dtype == jnp.int32
    assert int(model.bn1d.num_batches_tracked[...]) == 7


def test_not_an_array_or_not_a_mapping():
    net = Net(jax.random.key(0))
    sd = TorchNet().state_dict()
    with pytest.raises(TypeError, match=r"state_dict\['fc\.bias'\] is a list"):
        es.load_state_dict(net, {**sd, "fc.bias": [0.0] * 5})
    with pytest.raises(TypeError, match="(?i)mapping"):  # also under beartype
        es.load_state_dict(net, list(sd.items()))  # pyright: ignore


def test_hints_for_data_parallel_prefix_and_equinox_batchnorm():
    sd = {f"module.{k}": v for k, v in TorchNet().state_dict().items()}
    with pytest.raises(ValueError, match=r"removeprefix\('module\.'\)"):
        es.load_state_dict(Net(jax.random.key(0)), sd)

    class EqxBN(eqx.Module):
        bn: eqx.nn.BatchNorm

    model = EqxBN(eqx.nn.BatchNorm(4, "batch", mode="batch"))
    t_sd = torch.nn.Module()
    t_sd.bn = torch.nn.BatchNorm1d(4)
    with pytest.raises(ValueError, match=r"use `eqx_state\.nn\.BatchNorm`"):
        es.load_state_dict(model, t_sd.state_dict())


def test_consumed_model_raises_stale_model_error():
    model = Net(jax.random.key(0))
    step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    opt_state = step.init(model)
    sd = es.state_dict(model)
    new, opt_state = step(model, opt_state, jnp.asarray(_x()))
    with pytest.raises(
        es.StaleModelError, match=r"donate=False.*Consumed: `conv\.weight`"
    ):
        es.state_dict(model)
    with pytest.raises(es.StaleModelError, match="donate=False"):
        es.load_state_dict(model, sd)
    es.load_state_dict(new, sd)  # the returned model is fine


# ------------------------------------------- names: containers and exclusions


def test_sequential_list_and_dict_are_named_like_torch_containers():
    t = torch.nn.Module()
    t.features = torch.nn.Sequential(
        torch.nn.Conv1d(2, 3, 3), torch.nn.ReLU(), torch.nn.BatchNorm1d(3)
    )
    t.blocks = torch.nn.ModuleList([torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)])
    t.heads = torch.nn.ModuleDict({"cls": torch.nn.Linear(3, 2)})

    class M(eqx.Module):
        features: eqx.nn.Sequential
        blocks: list
        heads: dict
        dropout: eqx.nn.Dropout  # no PyTorch name: parameterless, `p` and `inference`
        scale: float = eqx.field(static=True)

    k = iter(jax.random.split(jax.random.key(0), 4))
    m = M(
        eqx.nn.Sequential(
            [
                eqx.nn.Conv1d(2, 3, 3, key=next(k)),
                eqx.nn.Lambda(jax.nn.relu),
                es.nn.BatchNorm(3),
            ]
        ),
        [eqx.nn.Linear(3, 3, key=next(k)), eqx.nn.Linear(3, 3, key=next(k))],
        {"cls": eqx.nn.Linear(3, 2, key=next(k))},
        eqx.nn.Dropout(0.1),
        2.0,
    )
    assert list(es.state_dict(m)) == list(t.state_dict())
    m = es.load_state_dict(m, t.state_dict())
    np.testing.assert_array_equal(
        m.heads["cls"].bias, t.heads.cls.bias.detach().numpy()
    )


def test_duplicate_names_are_refused():
    with pytest.raises(ValueError, match=r"`a\.b`"):
        es.state_dict({"a": {"b": jnp.zeros(1)}, "a.b": jnp.ones(1)})


class TwoCounters(eqx.Module):
    a: es.nn.Counter
    b: es.nn.Counter


def test_one_ref_at_two_places_is_refused():
    """Exported under two names, the one state would load back as two states;
    `es.save` and `es.to_orbax` refuse it too."""
    counter = es.to_refs(es.nn.Counter())
    with pytest.raises(es.CheckpointError) as info:
        es.state_dict(TwoCounters(counter, counter))
    message = str(info.value)
    assert message.startswith(
        "`es.state_dict` refuses a tree that holds one ref at two places: a state "
        "dict names each place"
    )
    assert (
        "`model.a.count` and `model.b.count`" in message and "eqx.nn.Shared" in message
    )
    assert isinstance(info.value, es.StateError)
    # each place with its own ref: two names, two values, bit for bit
    model = es.to_refs(TwoCounters(es.nn.Counter(), es.nn.Counter()))
    model.a.increment()
    sd = es.state_dict(model)
    assert list(sd) == ["a.count", "b.count"]
    assert sd["a.count"].tobytes() == np.array(1, np.int32).tobytes()
    assert sd["b.count"].tobytes() == np.array(0, np.int32).tobytes()


class Keyed(eqx.Module):
    key: es.RngState
    rng: es.nn.Rng


def test_prng_key_cells_round_trip_as_key_data():
    m = Keyed(es.RngState(jax.random.key(3)), es.nn.Rng(5))
    sd = es.state_dict(m)
    assert sd["key"].dtype == np.uint32
    np.testing.assert_array_equal(sd["key"], jax.random.key_data(jax.random.key(3)))
    new = es.load_state_dict(Keyed(es.RngState(jax.random.key(0)), es.nn.Rng(0)), sd)
    assert jax.dtypes.issubdtype(new.key.value.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(new.key.value), sd["key"])
    for k, v in es.state_dict(new).items():
        np.testing.assert_array_equal(v, sd[k])


class _KeyParam(eqx.Module):
    w: jax.Array
    key: jax.Array  # a typed key held as a plain field, not a cell


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@pytest.mark.parametrize("like", ["concrete", "abstract"])
def test_a_typed_key_field_round_trips_like_a_key_cell(impl, like):
    """`state_dict` writes a typed key field as its key data (as a cell's), but
    loading it back compared the data's shape with the key's `()` and refused the
    model's own state dict."""

    def make(seed):
        return _KeyParam(jnp.ones(2), jax.random.key(seed, impl=impl))

    sd = es.state_dict(make(3))
    want = np.asarray(jax.random.key_data(jax.random.key(3, impl=impl)))
    np.testing.assert_array_equal(sd["key"], want)
    target = make(0) if like == "concrete" else eqx.filter_eval_shape(make, 0)
    new = es.load_state_dict(target, sd)
    assert jax.dtypes.issubdtype(new.key.dtype, jax.dtypes.prng_key)
    assert str(jax.random.key_impl(new.key)) == str(jax.random.key_impl(make(0).key))
    np.testing.assert_array_equal(jax.random.key_data(new.key), want)
    np.testing.assert_array_equal(  # draws as the saved key does
        jax.random.normal(new.key, (3,)),
        jax.random.normal(jax.random.key(3, impl=impl), (3,)),
    )
    with pytest.raises(ValueError, match=r"Size mismatch for `key`.*\(1,\)"):
        es.load_state_dict(target, {**sd, "key": want[:1]})
    committed = jax.device_put(jax.random.key(3, impl=impl), jax.devices()[0])
    for key in [jax.random.key(3, impl=impl), committed]:
        with pytest.raises(TypeError, match=r"state_dict\['key'\] is an array of typ"):
            es.load_state_dict(target, {**sd, "key": key})


class _KeyConverted(eqx.Module):
    w: jax.Array
    key: jax.Array


def test_a_typed_key_through_a_registered_conversion_loads():
    """A conversion that passes a typed key through: the returned leaf's dtype is
    JAX's key type, which the check of what `from_torch` returns read as a NumPy
    dtype (a `TypeError` from NumPy)."""
    es.register_torch_names(
        _KeyConverted,
        lambda m: {"w": m.w, "key": m.key},
        lambda m, a: _KeyConverted(a["w"], a["key"]),
    )
    model = _KeyConverted(jnp.ones(2), jax.random.key(0))
    sd = es.state_dict(_KeyConverted(jnp.zeros(2), jax.random.key(3)))
    loaded = es.load_state_dict(model, sd)
    np.testing.assert_array_equal(loaded.w, np.zeros(2))
    np.testing.assert_array_equal(
        jax.random.key_data(loaded.key), jax.random.key_data(jax.random.key(3))
    )


def test_abstract_model_is_filled_from_the_state_dict():
    t_sd = TorchNet().state_dict()
    abstract = eqx.filter_eval_shape(Net, jax.random.key(0))
    assert isinstance(abstract.fc.layer.weight, jax.ShapeDtypeStruct)
    names = es.state_dict(abstract)  # names and shapes, no arrays (meta device)
    assert list(names) == list(t_sd)
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in names.values())
    model = es.load_state_dict(abstract, t_sd)
    for k, v in es.state_dict(model).items():
        np.testing.assert_array_equal(v, t_sd[k].numpy())
    partial = {k: v for k, v in t_sd.items() if not k.startswith("bn1d")}
    with pytest.raises(ValueError, match=r"abstract.*bn1d\.weight"):
        es.load_state_dict(abstract, partial, strict=False)


# ------------------------------------- every layer pair, run in both libraries


def _t(x):
    return torch.from_numpy(np.asarray(x))


CONV_CASES = {
    "conv1d": (1, False, dict(stride=2, padding=1, groups=2)),
    "conv2d": (2, False, dict(padding=1, dilation=2)),
    "conv3d": (3, False, dict(use_bias=False)),
    "convT1d": (1, True, dict(stride=2, padding=1, output_padding=1, groups=2)),
    "convT2d": (2, True, dict(stride=2, padding=1, output_padding=1, dilation=2)),
    "convT3d": (3, True, dict(stride=1, padding=0)),
}


def _layer_cases():
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    cases = {}
    for name, (nd, transpose, kw) in CONV_CASES.items():
        kw = dict(kw)
        if kw.pop("use_bias", True) is False:
            tk, ek = dict(kw, bias=False), dict(kw, use_bias=False)
        else:
            tk, ek = kw, kw
        tname = f"{'ConvTranspose' if transpose else 'Conv'}{nd}d"
        cases[name] = lambda tname=tname, tk=tk, ek=ek, nd=nd: (
            getattr(torch.nn, tname)(4, 6, 3, **tk),
            getattr(eqx.nn, tname)(4, 6, 3, key=key, **ek),
            nd,
        )
    x2 = rng.normal(size=(3, 6)).astype(np.float32)
    xc = rng.normal(size=(2, 6, 4, 4)).astype(np.float32)
    q, k, v = (rng.normal(size=(5, 8)).astype(np.float32) for _ in range(3))
    k6, v3 = (
        rng.normal(size=(4, 6)).astype(np.float32),
        rng.normal(size=(4, 3)).astype(np.float32),
    )
    h5, c5 = (
        rng.normal(size=(5,)).astype(np.float32),
        rng.normal(size=(5,)).astype(np.float32),
    )
    x3 = rng.normal(size=(3,)).astype(np.float32)
    ids = np.array([3, 0, 9, 3])
    mha_bias = dict(
        use_query_bias=True,
        use_key_bias=True,
        use_value_bias=True,
        use_output_bias=True,
    )
    return {
        "linear": (
            torch.nn.Linear(6, 4),
            eqx.nn.Linear(6, 4, key=key),
            lambda m: jax.vmap(m)(x2),
            lambda t: t(_t(x2)),
        ),
        "linear_no_bias": (
            torch.nn.Linear(6, 4, bias=False),
            eqx.nn.Linear(6, 4, use_bias=False, key=key),
            lambda m: jax.vmap(m)(x2),
            lambda t: t(_t(x2)),
        ),
        "embedding": (
            torch.nn.Embedding(10, 4),
            eqx.nn.Embedding(10, 4, key=key),
            lambda m: jax.vmap(m)(ids),
            lambda t: t(_t(ids)),
        ),
        "layernorm": (
            torch.nn.LayerNorm(6),
            eqx.nn.LayerNorm(6),
            lambda m: jax.vmap(m)(x2),
            lambda t: t(_t(x2)),
        ),
        "groupnorm": (
            torch.nn.GroupNorm(3, 6),
            eqx.nn.GroupNorm(3, 6),
            lambda m: jax.vmap(m)(xc),
            lambda t: t(_t(xc)),
        ),
        "prelu": (
            torch.nn.PReLU(),
            eqx.nn.PReLU(),
            lambda m: m(x2),
            lambda t: t(_t(x2)),
        ),
        "prelu_channels": (
            torch.nn.PReLU(6),
            eqx.nn.PReLU(jnp.full((6, 1, 1), 0.25)),
            lambda m: jax.vmap(m)(xc),
            lambda t: t(_t(xc)),
        ),
        "mha": (
            torch.nn.MultiheadAttention(8, 2, batch_first=True),
            eqx.nn.MultiheadAttention(2, 8, key=key, **mha_bias),
            lambda m: m(q, k, v),
            lambda t: t(_t(q)[None], _t(k)[None], _t(v)[None], need_weights=False)[0][
                0
            ],
        ),
        "mha_kdim_vdim": (
            torch.nn.MultiheadAttention(8, 2, kdim=6, vdim=3, batch_first=True),
            eqx.nn.MultiheadAttention(
                2, 8, key_size=6, value_size=3, key=key, **mha_bias
            ),
            lambda m: m(q, k6, v3),
            lambda t: t(_t(q)[None], _t(k6)[None], _t(v3)[None], need_weights=False)[0][
                0
            ],
        ),
        "mha_no_bias": (
            torch.nn.MultiheadAttention(8, 2, bias=False, batch_first=True),
            eqx.nn.MultiheadAttention(2, 8, key=key),
            lambda m: m(q, k, v),
            lambda t: t(_t(q)[None], _t(k)[None], _t(v)[None], need_weights=False)[0][
                0
            ],
        ),
        "lstm": (
            torch.nn.LSTMCell(3, 5),
            eqx.nn.LSTMCell(3, 5, key=key),
            lambda m: jnp.concatenate(m(x3, (h5, c5))),
            lambda t: torch.cat(
                [a[0] for a in t(_t(x3)[None], (_t(h5)[None], _t(c5)[None]))]
            ),
        ),
        "gru": (
            torch.nn.GRUCell(3, 5),
            eqx.nn.GRUCell(3, 5, key=key),
            lambda m: m(x3, h5),
            lambda t: t(_t(x3)[None], _t(h5)[None])[0],
        ),
    }, cases


LAYERS, CONVS = _layer_cases()
# PyTorch -> Equinox -> PyTorch is bit-exact except where Equinox keeps fewer
# arrays than PyTorch (one LSTM/GRU bias for two): there the outputs agree.
NOT_BIJECTIVE = {"lstm", "gru"}


def _check_pair(name, tlayer, elayer, run_e, run_t):
    torch.manual_seed(0)
    elayer = es.load_state_dict(elayer, tlayer.state_dict())  # PyTorch -> Equinox
    with torch.no_grad():
        want = run_t(tlayer).numpy()
    got = np.asarray(run_e(elayer))
    assert np.std(want) > 1e-3  # a real output
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)

    sd = es.state_dict(elayer)  # Equinox -> PyTorch
    assert list(sd) == list(tlayer.state_dict())
    tlayer.load_state_dict(_torch_sd(sd))
    with torch.no_grad():
        np.testing.assert_allclose(run_t(tlayer).numpy(), want, rtol=1e-5, atol=1e-5)
    if name not in NOT_BIJECTIVE:
        for k, v in tlayer.state_dict().items():
            np.testing.assert_array_equal(v.numpy(), sd[k], err_msg=f"{name}: {k}")
    back = es.load_state_dict(elayer, sd)  # and back, exactly
    for k, v in es.state_dict(back).items():
        np.testing.assert_array_equal(v, sd[k])


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.split
def test_layer_matches_torch(name):
    _check_pair(name, *LAYERS[name])


@pytest.mark.parametrize("name", list(CONVS))
@pytest.mark.split
def test_conv_layer_matches_torch(name):
    tlayer, elayer, nd = CONVS[name]()
    x = np.random.default_rng(1).normal(size=(2, 4) + (5,) * nd).astype(np.float32)
    _check_pair(name, tlayer, elayer, lambda m: jax.vmap(m)(x), lambda t: t(_t(x)))


def test_attention_without_a_pytorch_equivalent_keeps_equinox_names():
    mha = eqx.nn.MultiheadAttention(2, 8, qk_size=3, key=jax.random.key(0))
    sd = es.state_dict(mha)
    assert "query_proj.weight" in sd and "in_proj_weight" not in sd
    assert sd["query_proj.weight"].shape == (6, 8)
    es.load_state_dict(mha, sd)


def test_partial_load_into_a_converted_layer_keeps_the_rest():
    mha = eqx.nn.MultiheadAttention(2, 8, use_output_bias=True, key=jax.random.key(0))
    t = torch.nn.MultiheadAttention(8, 2, bias=False)
    new, keys = es.load_state_dict(
        mha, {"out_proj.weight": t.out_proj.weight}, strict=False
    )
    assert keys.missing_keys == ["in_proj_weight", "out_proj.bias"]
    np.testing.assert_array_equal(
        new.output_proj.weight, t.out_proj.weight.detach().numpy()
    )
    np.testing.assert_array_equal(new.query_proj.weight, mha.query_proj.weight)


# ----------------------------------------------------------- docstrings


@pytest.mark.parametrize(
    "obj",
    [es.state_dict, es.load_state_dict, es.register_torch_names],
    ids=lambda o: o.__name__,
)
def test_docstring_examples_run(obj, capsys):
    blocks = re.findall(r"```python\n(.*?)```", obj.__doc__, flags=re.S)
    assert blocks
    for block in blocks:
        block = textwrap.dedent(block)
        exec(block, {})
        printed = capsys.readouterr().out
        for line in block.splitlines():
            m = re.match(r"\s*print\(.*\)\s+# (.+)$", line)
            if m:
                assert m.group(1).strip() in printed, (line, printed)


def test_a_bfloat16_torch_batch_norm_loads_exactly():
    """A bfloat16 PyTorch BatchNorm into `es.nn.BatchNorm(dtype=bfloat16)`, whose
    running statistics are float32: widened exactly; narrowing is still refused."""
    t = torch.nn.BatchNorm1d(3).to(torch.bfloat16)
    with torch.no_grad():
        t.running_mean.copy_(torch.tensor([0.1, 0.2, 0.3]))
        t.weight.copy_(torch.tensor([1.5, 2.5, 3.5]))
    m = es.load_state_dict(es.nn.BatchNorm(3, dtype=jnp.bfloat16), t.state_dict())
    assert m.running_mean.dtype == jnp.float32 and m.weight.dtype == jnp.bfloat16
    np.testing.assert_array_equal(m.running_mean[...], t.running_mean.float().numpy())
    np.testing.assert_array_equal(
        np.asarray(m.weight, np.float32), t.weight.float().detach().numpy()
    )
    wide = {
        k: v.double() if v.is_floating_point() else v for k, v in t.state_dict().items()
    }
    with pytest.raises(
        TypeError,
        match=r"Dtype mismatch for `weight`: .* float64.*`sd\['weight'\] = "
        r"sd\['weight'\]\.to\(torch\.bfloat16\)`.*or build the model with "
        r"dtype=float64",
    ):
        es.load_state_dict(es.nn.BatchNorm(3, dtype=jnp.bfloat16), wide)
    # another kind (a float count): cast that entry; no model dtype would help
    count = {**t.state_dict(), "num_batches_tracked": torch.tensor(2.0)}
    with pytest.raises(
        TypeError, match=r"num_batches_tracked.*\.to\(torch\.int32\)`.*int32\)`\.$"
    ):
        es.load_state_dict(es.nn.BatchNorm(3, dtype=jnp.bfloat16), count)
    # and back, by the documented recipe (`torch.from_numpy` takes no bfloat16):
    # PyTorch's module holds the same bits
    back = torch.nn.BatchNorm1d(3).to(torch.bfloat16)

    def to_torch(v):
        if v.dtype == jnp.bfloat16:
            return torch.from_numpy(v.view(np.uint16).copy()).view(torch.bfloat16)
        return torch.from_numpy(v.copy())

    sd = es.state_dict(m)
    back.load_state_dict({k: to_torch(v) for k, v in sd.items()})
    for k, v in back.state_dict().items():
        assert torch.equal(v, t.state_dict()[k].to(v.dtype)), k


class _OneTensor(eqx.Module):
    w: jax.Array


@pytest.mark.parametrize(
    "dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"]
)
def test_tensors_of_dtypes_numpy_lacks_load_bit_for_bit(dtype):
    t = torch.linspace(-3, 3, 7).to(getattr(torch, dtype))
    got = es.load_state_dict(_OneTensor(jnp.zeros(7, dtype)), {"w": t}).w
    assert got.dtype == jnp.dtype(dtype)
    bits = torch.int8 if t.element_size() == 1 else torch.int16
    assert np.array_equal(
        np.asarray(got).view(np.int8 if t.element_size() == 1 else np.int16),
        t.view(bits).numpy(),
    )


def test_a_conjugated_tensor_loads_its_values():
    t = (torch.arange(3) * (1 + 2j)).to(torch.complex64).conj()
    assert t.is_conj()
    got = es.load_state_dict(_OneTensor(jnp.zeros(3, jnp.complex64)), {"w": t}).w
    assert np.array_equal(np.asarray(got), t.resolve_conj().numpy())


def test_tensors_without_readable_values_name_the_key():
    like = _OneTensor(jnp.zeros(3))
    with pytest.raises(ValueError, match=r"state_dict\[.w.\].*meta device") as info:
        es.load_state_dict(like, {"w": torch.empty(3, device="meta")})
    assert isinstance(info.value, es.EqxStateError)
    sparse = torch.zeros(3).to_sparse()
    with pytest.raises(es.EqxStateError, match=r"state_dict\['w'\]"):
        es.load_state_dict(like, {"w": sparse})


def test_a_count_loaded_at_the_int32_limit_saturates_instead_of_wrapping():
    """PyTorch's int64 count at 2**31 - 1 loads into the int32 cell; the next
    training call wrapped it to -2**31, and `momentum=None`'s weight 1 / count
    turned negative. It saturates, and the running mean stays PyTorch's to float32
    precision; a count past int32 is refused, naming the fix."""
    t = torch.nn.BatchNorm1d(2, momentum=None)
    t.num_batches_tracked.fill_(2**31 - 1)  # running mean 0: a wrapped count's
    # negative weight gives -4.7e-8 where PyTorch has +4.7e-8
    bn = es.load_state_dict(es.nn.BatchNorm(2, momentum=None), t.state_dict())
    x = np.array([[100.0, 100.0], [102.0, 102.0]], np.float32)
    t(torch.from_numpy(x))
    _, bn = es.apply(lambda m, x: m(x), bn, jnp.asarray(x))
    assert int(bn.num_batches_tracked[...]) == 2**31 - 1
    np.testing.assert_allclose(bn.running_mean[...], t.running_mean.numpy(), rtol=1e-6)
    assert (np.asarray(bn.running_mean[...]) > 0).all()
    t.num_batches_tracked.fill_(2**31)
    with pytest.raises(TypeError, match=r"do not fit in int32.*clamp") as info:
        es.load_state_dict(es.nn.BatchNorm(2, momentum=None), t.state_dict())
    # the advice works
    sd = t.state_dict()
    sd["num_batches_tracked"] = sd["num_batches_tracked"].clamp(-(2**31), 2**31 - 1)
    bn = es.load_state_dict(es.nn.BatchNorm(2, momentum=None), sd)
    assert int(bn.num_batches_tracked[...]) == 2**31 - 1
    assert "clamp(-2147483648, 2147483647)" in str(info.value)


@pytest.mark.parametrize("mode", ["value", "abstract"])
def test_a_weakly_typed_parameter_loads_weakly_typed(mode):
    """`eqx.nn.PReLU`'s alpha (and any `jnp.asarray(0.5)` field) is weakly typed:
    a bfloat16 activation times it stays bfloat16. Loaded as a strong float32, it
    made the model compute in float32 after a state-dict round trip (es.load keeps
    the weak type)."""
    model = eqx.nn.PReLU()
    assert model.negative_slope.weak_type
    sd = es.state_dict(model)
    like = eqx.filter_eval_shape(eqx.nn.PReLU) if mode == "abstract" else model
    loaded = es.load_state_dict(like, sd)
    assert loaded.negative_slope.weak_type
    x = -jnp.arange(4.0, dtype=jnp.bfloat16)
    assert loaded(x).dtype == model(x).dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(loaded(x), np.float32), np.asarray(model(x), np.float32)
    )


class _WithNumpy(eqx.Module):
    w: jax.Array
    table: np.ndarray  # a lookup table kept on the host, 64-bit
    scale: np.generic


def test_a_numpy_leaf_loads_as_numpy_of_its_dtype():
    """A NumPy leaf came back a JAX array, its int64 narrowed to int32 (and a
    float64 to float32, with JAX's truncation warning), where `es.load` and
    Equinox's `tree_deserialise_leaves` keep it NumPy of its dtype. Reference: the
    values given, and PyTorch's `load_state_dict`, which copies into the tensor
    the module holds (its dtype)."""
    model = _WithNumpy(jnp.ones(2), np.arange(3, dtype=np.int64), np.float64(0.5))
    table = np.array([2**40, -3, 7], np.int64)  # beyond int32
    sd = {"w": np.zeros(2, np.float32), "table": table, "scale": np.array(0.25)}
    loaded = es.load_state_dict(model, sd)
    assert type(loaded.table) is np.ndarray and loaded.table.dtype == np.int64
    np.testing.assert_array_equal(loaded.table, table)
    assert type(loaded.scale) is np.float64 and loaded.scale == 0.25
    table[0] = 0  # a copy, not the caller's array
    assert loaded.table[0] == 2**40
    t = torch.nn.Module()
    t.register_buffer("table", torch.zeros(3, dtype=torch.int64))
    t.load_state_dict({"table": torch.from_numpy(sd["table"])})
    assert t.table.dtype == torch.int64  # the module's dtype, as here
    with pytest.raises(TypeError, match=r"Dtype mismatch for `table`.*float32"):
        es.load_state_dict(model, {**sd, "table": np.zeros(3, np.float32)})


class _Scale(eqx.Module):
    scale: es.Buffer

    def __call__(self, x):
        return x * self.scale[...]


def test_a_cell_made_from_a_weak_value_loads_strongly_typed_into_an_abstract_model():
    """A cell holds a strongly typed array, but `eqx.filter_eval_shape` reports one
    built from `jnp.asarray(0.5)` as weak: loading made the abstract model's cell
    weak, so it computed in bfloat16 where the same model loaded concretely
    computes in float32 (JAX's promotion of a strong float32 scalar)."""

    def make():
        return _Scale(es.Buffer(jnp.asarray(0.5)))

    sd = es.state_dict(make())
    x = jnp.ones(2, jnp.bfloat16)
    want = (x.astype(jnp.float32) * np.float32(0.5)).dtype  # JAX's own promotion
    for like in (make(), eqx.filter_eval_shape(make)):
        loaded = es.load_state_dict(like, sd)
        assert not loaded.scale.value.weak_type
        assert loaded(x).dtype == want == jnp.float32


class _NumpyConverted(eqx.Module):
    w: jax.Array
    table: np.ndarray
    scale: np.generic


def test_numpy_leaves_of_a_converted_layer_stay_numpy():
    """The NumPy rule inside converted layers: an `eqx.nn.LSTMCell` whose arrays
    are NumPy (its bias is the sum of PyTorch's two, computed by JAX) came back
    part JAX; a registered conversion that passes an int64 NumPy leaf through was
    refused (its dtype read as JAX's int32). A float64 one, which the
    conversion's JAX arithmetic computes in float32 without 64-bit JAX, is
    refused saying so."""
    cell = eqx.nn.LSTMCell(3, 4, key=jax.random.key(0))
    cell = jax.tree.map(lambda x: np.asarray(x) if eqx.is_array(x) else x, cell)
    torch.manual_seed(0)
    tcell = torch.nn.LSTMCell(3, 4)
    loaded = es.load_state_dict(cell, tcell.state_dict())
    for f in ("weight_ih", "weight_hh", "bias"):
        assert type(getattr(loaded, f)) is np.ndarray, f
        assert getattr(loaded, f).dtype == np.float32, f
    np.testing.assert_array_equal(loaded.weight_ih, tcell.weight_ih.detach().numpy())
    np.testing.assert_allclose(
        loaded.bias, (tcell.bias_ih + tcell.bias_hh).detach().numpy(), rtol=1e-6
    )
    es.register_torch_names(
        _NumpyConverted,
        lambda m: {"w": m.w, "table": m.table, "scale": m.scale},
        lambda m, a: _NumpyConverted(a["w"], a["table"], a["scale"]),
    )
    model = _NumpyConverted(jnp.ones(2), np.arange(3, dtype=np.int64), np.float64(1))
    sd = {"w": np.zeros(2, np.float32), "table": np.array([2**40, 1, 2])}
    loaded = es.load_state_dict(model, {**sd, "scale": np.array(0.25)})
    assert loaded.table.dtype == np.int64 and loaded.table[0] == 2**40
    assert type(loaded.scale) is np.float64 and loaded.scale == 0.25
    wide = jax.tree.map(
        lambda x: np.asarray(x, np.float64) if eqx.is_array(x) else x, cell
    )
    with pytest.raises(ValueError, match=r"float32\[16\] at `\.bias`.*enable 64-bit"):
        es.load_state_dict(wide, es.state_dict(wide))


class _Counted2(eqx.Module):
    w: jax.Array
    count: es.Buffer


def test_an_abstract_cell_that_a_conversion_leaves_out_is_refused():
    """A cell that a registered conversion does not name stayed a
    `jax.ShapeDtypeStruct` in an abstract model, silently (the first step or
    `es.to_refs` then failed inside JAX)."""
    es.register_torch_names(
        _Counted2,
        lambda m: {"w": m.w},
        lambda m, a: eqx.tree_at(lambda x: x.w, m, a["w"]),
    )
    abstract = eqx.filter_eval_shape(
        lambda: {"c": _Counted2(jnp.ones(3), es.Buffer(jnp.int32(0)))}
    )
    with pytest.raises(ValueError, match=r"no PyTorch name.*: c\.count\. Build"):
        es.load_state_dict(abstract, {"c.w": np.zeros(3, np.float32)})


def test_an_abstract_sequential_with_dropout_loads_with_strict_false():
    """PyTorch's `nn.Sequential(Linear, Dropout)` into an abstract Equinox port:
    the Dropout's stream, in no state dict, is seeded from its name, but its
    missing name made the whole `Sequential` come back abstract, silently.
    Reference: PyTorch's weights."""
    key = jax.random.key(0)

    def make():
        return eqx.nn.Sequential(
            [eqx.nn.Linear(3, 4, key=key), es.nn.Dropout(0.5, key=1)]
        )

    torch.manual_seed(0)
    t = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout())
    out, keys = es.load_state_dict(
        eqx.filter_eval_shape(make), t.state_dict(), strict=False
    )
    assert keys.missing_keys == ["1.rng.key"] and keys.unexpected_keys == []
    np.testing.assert_array_equal(out.layers[0].weight, t[0].weight.detach().numpy())
    assert isinstance(out.layers[1].rng.key.value, jax.Array)
    x = np.ones(3, np.float32)
    with torch.no_grad():
        want = t[0](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(
        eqx.nn.inference_mode(out)(x), want, rtol=1e-6, atol=1e-6
    )


class _NumpyScalar(eqx.Module):
    x: Any


class _Level(enum.IntEnum):
    HIGH = 7


@pytest.mark.parametrize(
    "leaf,from_torch,error",
    [
        (np.int64(2**40 + 1), lambda a: jnp.asarray(a) + 0, r"int32\[\].*64-bit"),
        (np.float64(0.5), lambda a: jnp.asarray(a) * 1, r"float32\[\].*64-bit"),
        (np.int8(1), lambda a: 300, r"returned 300 at `\.x`.*int8"),
        (np.float32(1), lambda a: np.ones(3, np.float32), r"float32\[3\] at `\.x`"),
        (np.array(0.0, np.float64), lambda a: 0.1, None),
        (np.int64(0), lambda a: 2**40 + 1, None),
        (np.int16(0), lambda a: _Level.HIGH, None),
        (np.int16(0), lambda a: True, r"returned True at `\.x`.*int16"),
    ],
    ids=[
        "int64-jax",
        "float64-jax",
        "int8-300",
        "shape",
        "float-exact",
        "int-exact",
        "intenum",
        "bool-for-int",
    ],
)
def test_what_a_conversion_returns_for_a_numpy_scalar_is_checked(
    leaf, from_torch, error
):
    """A NumPy scalar leaf of a converted layer skipped the check of what
    `from_torch` returns: a value JAX computed in 32 bits, a Python number out of
    the leaf's range or an array of another shape were cast into the leaf's
    dtype, silently wrong. A Python number that the leaf's dtype holds loads as
    it, exactly (JAX's 32-bit reading of it was refused). Only a 64-bit leaf
    narrowed to JAX's 32-bit type gets the 64-bit hint."""
    es.register_torch_names(
        _NumpyScalar,
        lambda m: {"x": m.x},
        lambda m, a: _NumpyScalar(from_torch(a["x"])),
    )
    model = _NumpyScalar(leaf)
    sd = {"x": np.asarray(leaf)}
    if error is not None:
        with pytest.raises(ValueError, match=error):
            es.load_state_dict(model, sd)
        return
    loaded = es.load_state_dict(model, sd)
    assert type(loaded.x) is type(leaf) and loaded.x.dtype == leaf.dtype
    assert loaded.x == np.asarray(from_torch(None), leaf.dtype)


def test_an_unnamed_cell_in_a_sequential_is_named_once():
    """A converted layer's unnamed cell nested in an `eqx.nn.Sequential` (itself
    converted) was reported twice, once under its field path
    (`0.count, layers.0.count`)."""
    es.register_torch_names(
        _Counted2,
        lambda m: {"w": m.w},
        lambda m, a: eqx.tree_at(lambda x: x.w, m, a["w"]),
    )
    abstract = eqx.filter_eval_shape(
        lambda: eqx.nn.Sequential([_Counted2(jnp.ones(3), es.Buffer(jnp.int32(0)))])
    )
    with pytest.raises(ValueError, match=r"a value: 0\.count\. Build"):
        es.load_state_dict(abstract, {"0.w": np.zeros(3, np.float32)})
    deeper = eqx.filter_eval_shape(
        lambda: eqx.nn.Sequential(
            [
                eqx.nn.Lambda(jnp.tanh),
                eqx.nn.Sequential([_Counted2(jnp.ones(3), es.Buffer(jnp.int32(0)))]),
            ]
        )
    )
    with pytest.raises(ValueError, match=r"a value: 1\.0\.count\. Build"):
        es.load_state_dict(deeper, {"1.0.w": np.zeros(3, np.float32)})


def test_a_load_inside_jit_loads_or_is_refused_by_name():
    """Inside `jax.jit` a load that reads a traced value (a count checked, an
    integer's range, a value placed as a concrete model's array) failed with JAX's
    tracer errors (`TracerArrayConversionError`, or a `ConcretizationTypeError`
    about `committed`), naming nothing; it is refused now, as `es.state_dict`
    refuses a tracer, naming the entry or leaf. A traced model (a jit argument)
    loaded from a concrete state dict, counts included, loads: the same values
    as outside (it failed on the count's check). Reference: the eager load."""
    model = Net(jax.random.key(0))
    sd = es.state_dict(Net(jax.random.key(1)))
    want = es.state_dict(es.load_state_dict(model, sd))
    got = es.state_dict(eqx.filter_jit(lambda m: es.load_state_dict(m, sd))(model))
    assert got.keys() == want.keys()
    for k, v in want.items():
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v))
    with pytest.raises(es.CheckpointError, match=r"value for `.*`: it is a tracer"):
        jax.jit(lambda: es.state_dict(es.load_state_dict(model, sd)))()
    with pytest.raises(es.CheckpointError, match=r"Load outside transformed code"):
        jax.jit(lambda s: es.load_state_dict(model, s))(
            {k: jnp.asarray(v) for k, v in sd.items()}
        )
