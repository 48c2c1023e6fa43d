"""es.inference_mode: evaluation mode for part of a model, against PyTorch's
`module.eval()` on a submodule (the same training steps, the same statistics)."""

import re
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import eqx_state as es


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU()
        )
        self.head = torch.nn.Sequential(
            torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU()
        )
        self.fc = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(self.head(self.backbone(x)))


def _block(key):
    return eqx.nn.Sequential(
        [
            es.nn.Batched(
                eqx.nn.Linear(4 if key == 0 else 8, 8, key=jax.random.key(key))
            ),
            es.nn.BatchNorm(8),
            eqx.nn.Lambda(jax.nn.relu),
        ]
    )


class Net(eqx.Module):
    backbone: eqx.nn.Sequential
    head: eqx.nn.Sequential
    fc: es.nn.Batched

    def __init__(self):
        self.backbone = _block(0)
        self.head = _block(1)
        self.fc = es.nn.Batched(eqx.nn.Linear(8, 2, key=jax.random.key(2)))

    def __call__(self, x):
        return self.fc(self.head(self.backbone(x)))


def _data(n=5):
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(n, 16, 4)).astype(np.float32) * 2 + 1
    ys = rng.integers(0, 2, size=(n, 16))
    return xs, ys


def _warm_torch():
    """A torch model whose BatchNorm statistics are not the initial ones."""
    torch.manual_seed(0)
    tnet = TorchNet()
    with torch.no_grad():
        for x in _data(3)[0]:
            tnet(torch.from_numpy(x * 3 - 1))
    return tnet


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("select", ["where", "only", "parts"])
def test_frozen_backbone_statistics_train_like_torch(mode, select):
    tnet = _warm_torch()
    model = es.load_state_dict(Net(), tnet.state_dict())
    if select == "where":  # the backbone in evaluation mode
        model = es.inference_mode(model, where=lambda m: m.backbone)
    elif select == "parts":  # several parts, one (`fc`) without any BatchNorm
        parts = lambda m: (m.fc, m.backbone)  # noqa: E731
        model = es.inference_mode(model, where=parts, only=es.nn.BatchNorm)
    else:  # only the backbone's BatchNorm (a predicate on modules)
        bn = model.backbone.layers[1]
        model = es.inference_mode(model, only=lambda m: m is bn)
    assert model.backbone.layers[1].inference and not model.head.layers[1].inference
    if mode == "ref":
        model = es.to_refs(model)
    # the reference: PyTorch's `eval()` on the submodule only
    tnet.train()
    tnet.backbone.eval()
    topt = torch.optim.SGD(tnet.parameters(), lr=0.1, momentum=0.9)
    step = es.make_step(loss_fn, optax.sgd(0.1, momentum=0.9), has_aux=False)
    opt_state = step.init(model)
    frozen = es.state_dict(model)
    for x, y in zip(*_data()):
        topt.zero_grad()
        t_loss = torch.nn.functional.cross_entropy(
            tnet(torch.from_numpy(x)), torch.from_numpy(y)
        )
        t_loss.backward()
        topt.step()
        model, opt_state = step(model, opt_state, jnp.asarray(x), jnp.asarray(y))
    assert step.trace_count == 1  # one compiled variant for the mixed-mode model
    sd, t_sd = es.state_dict(model), tnet.state_dict()
    for k in sd:
        np.testing.assert_allclose(
            sd[k], t_sd[k].numpy(), rtol=2e-5, atol=2e-6, err_msg=k
        )
    # the backbone's statistics did not move; the head's did
    for k in ("running_mean", "running_var", "num_batches_tracked"):
        np.testing.assert_array_equal(sd[f"backbone.1.{k}"], frozen[f"backbone.1.{k}"])
    assert int(sd["head.1.num_batches_tracked"]) == 5 + 3


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_batchnorm_in_eval_while_dropout_stays_active(mode):
    model = eqx.nn.Sequential(
        [
            es.nn.Batched(eqx.nn.Linear(4, 8, key=jax.random.key(0))),
            es.nn.BatchNorm(8),
            eqx.nn.Dropout(0.5),
        ]
    )
    tbn = torch.nn.BatchNorm1d(8).eval()  # the reference: running statistics
    with torch.no_grad():
        tbn.running_mean.normal_()
        tbn.running_var.uniform_(0.5, 2.0)
        tbn.weight.normal_()
    model, _ = es.load_state_dict(
        model, {f"1.{k}": v for k, v in tbn.state_dict().items()}, strict=False
    )
    model = es.inference_mode(model, only=es.nn.BatchNorm)
    assert model.layers[1].inference and not model.layers[2].inference
    if mode == "ref":
        model = es.to_refs(model)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32))
    f = lambda m, x, key: m(x, key=key)  # noqa: E731
    y1, model = es.apply(f, model, x, jax.random.key(1))
    y2, model = es.apply(f, model, x, jax.random.key(2))
    assert int(model.layers[1].num_batches_tracked[...]) == 0  # nothing written
    np.testing.assert_array_equal(
        model.layers[1].running_mean[...], tbn.running_mean.numpy()
    )
    # Dropout is active: half of the entries dropped, differently per key
    assert 0.3 < float(jnp.mean(y1 == 0)) < 0.7
    assert not np.array_equal(np.asarray(y1 == 0), np.asarray(y2 == 0))
    # where kept, the value is BatchNorm-in-eval(x) / (1 - p)
    h = jax.vmap(model.layers[0].layer)(x)
    with torch.no_grad():
        ref = tbn(torch.from_numpy(np.array(h))).numpy() / 0.5
    kept = np.asarray(y1 != 0)
    np.testing.assert_allclose(np.asarray(y1)[kept], ref[kept], rtol=1e-5, atol=1e-6)


