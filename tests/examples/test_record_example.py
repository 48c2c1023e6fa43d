"""examples/diagnose_training.py at a tiny size: the per-step, per-layer curves it
plots equal float64 NumPy statistics of the activations of a recorder-free training
run (hand-threaded SGD with `jax.grad`), and it diagnoses the bad runs."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _scripts import load_script


def _reference_history(example, init_std, lr, x, y, order, depth, width, seed):
    """The healthy run without eqx_state: the plain forward pass returns the
    activations, SGD is threaded by hand; the statistics are NumPy's."""
    model = example.MLP(jax.random.key(seed), depth, width, init_std=init_std)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(params, x, y):
        m = eqx.combine(params, static)
        h = m.hidden(x)[-1]
        logits = jax.vmap(m.head)(h)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def update(params, x, y):
        g = jax.grad(loss)(params, x, y)
        return jax.tree.map(lambda p, g: p - lr * g, params, g)

    hidden = jax.jit(lambda p, x: eqx.combine(p, static).hidden(x))
    std, dead = [], []
    for idx in order:
        acts = [np.asarray(a, np.float64) for a in hidden(params, x[idx])]
        std.append([a.std() for a in acts])
        dead.append([np.mean(np.all(a <= 0, axis=0)) for a in acts])
        params = update(params, x[idx], y[idx])
    return np.array(std), np.array(dead)


@pytest.mark.slow  # ~13 s; Record itself: tests/nn/test_record.py
def test_diagnose_training_tiny(tmp_path, capsys):
    example = load_script("examples", "diagnose_training")
    result = example.main(["--tiny", "--out", str(tmp_path)])
    runs = result["runs"]
    assert len(runs) == 3
    healthy, bad_init, bad_lr = runs.values()
    for run in runs.values():
        h = run["history"]
        assert len(h["loss"]) == 20
        assert np.asarray(h["std"]).shape == np.asarray(h["dead_fraction"]).shape
        assert np.asarray(h["std"]).shape == (20, 8)
    # the curves are the statistics of the activations each step saw
    x, y = result["data"]
    std, dead = _reference_history(
        example, None, 0.05, x, y, result["order"], depth=8, width=64, seed=2
    )
    np.testing.assert_allclose(healthy["history"]["std"], std, rtol=2e-4)
    np.testing.assert_allclose(healthy["history"]["dead_fraction"], dead, atol=1e-6)
    # what each run shows
    assert healthy["diagnosis"] is None
    assert bad_init["diagnosis"].startswith("the signal vanishes with depth")
    assert np.mean(bad_init["history"]["loss"]) > 2.25  # ln 10: nothing learnt
    assert healthy["history"]["loss"][-1] < 2.0
    # too large a rate kills many units within a few steps (the exact step and
    # layer are chaotic; the full run's diagnosis is in docs/diagnostics.md)
    last = slice(-5, None)
    assert np.mean(bad_lr["history"]["dead_fraction"][last]) > 0.4
    assert np.mean(healthy["history"]["dead_fraction"][last]) < 0.2
    png = (tmp_path / "diagnose_training.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "healthy: He init, lr 0.05" in out and "plot:" in out
    # evaluation with recording off matches the plain forward pass
    model = healthy["model"]
    logits = eqx.nn.inference_mode(model)(jnp.asarray(x[:5]))
    want = jax.vmap(model.head)(model.hidden(jnp.asarray(x[:5]))[-1])
    np.testing.assert_array_equal(logits, want)
