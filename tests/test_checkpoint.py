"""Checkpoints: round trips in both modes, bit-exact resume in a fresh process, and
clear errors for missing, corrupt, mismatched or malicious files."""

import os
import pickle
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_state as es


class Net(eqx.Module):
    lin: eqx.nn.Linear
    bn: es.nn.BatchNorm
    steps: es.nn.Counter
    key: es.RngState

    def __init__(self, seed=0):
        self.lin = eqx.nn.Linear(3, 4, key=jax.random.key(seed))
        self.bn = es.nn.BatchNorm(4)
        self.steps = es.nn.Counter()
        self.key = es.RngState(jax.random.key(seed + 1))

    def __call__(self, x):
        self.steps.increment()
        k1, k2 = jax.random.split(self.key[...])
        self.key[...] = k1
        noise = 0.01 * jax.random.normal(k2, x.shape)
        return self.bn(jax.vmap(self.lin)(x + noise))


def loss_fn(model, x):
    return jnp.mean(model(x) ** 2)


def _same(a, b):
    la, lb = jax.tree.leaves(es.freeze(a)), jax.tree.leaves(es.freeze(b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(
            x.dtype, jax.dtypes.prng_key
        ):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if isinstance(x, jax.Array):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.weak_type == y.weak_type
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            assert x == y


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_round_trip(tmp_path, mode):
    model = Net()
    if mode == "ref":
        model = es.to_refs(model)
    step = es.make_step(loss_fn, optax.adam(1e-2))
    opt_state = step.init(model)
    x = jnp.arange(12.0).reshape(4, 3)
    model, opt_state = step(model, opt_state, x)
    path = tmp_path / "ckpt.eqxs"
    es.save(path, (model, opt_state))
    like = (Net(seed=7), step.init(Net(seed=7)))
    if mode == "ref":
        like = (es.to_refs(like[0]), like[1])
    loaded = es.load(path, like=like)
    _same(loaded, (model, opt_state))
    if mode == "ref":
        assert isinstance(loaded[0].bn.running_mean.value, jax.Ref)
        assert loaded[0].bn.running_mean.value is not model.bn.running_mean.value
    # the loaded state resumes without recompiling
    m2, s2 = step(*loaded, x)
    assert step.trace_count == 1
    assert int(m2.steps.value) == 2


def test_one_cell_at_two_places_saves_two_values(tmp_path):
    cell = es.Buffer(jnp.ones(2))

    class Two(eqx.Module):
        a: es.Buffer
        b: es.Buffer

    model = es.to_refs(Two(cell, cell))  # one ref per place
    model.a[...] = jnp.full(2, 3.0)
    es.save(tmp_path / "t", model)
    loaded = es.load(tmp_path / "t", like=model)
    assert loaded.a.value is not loaded.b.value
    np.testing.assert_array_equal(loaded.a[...], [3.0, 3.0])
    np.testing.assert_array_equal(loaded.b[...], [1.0, 1.0])


RESUME = textwrap.dedent(
    """
    import sys, optax
    sys.path.insert(0, {tests!r})
    import eqx_state as es
    from test_checkpoint import Net, loss_fn, data, train
    mode, src, dst = sys.argv[1:]
    step = es.make_step(loss_fn, optax.adam(1e-2))
    like = Net()
    like = (es.to_refs(like) if mode == "ref" else like, step.init(Net()))
    model, opt_state = es.load(src, like=like)
    es.save(dst, train(step, model, opt_state, 4, 10))
    """
)


def data():
    return jax.random.normal(jax.random.key(42), (10, 4, 3))


def train(step, model, opt_state, start, stop):
    xs = data()
    for i in range(start, stop):
        model, opt_state = step(model, opt_state, xs[i])
    return model, opt_state


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_bit_exact_resume_in_a_fresh_process(tmp_path, mode):
    """N steps straight == k steps, save, load in a new process, N - k steps: params,
    optimizer state, BN statistics, counter and RNG key, bit for bit."""
    script = tmp_path / "resume.py"
    script.write_text(RESUME.format(tests=os.path.dirname(__file__)))

    def fresh():
        model = Net()
        return es.to_refs(model) if mode == "ref" else model

    step = es.make_step(loss_fn, optax.adam(1e-2))
    model = fresh()
    straight = train(step, model, step.init(model), 0, 10)
    model = fresh()
    es.save(tmp_path / "part1", train(step, model, step.init(model), 0, 4))
    subprocess.run(
        [
            sys.executable,
            str(script),
            mode,
            str(tmp_path / "part1"),
            str(tmp_path / "resumed"),
        ],
        check=True,
    )
    resumed = es.load(tmp_path / "resumed", like=(Net(), step.init(Net())))
    _same(straight, resumed)
    assert int(resumed[0].steps.value) == 10


def test_missing_file(tmp_path):
    with pytest.raises(es.CheckpointError, match="No checkpoint at"):
        es.load(tmp_path / "nope", like=Net())


def test_truncated_and_corrupt_files(tmp_path):
    path = tmp_path / "c"
    es.save(path, Net())
    blob = path.read_bytes()
    path.write_bytes(blob[:-5])
    with pytest.raises(es.CheckpointError, match="truncated or corrupt"):
        es.load(path, like=Net())
    flipped = bytearray(blob)
    flipped[-3] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(es.CheckpointError, match="do not match the checksum"):
        es.load(path, like=Net())
    path.write_bytes(blob[:30])
    with pytest.raises(es.CheckpointError, match="truncated or corrupt"):
        es.load(path, like=Net())


def test_mismatched_structure_shape_dtype(tmp_path):
    path = tmp_path / "c"
    es.save(path, Net())

    class Other(eqx.Module):
        lin: eqx.nn.Linear

    with pytest.raises(es.CheckpointError, match=r"holds an array at \.bn"):
        es.load(path, like=Other(eqx.nn.Linear(3, 4, key=jax.random.key(0))))
    wide = eqx.tree_at(lambda m: m.bn, Net(), es.nn.BatchNorm(5))
    with pytest.raises(
        es.CheckpointError, match=r"At \.bn\.weight .* float32\(4,\) .* float32\(5,\)"
    ):
        es.load(path, like=wide)
    half = eqx.tree_at(lambda m: m.lin.weight, Net(), jnp.zeros((4, 3), jnp.float16))
    with pytest.raises(
        es.CheckpointError, match=r"At \.lin\.weight .* expects float16"
    ):
        es.load(path, like=half)
    es.save(path, {"a": jnp.zeros(2)})
    with pytest.raises(es.CheckpointError, match=r"has no array at \['b'\]"):
        es.load(path, like={"a": jnp.zeros(2), "b": jnp.zeros(2)})


def test_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c"
    es.save(path, Net())
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        es.save(path, Net(seed=3))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["c"]  # no temporary file left behind


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = "/tmp/eqx_state_pickle_ran"


def test_pickle_payload_is_never_executed(tmp_path):
    if os.path.exists(MARKER):
        os.unlink(MARKER)
    path = tmp_path / "evil"
    path.write_bytes(pickle.dumps({"weights": _Payload()}))
    with pytest.raises(es.CheckpointError, match="not an eqx_state checkpoint"):
        es.load(path, like=Net())
    # a payload hidden after a valid magic is only ever parsed as JSON
    path.write_bytes(
        b"EQXSTATE"
        + (1).to_bytes(4, "little")
        + (40).to_bytes(8, "little")
        + pickle.dumps(_Payload())
    )
    with pytest.raises(es.CheckpointError):
        es.load(path, like=Net())
    assert not os.path.exists(MARKER)