def test_value_false_switches_back_and_types_select():
    model = eqx.nn.inference_mode(Net())  # everything in evaluation
    model = es.inference_mode(model, False, where=lambda m: m.head)
    assert model.backbone.layers[1].inference and not model.head.layers[1].inference
    model = es.inference_mode(model, False, only=(es.nn.BatchNorm, eqx.nn.Dropout))
    assert not model.backbone.layers[1].inference
    both = es.inference_mode(Net(), where=lambda m: (m.backbone, m.head))
    assert both.backbone.layers[1].inference and both.head.layers[1].inference


def test_nested_layers_with_inference_fields_are_all_reached():
    class Outer(eqx.Module):
        inner: es.nn.BatchNorm
        inference: bool = False

    model = es.inference_mode([Outer(es.nn.BatchNorm(3))], only=es.nn.BatchNorm)
    assert model[0].inner.inference and not model[0].inference
    model = es.inference_mode([Outer(es.nn.BatchNorm(3))])
    assert model[0].inner.inference and model[0].inference


def test_selecting_nothing_is_an_error():
    with pytest.raises(
        ValueError, match="selected no layer.*eqx_state.nn.BatchNorm|es.nn.BatchNorm"
    ):
        es.inference_mode(Net(), only=eqx.nn.BatchNorm)
    with pytest.raises(ValueError, match="`where`"):
        es.inference_mode(Net(), where=lambda m: m.fc)
    # several parts, none with a match: still an error (one with a match is not)
    with pytest.raises(ValueError, match="`where` and `only` selected no layer"):
        es.inference_mode(
            Net(), where=lambda m: (m.fc, m.head.layers[0]), only=es.nn.BatchNorm
        )
    with pytest.raises(TypeError, match="`only` must be|parameter .only."):  # beartype
        es.inference_mode(Net(), only="BatchNorm")  # pyright: ignore
    # a layer instance where its type was meant: it is callable, so it was called
    # on every layer as a predicate (Dropout: "requires a key"; Linear: a bare
    # TypeError); refused, naming the type to pass
    for layer in (eqx.nn.Dropout(0.5), es.nn.BatchNorm(4)):
        with pytest.raises(TypeError, match=r"layer instance.*only=") as e:
            es.inference_mode(Net(), only=layer)
        assert isinstance(e.value, es.EqxStateError)


class _StaticFlag(eqx.Module):
    """A user's layer whose `inference` is static (part of the structure)."""

    inference: bool = eqx.field(static=True, default=False)


def test_a_static_inference_field_is_refused_by_its_path():
    """A static `inference` is no leaf to switch; the error names it by the path
    every message uses (`model...`), relative to `where`'s part when one is given,
    and nothing is switched (the BatchNorm beside it included)."""
    model = {"a": [_StaticFlag()], "bn": es.nn.BatchNorm(3)}
    with pytest.raises(
        es.EqxStateError, match=r"static.*`model\['a'\]\[0\]\.inference`"
    ):
        es.inference_mode(model)
    with pytest.raises(
        es.EqxStateError,
        match=r"`part\[0\]\.inference` \(`part`: what `where` selects\)",
    ):
        es.inference_mode(model, where=lambda m: m["a"])
    assert model["bn"].inference is False


def test_a_numpy_bool_flag_gives_one_answer_on_every_path():
    """`es.inference_mode(model, flags[i])` with a NumPy array of flags reads the
    NumPy bool as the Python one, so every path runs the same program. A NumPy bool
    put in by other means (Equinox's `inference_mode`) is refused by every path
    alike: eager calls accepted it, compiled ones traced it (an array to
    `eqx.is_array`) and refused it with advice about tree maps."""
    import inspect

    flags = np.array([True, False])
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)

    def runs(model):
        step = es.make_step(
            lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1), return_loss=True
        )
        return {
            "eager ref mode": lambda: es.to_refs(model)(x),
            "es.apply": lambda: es.apply(lambda m, x: m(x), model, x)[0],
            "make_apply": lambda: es.make_apply(lambda m, x: m(x), donate=False)(
                model, x
            )[0],
            "make_step": lambda: step(model, step.init(model), x)[2],
        }

    for flag in flags:
        by_numpy = runs(es.inference_mode(es.nn.BatchNorm(3), flag))
        by_python = runs(es.inference_mode(es.nn.BatchNorm(3), bool(flag)))
        assert es.inference_mode(es.nn.BatchNorm(3), flag).inference is bool(flag)
        got = {name: run() for name, run in by_numpy.items()}  # each model once
        for name, run in by_python.items():
            np.testing.assert_array_equal(got[name], run(), err_msg=name)
        # and the program is the one the flag says (float64 NumPy): evaluation
        # normalises with the initial running statistics (0, 1), training with the
        # batch's (biased variance)
        x64 = np.asarray(x, np.float64)
        mean, var = (0.0, 1.0) if flag else (x64.mean(0), x64.var(0))
        np.testing.assert_allclose(
            got["es.apply"], (x64 - mean) / np.sqrt(var + 1e-5), rtol=1e-5, atol=1e-6
        )
        for run in runs(eqx.nn.inference_mode(es.nn.BatchNorm(3), flag)).values():
            with pytest.raises(TypeError, match=r"NumPy bool.*`bool\(flag\)`"):
                run()
    for bad in (1, jnp.asarray(True), "yes"):  # beartype first, in this suite
        with pytest.raises(TypeError, match="`value` must be a bool"):
            inspect.unwrap(es.inference_mode)(es.nn.BatchNorm(3), bad)


def test_docstring_example_runs(capsys):
    block = re.findall(r"```python\n(.*?)```", es.inference_mode.__doc__, re.S)[-1]
    exec(textwrap.dedent(block), {})
    assert "True False" in capsys.readouterr().out
