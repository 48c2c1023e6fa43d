"""es.nn.Batched: a one-example Equinox layer mapped over the batch, mixed with the
batched es.nn.BatchNorm in eqx.nn.Sequential, trained like PyTorch."""

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


# The `make_step` docstring example, corrected (proposed to the lead for
# eqx_state/_step.py): the one-example Linears are wrapped in `es.nn.Batched`, and
# the batch is not eight equal rows (BatchNorm would map it to 0, and the first
# Linear would get no gradient).
MAKE_STEP_EXAMPLE = """
import equinox as eqx, jax, jax.numpy as jnp, optax
import eqx_state as es

k1, k2 = jax.random.split(jax.random.key(0))
model = eqx.nn.Sequential([es.nn.Batched(eqx.nn.Linear(2, 4, key=k1)),
                           es.nn.BatchNorm(4), eqx.nn.Lambda(jax.nn.relu),
                           es.nn.Batched(eqx.nn.Linear(4, 1, key=k2))])

def loss_fn(model, x, y):
    return jnp.mean((model(x)[:, 0] - y) ** 2)

step = es.make_step(loss_fn, optax.adam(1e-2))
opt_state = step.init(model)
x, y = jax.random.normal(jax.random.key(1), (8, 2)), jnp.zeros(8)
model, opt_state = step(model, opt_state, x, y)
"""


def test_corrected_make_step_example_runs_and_trains_every_layer():
    ns: dict = {}
    exec(MAKE_STEP_EXAMPLE, ns)
    k1, k2 = jax.random.split(jax.random.key(0))
    before = eqx.nn.Linear(2, 4, key=k1).weight
    model = ns["model"]
    assert not np.array_equal(model.layers[0].layer.weight, before)  # trained
    assert int(model.layers[1].num_batches_tracked[...]) == 1


def test_params_are_visible_unlike_lambda_of_vmap():
    lin = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    assert len(jax.tree_util.tree_leaves(es.params(es.nn.Batched(lin)))) == 2
    # what the issue ran into: the vmapped function hides the Linear from filters
    # (Equinox warns about a transformed function stored in a module)
    with pytest.warns(UserWarning, match="JAX-transformed callable"):
        hidden = eqx.nn.Lambda(jax.vmap(lin))
    assert jax.tree_util.tree_leaves(es.params(hidden)) == []


def test_equals_vmap_and_batch_dims():
    lin = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 5, 3))
    np.testing.assert_array_equal(es.nn.Batched(lin)(x[0]), jax.vmap(lin)(x[0]))
    np.testing.assert_allclose(
        es.nn.Batched(lin, batch_dims=2)(x),
        jax.vmap(jax.vmap(lin))(x),
        rtol=1e-5,
        atol=1e-6,
    )
    # gradients flow into the wrapped layer as through vmap
    g1 = jax.grad(lambda m: jnp.sum(es.nn.Batched(m)(x[0]) ** 2))(lin)
    g2 = jax.grad(lambda m: jnp.sum(jax.vmap(m)(x[0]) ** 2))(lin)
    np.testing.assert_allclose(g1.weight, g2.weight, rtol=1e-6)


def test_keys_are_split_per_example():
    drop = es.nn.Batched(eqx.nn.Dropout(0.5))
    x = jnp.ones((6, 100))
    y = drop(x, key=jax.random.key(0))
    keys = jax.random.split(jax.random.key(0), 6)  # the reference: one key each
    ref = jax.vmap(lambda xi, k: eqx.nn.Dropout(0.5)(xi, key=k))(x, keys)
    np.testing.assert_array_equal(y, ref)
    assert not np.array_equal(y[0], y[1])
    # and eqx.nn.inference_mode reaches the wrapped layer
    np.testing.assert_array_equal(eqx.nn.inference_mode(drop)(x), x)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_sequential_with_batchnorm_trains_like_torch(mode):
    torch.manual_seed(0)
    tnet = torch.nn.Sequential(
        torch.nn.Linear(3, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 2),
    )
    k1, k2 = jax.random.split(jax.random.key(0))
    model = eqx.nn.Sequential(
        [
            es.nn.Batched(eqx.nn.Linear(3, 8, key=k1)),
            es.nn.BatchNorm(8),
            eqx.nn.Lambda(jax.nn.relu),
            es.nn.Batched(eqx.nn.Linear(8, 2, key=k2)),
        ]
    )
    assert list(es.state_dict(model)) == list(tnet.state_dict())  # `0.weight`, ...
    model = es.load_state_dict(model, tnet.state_dict())
    if mode == "ref":
        model = es.to_refs(model)

    def loss_fn(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    step = es.make_step(loss_fn, optax.sgd(0.1, momentum=0.9))
    opt_state = step.init(model)
    topt = torch.optim.SGD(tnet.parameters(), lr=0.1, momentum=0.9)
    rng = np.random.default_rng(0)
    for _ in range(4):
        x = rng.normal(size=(16, 3)).astype(np.float32)
        y = rng.integers(0, 2, size=16)
        topt.zero_grad()
        torch.nn.functional.cross_entropy(
            tnet(torch.from_numpy(x)), torch.from_numpy(y)
        ).backward()
        topt.step()
        model, opt_state = step(model, opt_state, jnp.asarray(x), jnp.asarray(y))
    sd, t_sd = es.state_dict(model), tnet.state_dict()
    for k in sd:
        np.testing.assert_allclose(
            sd[k], t_sd[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k
        )


def test_bad_input_and_bad_arguments():
    lin = es.nn.Batched(eqx.nn.Linear(3, 2, key=jax.random.key(0)), batch_dims=2)
    with pytest.raises(ValueError, match=r"2 leading batch axis.*\(3,\).*x\[None\]"):
        lin(jnp.ones(3))
    with pytest.raises(ValueError, match="batch_dims must be >= 1"):
        es.nn.Batched(eqx.nn.Identity(), batch_dims=0)
    with pytest.raises(TypeError, match="callable"):
        es.nn.Batched(3)


def test_empty_batch():
    lin = es.nn.Batched(eqx.nn.Linear(3, 2, key=jax.random.key(0)))
    assert lin(jnp.ones((0, 3))).shape == (0, 2)


def test_docstring_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", es.nn.Batched.__doc__, re.S)
    assert blocks
    for block in blocks:
        exec(textwrap.dedent(block), {})
    out = capsys.readouterr().out
    assert "(8, 1)" in out and "1" in out.split()
