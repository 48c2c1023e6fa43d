"""Every example script runs (at a tiny size) and prints what its docstring promises."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compiles import count_compiles
from _scripts import ROOT, load_script


def load(name):
    return load_script("examples", name)


def test_counter_prints_1_2_3_in_both_modes(capsys):
    load("counter").main([])
    assert (
        capsys.readouterr().out.split() == "value mode: 1 2 3 ref mode: 1 2 3".split()
    )


def _hand_threaded_regression(steps):
    """The tutorial's update, threaded by hand (pure JAX, no optax)."""

    def loss_fn(params, x, y):
        return jnp.mean((params["w"] * x + params["b"] - y) ** 2)

    @jax.jit
    def update(params, opt_state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        opt_state = jax.tree.map(lambda m, g: 0.9 * m + g, opt_state, grads)
        params = jax.tree.map(lambda p, m: p - 0.1 * m, params, opt_state)
        return params, opt_state

    params = {"w": jnp.float32(1.0), "b": jnp.float32(0.0)}
    opt_state = jax.tree.map(jnp.zeros_like, params)
    x, y = jnp.array([1.0, 2.0, 3.0]), jnp.array([3.0, 5.0, 7.0])
    for _ in range(steps):
        params, opt_state = update(params, opt_state, x, y)
    return params


def test_linear_regression_matches_the_hand_threaded_loop(capsys):
    example = load("linear_regression")
    example.main([])
    out = capsys.readouterr().out
    assert "{'b': 1.0, 'w': 2.0}" in out and "steps taken: 100" in out
    ref = _hand_threaded_regression(100)
    for ref_mode in (False, True):
        model = example.train(100, ref_mode=ref_mode)
        np.testing.assert_allclose(model.w, ref["w"], atol=1e-6)
        np.testing.assert_allclose(model.b, ref["b"], atol=1e-6)
        assert int(model.steps.value) == 100


def test_running_max_user_layer(capsys):
    load("running_max").main(["--batches", "3"])
    lines = capsys.readouterr().out.strip().splitlines()
    values = [line.split(":", 1)[1].strip() for line in lines]
    assert values[0] == values[1] == values[2]


def test_user_layer_in_make_step_both_modes():
    import equinox as eqx

    import eqx_state as es

    RunningMax = load("running_max").RunningMax

    class Net(eqx.Module):
        lin: eqx.nn.Linear
        peak: RunningMax

        def __call__(self, x):
            return self.peak(jax.vmap(self.lin)(x))

    xs = jax.random.normal(jax.random.key(0), (4, 5, 3))
    for ref_mode in (False, True):
        model = Net(eqx.nn.Linear(3, 2, key=jax.random.key(1)), RunningMax(2))
        if ref_mode:
            model = es.to_refs(model)
        step = es.make_step(
            lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.01), donate=False
        )
        opt_state = step.init(model)
        expected = np.full(2, -np.inf)
        for x in xs:
            expected = np.maximum(expected, np.max(jax.vmap(model.lin)(x), axis=0))
            model, opt_state = step(model, opt_state, x)
        np.testing.assert_allclose(model.peak.peak[...], expected, rtol=1e-6)
        # evaluation writes nothing
        ev = eqx.nn.inference_mode(model)
        ev(100.0 + xs[0])
        np.testing.assert_allclose(model.peak.peak[...], expected, rtol=1e-6)


def test_train_digits_tiny(tmp_path, capsys):
    """The headline example at a tiny size: metrics, EMA evaluation, checkpoint, plot."""
    from sklearn.metrics import accuracy_score

    import eqx_state as es

    example = load("train_digits")
    with count_compiles("jit(eqx_state_step") as compiles:
        result = example.main(
            ["--epochs", "2", "--train-size", "256", "--quiet", "--out", str(tmp_path)]
        )
    history, trainer = result["history"], result["trainer"]
    assert all(len(v) == 2 for v in history.values())
    # traced once and compiled once by XLA (the metrics' reset every epoch made
    # them committed where the rest was not: two more compilations)
    assert result["step"].trace_count == 1
    assert len(compiles) == 1, compiles
    # the reported test accuracy is sklearn's accuracy of the EMA model's predictions
    x_te, y_te = result["test"]
    preds = np.asarray(
        example.predict(trainer.ema.averaged(trainer.net), jnp.asarray(x_te))
    )
    assert history["test_accuracy_ema"][-1] == accuracy_score(y_te, preds)
    # the last epoch's training metrics saw all of its 4 batches of 64 images
    assert float(trainer.accuracy.total[...]) == 256
    # the checkpoint restores the trainer and optimizer state exactly
    like = (
        example.Trainer(jax.random.key(1)),
        result["step"].init(example.Trainer(jax.random.key(1))),
    )
    loaded, _ = es.load(tmp_path / "digits.eqxs", like=like)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(trainer)):
        if isinstance(a, jax.Array) and jax.dtypes.issubdtype(
            a.dtype, jax.dtypes.prng_key
        ):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (tmp_path / "digits_training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "test accuracy with EMA weights" in capsys.readouterr().out


@pytest.mark.slow
def test_ensemble_vmap_tiny(capsys):
    example = load("ensemble_vmap")
    result = example.main(["--members", "3", "--steps", "5", "--batch-size", "16"])
    ens = result["ensemble"]
    assert ens.lin1.weight.shape[0] == 3
    assert np.asarray(ens.bn.num_batches_tracked[...]).tolist() == [5, 5, 5]
    # members are independent models: different weights and statistics
    rm = np.asarray(ens.bn.running_mean[...])
    assert not np.allclose(rm[0], rm[1])
    # the reported accuracies are those of each member's own predictions
    x_te, y_te = result["test"]
    import equinox as eqx

    for j in range(3):
        member = jax.tree.map(lambda a, j=j: a[j] if eqx.is_array(a) else a, ens)
        preds = np.asarray(
            jnp.argmax(eqx.nn.inference_mode(member)(jnp.asarray(x_te)), -1)
        )
        np.testing.assert_allclose(result["member_acc"][j], np.mean(preds == y_te))
    assert "ensemble (mean probabilities) test accuracy" in capsys.readouterr().out


@pytest.mark.slow  # the headline without --scan: test_train_digits_tiny
def test_train_digits_scan_tiny(capsys):
    """K steps per call (`step.scan`) trains the headline model exactly as K calls of
    the step: the example's own check (weights, statistics, EMA, metrics, optimizer
    state) passes, and it reports the time per step of both loops."""
    example = load("train_digits_scan")
    result = example.main(
        ["--epochs", "2", "--train-size", "192", "--batch-size", "32"]
        + ["--steps-per-call", "3"]
    )
    assert result["steps"] == 6
    assert result["max_abs_difference"] < 1e-3
    assert "faster" in capsys.readouterr().out


@pytest.mark.slow
def test_train_digits_scan_is_exact_in_float64(tmp_path):
    """In float64 the two loops agree to round-off of float64: the float32 difference
    is XLA's fusion, not a different computation."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_ENABLE_X64="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_digits_scan.py")]
        + ["--epochs", "2", "--train-size", "128", "--batch-size", "32"]
        + ["--steps-per-call", "2", "--float64"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "agree to" in proc.stdout
