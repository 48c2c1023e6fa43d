"""`es.save` / `es.load`: round trips in both modes, exact types, abstract `like`, file
objects, ordinary file behaviour, bit-exact resume in a fresh process, and clear
errors for missing, mismatched or unsaveable input. (Corrupt and malformed files:
tests/test_checkpoint_integrity.py.)"""

import gc
import inspect
import io
import os
import pickle
import signal
import stat
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _checkpoint_helpers import (
    assert_exact,
    assert_tree_exact,
    child_env,
    consumed_ref_mode_model,
)

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


def _in_mode(model, mode):
    return es.to_refs(model) if mode == "ref" else model


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_round_trip(tmp_path, mode):
    model = _in_mode(Net(), mode)
    step = es.make_step(loss_fn, optax.adam(1e-2))
    opt_state = step.init(model)
    x = jnp.arange(12.0).reshape(4, 3)
    model, opt_state = step(model, opt_state, x)
    path = tmp_path / "ckpt.eqxs"
    es.save(path, (model, opt_state))
    like = (_in_mode(Net(seed=7), mode), step.init(Net(seed=7)))
    loaded = es.load(path, like=like)
    assert_tree_exact(loaded, (model, opt_state))
    if mode == "ref":
        assert isinstance(loaded[0].bn.running_mean.value, jax.Ref)
        assert loaded[0].bn.running_mean.value is not model.bn.running_mean.value
    # the loaded state resumes without recompiling
    m2, s2 = step(*loaded, x)
    assert step.trace_count == 1
    assert int(m2.steps.value) == 2


def test_load_changes_storage_mode_as_like_says(tmp_path):
    model = es.to_refs(Net())
    es.save(tmp_path / "c", model)
    value = es.load(tmp_path / "c", like=Net(seed=3))
    assert not any(isinstance(x, jax.Ref) for x in jax.tree.leaves(value))
    assert_tree_exact(value, es.freeze(model))


def test_two_positions_holding_one_array_are_two_values(tmp_path):
    """Arrays are values: a checkpoint never ties positions by object identity."""

    class Two(eqx.Module):
        a: es.Buffer
        b: es.Buffer

    array = jnp.array([1.0, 2.0])
    model = Two(es.Buffer(array), es.Buffer(array))
    es.save(tmp_path / "t", model)
    loaded = es.load(tmp_path / "t", like=model)
    assert loaded.a.value is not loaded.b.value
    assert_exact(loaded.a.value, model.a.value)
    assert_exact(loaded.b.value, model.b.value)
    refs = es.load(
        tmp_path / "t",
        like=es.to_refs(Two(es.Buffer(jnp.zeros(2)), es.Buffer(jnp.zeros(2)))),
    )
    assert refs.a.value is not refs.b.value
    refs.a.value[...] = jnp.array([5.0, 5.0])
    np.testing.assert_array_equal(refs.b.value[...], [1.0, 2.0])


def test_declared_sharing_round_trips(tmp_path):
    """Sharing declared with `eqx.nn.Shared` is part of the structure: it survives."""
    lin = eqx.nn.Linear(2, 2, key=jax.random.key(0))
    shared = eqx.nn.Shared((lin, lin), lambda m: m[1].weight, lambda m: m[0].weight)
    es.save(tmp_path / "s", shared)
    like = eqx.nn.Shared(
        (eqx.nn.Linear(2, 2, key=jax.random.key(5)),) * 2,
        lambda m: m[1].weight,
        lambda m: m[0].weight,
    )
    loaded = es.load(tmp_path / "s", like=like)
    a, b = loaded()
    np.testing.assert_array_equal(a.weight, lin.weight)
    np.testing.assert_array_equal(b.weight, lin.weight)


class TwoCounters(eqx.Module):
    a: es.nn.Counter
    b: es.nn.Counter


def test_one_ref_at_two_places_is_refused(tmp_path):
    """As `es.freeze` and `es.apply` refuse it: the file would hold the one state
    twice and load it back as two."""
    counter = es.to_refs(es.nn.Counter())
    model = TwoCounters(counter, counter)
    with pytest.raises(es.CheckpointError) as info:
        es.save(tmp_path / "c", model)
    message = str(info.value)
    assert message.startswith("`es.save` refuses a tree that holds one ref at two")
    assert (
        "`model.a.count` and `model.b.count`" in message and "eqx.nn.Shared" in message
    )
    assert isinstance(info.value, es.StateError)  # what docs/misuse.md promises
    assert isinstance(info.value.__cause__, es.StateError)
    assert not (tmp_path / "c").exists()
    # each place with its own ref saves and loads as two states
    model = es.to_refs(TwoCounters(es.nn.Counter(), es.nn.Counter()))
    model.a.increment()
    es.save(tmp_path / "c", model)
    loaded = es.load(tmp_path / "c", like=model)
    assert (int(loaded.a.count[...]), int(loaded.b.count[...])) == (1, 0)


# --------------------------------------------------------------------------------------
# Exact types: every leaf comes back as it was saved.

KEY_DATA = np.array([0, 42], np.uint32)

LEAVES = {
    "np_int64": np.array([2**40 + 3, -(2**62)], np.int64),
    "np_uint64": np.array([2**63 + 5], np.uint64),
    "np_float64": np.array([1 / 3, np.pi, 1e-310], np.float64),
    "np_float32_special": np.array([np.nan, -0.0, np.inf, -np.inf], np.float32),
    "np_nan_payload": np.array([0x7FC00001, 0xFFC12345], np.uint32).view(np.float32),
    "np_bool": np.array([True, False, True]),
    "np_uint8": np.arange(250, 256, dtype=np.uint8),
    "np_int8": np.array([-128, 127], np.int8),
    "np_float16": np.array([65504.0, 6e-8], np.float16),
    "np_bfloat16": np.array([1.0, 3.0e38, -0.0], jnp.bfloat16),
    "np_complex128": np.array([1 + 2j, np.nan * 1j]),
    "np_empty": np.zeros((0, 3), np.float32),
    "np_0d": np.array(7, np.int16),
    "np_fortran": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
    "np_scalar_float64": np.float64(1 / 3),
    "np_scalar_int64": np.int64(2**40 + 3),
    "np_scalar_uint64": np.uint64(2**64 - 1),
    "np_scalar_bool": np.bool_(True),
    "np_scalar_uint8": np.uint8(255),
    "np_scalar_bfloat16": jnp.bfloat16(2.5),
    "py_bool": True,
    "py_int": -(2**62),
    "py_float": 0.1,
    "py_nan": float("nan"),
    "py_complex": 1 - 2j,
    "jax_float32": jnp.array([1.0, -0.0, jnp.nan]),
    "jax_bool": jnp.array([True, False]),
    "jax_uint8": jnp.arange(3, dtype=jnp.uint8),
    "jax_int32": jnp.array([2**31 - 1, -(2**31)], jnp.int32),
    "jax_bfloat16": jnp.array([1.5, -3.0], jnp.bfloat16),
    "jax_float16": jnp.array([1.5], jnp.float16),
    "jax_complex64": jnp.array([1 + 1j], jnp.complex64),
    "jax_weak_scalar": jnp.asarray(1.5),
    "jax_weak_int": jnp.asarray(3),
    "jax_weak_array": jax.lax.full((2, 2), 0.5),
    "jax_strong_scalar": jnp.asarray(1.5, jnp.float32),
    "typed_key": jax.random.key(3),
    "typed_keys": jax.random.split(jax.random.key(4), 3),
    "rbg_key": jax.random.key(5, impl="rbg"),
    "raw_key": jax.random.PRNGKey(6),
}


@pytest.mark.parametrize("name", sorted(LEAVES))
def test_every_leaf_type_round_trips_exactly(tmp_path, name):
    leaf = LEAVES[name]
    tree = {"leaf": leaf, "other": jnp.ones(2)}
    es.save(tmp_path / "c", tree)
    assert_tree_exact(es.load(tmp_path / "c", like=tree), tree)


def test_big_endian_numpy_comes_back_in_native_byte_order(tmp_path):
    tree = {"x": np.array([1.5, -2.25], ">f8")}
    es.save(tmp_path / "c", tree)
    x = es.load(tmp_path / "c", like=tree)["x"]
    assert x.dtype == np.dtype("<f8")  # the file is little-endian; so is this host
    np.testing.assert_array_equal(x, [1.5, -2.25])


def test_sixty_four_bit_numpy_is_not_downcast(tmp_path):
    """JAX runs with x64 off here: NumPy 64-bit leaves must not pass through JAX."""
    assert not jax.config.jax_enable_x64
    tree = [np.array([2**40 + 3]), np.float64(0.1), np.array([2**64 - 1], np.uint64)]
    es.save(tmp_path / "c", tree)
    a, b, c = es.load(tmp_path / "c", like=tree)
    assert a.dtype == np.int64 and int(a[0]) == 2**40 + 3
    assert type(b) is np.float64 and b == 0.1
    assert c.dtype == np.uint64 and int(c[0]) == 2**64 - 1


def test_all_leaf_types_in_one_ref_mode_model(tmp_path):
    class Holder(eqx.Module):
        leaves: dict
        rng: es.RngState
        raw: es.RngState
        count: es.CounterState

    model = es.to_refs(
        Holder(
            dict(LEAVES),
            es.RngState(jax.random.key(9)),
            es.RngState(jax.random.PRNGKey(9)),
            es.CounterState(jnp.array(3, jnp.int32)),
        )
    )
    es.save(tmp_path / "c", model)
    assert_tree_exact(es.load(tmp_path / "c", like=model), model)


def test_key_kind_must_match_like(tmp_path):
    es.save(tmp_path / "c", {"k": jax.random.key(0)})
    with pytest.raises(
        es.CheckpointError, match=r"\['k'\] .* typed PRNG key .* uint32\(2,\)"
    ):
        es.load(tmp_path / "c", like={"k": jax.random.PRNGKey(0)})
    with pytest.raises(es.CheckpointError, match=r"\['k'\] .* typed PRNG key"):
        es.load(tmp_path / "c", like={"k": jax.random.key(0, impl="rbg")})
    es.save(tmp_path / "c", {"k": jax.random.PRNGKey(0)})
    with pytest.raises(
        es.CheckpointError, match=r"\['k'\] .* uint32\(2,\) .* key<fry>"
    ):
        es.load(tmp_path / "c", like={"k": jax.random.key(0)})


def test_array_kind_must_match_like(tmp_path):
    es.save(tmp_path / "c", {"x": np.zeros(2, np.float32)})
    with pytest.raises(
        es.CheckpointError,
        match=r"\['x'\] .* a NumPy array but `like` holds a JAX array",
    ):
        es.load(tmp_path / "c", like={"x": jnp.zeros(2)})
    es.save(tmp_path / "c", {"x": 1})
    with pytest.raises(
        es.CheckpointError, match=r"Python int but `like` holds a float"
    ):
        es.load(tmp_path / "c", like={"x": 1.0})
    es.save(tmp_path / "c", {"x": np.float32(1)})
    with pytest.raises(
        es.CheckpointError, match=r"NumPy scalar but `like` holds a NumPy array"
    ):
        es.load(tmp_path / "c", like={"x": np.zeros(1, np.float32)})
    with pytest.raises(
        es.CheckpointError, match=r"NumPy scalar but `like` holds a JAX array"
    ):
        es.load(tmp_path / "c", like={"x": jnp.zeros((), np.float32)})


@pytest.mark.parametrize(
    "leaf, what",
    [
        (np.array(["a", "bc"]), "<U2"),
        (np.array([object()], dtype=object), "object"),
        (np.zeros(2, dtype=[("a", "f4")]), "a"),
        (np.array(["2020-01-01"], dtype="datetime64[D]"), "datetime64"),
        (np.str_("x"), "<U1"),
        (2**64, "does not fit in 64 bits"),
    ],
)
def test_save_refuses_what_load_cannot_restore(tmp_path, leaf, what):
    with pytest.raises(es.CheckpointError, match=rf"leaf at \['bad'\].*{what}"):
        es.save(tmp_path / "c", {"ok": jnp.ones(1), "bad": leaf})
    assert not (tmp_path / "c").exists()


@pytest.mark.skipif(
    np.dtype(np.longdouble).itemsize == 8, reason="longdouble is float64 here"
)
@pytest.mark.parametrize(
    "dtype, fix", [(np.longdouble, "float64"), (np.clongdouble, "complex128")]
)
def test_extended_precision_is_refused_as_such(tmp_path, dtype, fix):
    leaf = np.array([1 / 3], dtype)
    with pytest.raises(es.CheckpointError) as info:
        es.save(tmp_path / "c", {"ok": jnp.ones(1), "bad": leaf})
    message = str(info.value)
    assert message.startswith(
        f"Cannot save the leaf at ['bad']: it is an array of dtype {leaf.dtype}, "
        "NumPy's extended precision"
    )
    assert f"x.astype(np.{fix})" in message and "not numbers" not in message
    assert not (tmp_path / "c").exists()
    # the fix it names saves and loads the rounded value bit for bit
    es.save(tmp_path / "c", {"x": leaf.astype(fix)})
    got = es.load(tmp_path / "c", like={"x": np.zeros(1, fix)})["x"]
    assert got.dtype == np.dtype(fix)
    assert got.tobytes() == leaf.astype(fix).tobytes()


def test_a_tree_that_is_one_leaf_is_named_the_root(tmp_path):
    """Messages name a leaf by its path; a tree that is one leaf has the empty path
    ("At  the checkpoint ..." read as a typo): they call it the root."""
    with pytest.raises(es.CheckpointError, match=r"^Cannot save the leaf at the root"):
        es.save(tmp_path / "s", np.array(["a"]))
    es.save(tmp_path / "c", jnp.ones(3))
    with pytest.raises(es.CheckpointError, match=r"^At the root \(the tree is one"):
        es.load(tmp_path / "c", like=jnp.ones(4))
    es.save(tmp_path / "d", {"a": jnp.ones(3)})
    with pytest.raises(es.CheckpointError, match=r"has no array at the root"):
        es.load(tmp_path / "d", like=jnp.ones(3))


def test_save_inside_jit_is_refused(tmp_path):
    @jax.jit
    def f(x):
        es.save(tmp_path / "c", {"x": x})
        return x

    with pytest.raises(es.CheckpointError, match=r"\['x'\]: it is a tracer"):
        f(jnp.ones(2))


def test_saving_a_model_consumed_by_a_donating_step(tmp_path):
    model = Net()
    step = es.make_step(loss_fn, optax.sgd(1e-2))
    opt_state = step.init(model)
    new_model, _ = step(model, opt_state, jnp.ones((4, 3)))
    with pytest.raises(es.StaleModelError, match=r"donate=False"):
        es.save(tmp_path / "c", model)
    assert not (tmp_path / "c").exists()
    es.save(tmp_path / "c", new_model)  # the returned model saves fine


def test_saving_a_ref_mode_model_whose_buffers_a_failed_call_consumed(tmp_path):
    """JAX donates ref arguments to a jitted call, even one that then fails."""
    model = consumed_ref_mode_model()
    with pytest.raises(es.StaleModelError, match=r"\.value .*donated and deleted"):
        es.save(tmp_path / "c", model)


def test_python_values_that_are_not_numbers_come_from_like(tmp_path):
    tree = {"act": jax.nn.relu, "name": "a", "p": 0.5, "flag": False}
    es.save(tmp_path / "c", tree)
    like = {"act": jax.nn.gelu, "name": "b", "p": 0.0, "flag": True}
    loaded = es.load(tmp_path / "c", like=like)
    assert loaded == {"act": jax.nn.gelu, "name": "b", "p": 0.5, "flag": False}


# --------------------------------------------------------------------------------------
# Load into an abstract model (Equinox's `filter_eval_shape` idiom).


def make(seed):
    return Net(seed), optax.adam(1e-2).init(es.params(Net(seed)))


def test_abstract_like_from_filter_eval_shape(tmp_path):
    model, opt_state = make(0)
    extra = {"np": np.arange(3, dtype=np.int64), "np_scalar": np.float64(0.25)}
    es.save(tmp_path / "c", (model, opt_state, extra))
    abstract = eqx.filter_eval_shape(lambda: (*make(1), extra))
    leaves = [x for x in jax.tree.leaves(abstract) if eqx.is_array(x)]
    assert leaves == []  # nothing was allocated to build `like`
    assert any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    gc.collect()
    live = len(jax.live_arrays())
    loaded = es.load(tmp_path / "c", like=abstract)
    gc.collect()
    n_jax = sum(isinstance(x, jax.Array) for x in jax.tree.leaves(loaded))
    assert len(jax.live_arrays()) == live + n_jax  # one array per leaf, no spares
    # NumPy leaves come back NumPy (the abstract struct does not say which kind)
    assert_tree_exact(loaded, (model, opt_state, extra))
    # and a value-mode abstract model loads into ref mode with `to_refs`
    refs = es.to_refs(loaded[0])
    assert isinstance(refs.bn.running_var.value, jax.Ref)


def test_abstract_like_checks_shapes(tmp_path):
    es.save(tmp_path / "c", Net())
    abstract = eqx.filter_eval_shape(
        lambda: eqx.tree_at(lambda m: m.bn, Net(), es.nn.BatchNorm(5))
    )
    with pytest.raises(
        es.CheckpointError, match=r"At \.bn\.weight .* float32\(4,\) .* float32\(5,\)"
    ):
        es.load(tmp_path / "c", like=abstract)


def test_abstract_like_keeps_its_sharding(tmp_path):
    es.save(tmp_path / "c", {"x": jnp.arange(4.0)})
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[-1])
    like = {"x": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sharding)}
    loaded = es.load(tmp_path / "c", like=like)
    assert loaded["x"].sharding == sharding


# --------------------------------------------------------------------------------------
# Files: file objects, permissions, symlinks, temporary files, atomicity.


def test_file_objects(tmp_path):
    model = es.to_refs(Net())
    buffer = io.BytesIO()
    buffer.write(b"prefix")
    es.save(buffer, model)
    buffer.seek(6)
    assert_tree_exact(es.load(buffer, like=model), model)
    with open(tmp_path / "c", "wb") as f:
        es.save(f, model)
    with open(tmp_path / "c", "rb") as f:
        assert_tree_exact(es.load(f, like=model), model)
    with (
        open(tmp_path / "t", "w") as f,
        pytest.raises(es.CheckpointError, match="'wb'"),
    ):
        es.save(f, model)
    with open(tmp_path / "c") as f, pytest.raises(es.CheckpointError, match="'rb'"):
        es.load(f, like=model)
    # opened for writing: was "Cannot read the checkpoint ...: read"
    with (
        open(tmp_path / "c", "ab") as f,
        pytest.raises(es.CheckpointError, match="not open for reading.*'rb'"),
    ):
        es.load(f, like=model)


def _reads_item_by_item(save, load, a, b, make_stream):
    """Two items saved one after the other into one stream: `load` reads exactly
    one per call. Returns the two items and the stream position after the first."""
    stream = make_stream()
    save(stream, a)
    first_end = stream.tell()
    save(stream, b)
    stream.seek(0)
    got_a = load(stream, a)
    at = stream.tell()
    assert at == first_end
    return got_a, load(stream, b), at


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_a_stream_of_two_checkpoints_reads_one_per_call(tmp_path, mode):
    """As `np.load` and `eqx.tree_deserialise_leaves` on a stream: each call reads
    one item and leaves the stream just after it (the references run first, on
    the same kind of stream)."""
    a, b = _in_mode(Net(0), mode), _in_mode(Net(1), mode)
    # references: NumPy's and Equinox's own stream behaviour
    x, y = np.arange(3.0), np.arange(5)
    load_npy = lambda f, like: np.load(f)  # noqa: E731
    got_x, got_y, _ = _reads_item_by_item(np.save, load_npy, x, y, io.BytesIO)
    np.testing.assert_array_equal(got_x, x)
    np.testing.assert_array_equal(got_y, y)
    ea, eb = Net(0).lin, Net(1).lin  # (Equinox cannot serialise typed keys)
    got_ea, got_eb, _ = _reads_item_by_item(
        eqx.tree_serialise_leaves, eqx.tree_deserialise_leaves, ea, eb, io.BytesIO
    )
    assert np.array_equal(np.asarray(got_ea.weight), np.asarray(ea.weight))
    assert np.array_equal(np.asarray(got_eb.weight), np.asarray(eb.weight))
    # es.save / es.load: the same, into BytesIO and into a real file
    got_a, got_b, at = _reads_item_by_item(
        es.save, lambda f, like: es.load(f, like=like), a, b, io.BytesIO
    )
    single = io.BytesIO()
    es.save(single, a)
    assert at == len(single.getvalue())
    assert_tree_exact(got_a, a)
    assert_tree_exact(got_b, b)
    path = tmp_path / "two.eqxs"
    with open(path, "wb") as f:
        es.save(f, a)
        es.save(f, b)
    with open(path, "rb") as f:
        assert_tree_exact(es.load(f, like=a), a)
        assert_tree_exact(es.load(f, like=b), b)
        assert f.read() == b""
    # from a path, as `np.load(path)`: the first
    assert_tree_exact(es.load(path, like=a), a)
    path.write_bytes(single.getvalue() + b"\0")
    with pytest.raises(es.CheckpointError, match="followed by a byte that starts no"):
        es.load(path, like=a)  # a byte that starts no checkpoint: corrupt


def test_a_stream_of_two_checkpoints_keeps_its_corruption_detection():
    a, b = Net(0), Net(1)
    stream = io.BytesIO()
    es.save(stream, a)
    n = stream.tell()
    es.save(stream, b)
    blob = stream.getvalue()
    bad = bytearray(blob)
    bad[n + len(bad[n:]) // 2] ^= 1  # the second checkpoint's payload
    stream = io.BytesIO(bytes(bad))
    assert_tree_exact(es.load(stream, like=a), a)  # the first is intact
    with pytest.raises(es.CheckpointError, match="do not match the checksum"):
        es.load(stream, like=b)
    bad = bytearray(blob)
    bad[n // 2] ^= 1  # the first's
    with pytest.raises(es.CheckpointError):
        es.load(io.BytesIO(bytes(bad)), like=a)
    with pytest.raises(es.CheckpointError, match="followed by bytes that start no"):
        es.load(io.BytesIO(blob[:n] + b"garbage!" + blob[n:]), like=a)
    with pytest.raises(es.CheckpointError, match="do not match the checksum"):
        es.load(io.BytesIO(blob[: n - 1] + blob[n:]), like=a)  # one byte short


def test_a_pipe_of_two_checkpoints_reads_one_per_call():
    """A stream that cannot seek (a pipe) is read sequentially, one per call."""
    a, b = es.to_refs(Net(0)), Net(1)
    buffer = io.BytesIO()
    es.save(buffer, a)
    es.save(buffer, b)
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "wb") as w:
        w.write(buffer.getvalue())  # small: fits in the pipe's buffer
    with os.fdopen(read_fd, "rb") as r:
        assert not r.seekable()
        assert_tree_exact(es.load(r, like=a), a)
        assert_tree_exact(es.load(r, like=b), b)
        assert r.read() == b""


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(old)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_files_follow_the_umask(tmp_path, umask, mask, mode):
    umask(mask)
    es.save(tmp_path / "c", Net())
    assert stat.S_IMODE(os.stat(tmp_path / "c").st_mode) == mode


def test_overwriting_keeps_the_mode(tmp_path, umask):
    umask(0o077)
    path = tmp_path / "c"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    es.save(path, Net())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert_tree_exact(es.load(path, like=Net(3)), Net())


def test_symlink_is_written_through(tmp_path):
    target = tmp_path / "real" / "ckpt.eqxs"
    target.parent.mkdir()
    es.save(target, Net(seed=1))
    os.chmod(target, 0o640)
    link = tmp_path / "latest"
    link.symlink_to(target)
    es.save(link, Net(seed=2))
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert_tree_exact(es.load(target, like=Net()), Net(seed=2))
    assert_tree_exact(es.load(link, like=Net()), Net(seed=2))
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640
    assert sorted(os.listdir(target.parent)) == ["ckpt.eqxs"]  # the temp was there


def test_saving_to_a_directory_is_refused(tmp_path):
    with pytest.raises(es.CheckpointError, match="is a directory"):
        es.save(tmp_path, Net())
    with pytest.raises(es.CheckpointError, match="Cannot read the checkpoint"):
        es.load(tmp_path, like=Net())


def test_saving_into_a_missing_folder_names_it(tmp_path):
    target = tmp_path / "no" / "such" / "c.eqxs"
    with pytest.raises(es.CheckpointError) as info:
        es.save(target, Net())
    message = str(info.value)
    assert message.startswith(f"Cannot save to {str(target)!r}: the folder ")
    assert f"os.makedirs({str(target.parent)!r}, exist_ok=True)" in message
    assert "eqxs-tmp" not in message  # no internal temporary file named
    os.makedirs(target.parent)
    es.save(target, Net())  # the fix it names
    assert_tree_exact(es.load(target, like=Net(seed=3)), Net())


def test_a_folder_that_refuses_new_files_is_named(tmp_path, monkeypatch):
    real_open = os.open

    def denied(path, flags, *args):
        if flags & os.O_CREAT:  # as in a read-only folder (root may write anyway)
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(es.CheckpointError) as info:
        es.save(tmp_path / "c", Net())
    assert str(info.value).startswith(
        f"Cannot save to {str(tmp_path / 'c')!r}: no file can be created in "
        f"{str(tmp_path)!r} (Permission denied)"
    )
    assert type(info.value.__cause__) is PermissionError


# The suite's jaxtyping/beartype import hook checks `path_or_file`'s annotation before
# the function runs (a `TypeCheckError`); what a user sees is the function's own
# error, so these call the function the hook wraps.
save_unchecked = inspect.unwrap(es.save)
load_unchecked = inspect.unwrap(es.load)


@pytest.mark.parametrize(
    "target, got",
    [(None, "was given None"), (3, "object of type int"), (b"c.eqxs", "6 bytes")],
)
def test_save_refuses_what_is_not_a_path_or_a_file(target, got):
    with pytest.raises(es.CheckpointError) as info:
        save_unchecked(target, Net())
    message = str(info.value)
    assert message.startswith("`es.save` needs a path") and got in message
    assert "open(path, 'wb')" in message


def test_save_refuses_a_file_object_not_open_for_writing(tmp_path):
    (tmp_path / "c").write_bytes(b"")
    with open(tmp_path / "c", "rb") as f:
        with pytest.raises(es.CheckpointError, match=r"not open for writing.*'wb'"):
            es.save(f, Net())
    f = open(tmp_path / "d", "wb")
    f.close()
    with pytest.raises(es.CheckpointError, match=r"closed file") as info:
        es.save(f, Net())
    assert isinstance(info.value.__cause__, ValueError)


def test_a_failed_write_to_a_file_object_keeps_the_cause():
    class Full(io.RawIOBase):
        def writable(self):
            return True

        def write(self, data):
            raise OSError(28, "No space left on device")

    with pytest.raises(es.CheckpointError, match=r"writing failed") as info:
        es.save(Full(), Net())
    assert isinstance(info.value.__cause__, OSError)


def test_load_refuses_what_is_not_a_path_or_a_file():
    with pytest.raises(es.CheckpointError, match=r"was given None"):
        load_unchecked(None, like=Net())
    # the bytes of a checkpoint: not taken for a path, not printed
    buffer = io.BytesIO()
    es.save(buffer, Net())
    data = buffer.getvalue()
    with pytest.raises(es.CheckpointError) as info:
        load_unchecked(data, like=Net())
    message = str(info.value)
    assert f"was given {len(data)} bytes" in message
    assert "es.load(io.BytesIO(data), like=...)" in message
    assert "EQXSTATE" not in message and len(message) < 400
    assert_tree_exact(es.load(io.BytesIO(data), like=Net(seed=3)), Net())


def test_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c"
    es.save(path, Net())
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(es.CheckpointError, match="writing failed .disk full") as info:
        es.save(path, Net(seed=3))
    assert str(info.value).startswith(f"Cannot save to {str(path)!r}")
    assert type(info.value.__cause__) is OSError
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["c"]  # no temporary file left behind


KILLED_SAVE = textwrap.dedent(
    """
    import os, sys, time
    import jax.numpy as jnp
    import eqx_state as es

    def stall(fd):
        print("writing", flush=True)
        time.sleep(60)

    os.fsync = stall
    es.save(sys.argv[1], {"x": jnp.arange(3.0)})
    """
)


def test_a_killed_save_leaves_the_old_file_and_its_temp_is_cleaned(tmp_path):
    path = tmp_path / "c"
    es.save(path, {"x": jnp.zeros(3)})
    before = path.read_bytes()
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SAVE)
    child = subprocess.Popen(
        [sys.executable, str(script), str(path)],
        stdout=subprocess.PIPE,
        env=child_env(),
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "writing\n"
        # while the save runs, another save of the same target leaves its temp alone
        temps = [n for n in os.listdir(tmp_path) if n.endswith(".eqxs-tmp")]
        assert len(temps) == 1 and temps[0].startswith(".c.")
        es.save(path, {"x": jnp.ones(3)})
        assert temps[0] in os.listdir(tmp_path)
        before = path.read_bytes()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()  # type: ignore[union-attr]
    assert path.read_bytes() == before  # the killed save changed nothing
    assert temps[0] in os.listdir(tmp_path)  # ... but left its temp file
    es.save(tmp_path / "other", {"x": jnp.ones(3)})  # another target: not touched
    assert temps[0] in os.listdir(tmp_path)
    es.save(path, {"x": jnp.full(3, 2.0)})  # the next save of `c` removes it
    assert sorted(os.listdir(tmp_path)) == ["c", "killed.py", "other"]
    np.testing.assert_array_equal(
        es.load(path, like={"x": jnp.zeros(3)})["x"], [2.0] * 3
    )


# --------------------------------------------------------------------------------------
# Resume in a fresh process.

RESUME = textwrap.dedent(
    """
    import sys, optax
    sys.path[:0] = [{tests!r}, {tests!r} + "/io"]  # shared helpers; this file
    import eqx_state as es
    from test_checkpoint import Net, loss_fn, train
    folder = sys.argv[1]
    step = es.make_step(loss_fn, optax.adam(1e-2))
    for mode in ("value", "ref"):
        like = Net()
        like = (es.to_refs(like) if mode == "ref" else like, step.init(Net()))
        model, opt_state = es.load(f"{{folder}}/part1-{{mode}}", like=like)
        es.save(f"{{folder}}/resumed-{{mode}}", train(step, model, opt_state, 4, 10))
    """
)


def data():
    return jax.random.normal(jax.random.key(42), (10, 4, 3))


def train(step, model, opt_state, start, stop):
    xs = data()
    for i in range(start, stop):
        model, opt_state = step(model, opt_state, xs[i])
    return model, opt_state


@pytest.mark.slow  # fresh processes; test_orbax resumes in one by default
def test_bit_exact_resume_in_a_fresh_process(tmp_path):
    """N steps straight == k steps, save, load in a new process, N - k steps: params,
    optimizer state, BN statistics, counter and RNG key, bit for bit, in both modes."""
    script = tmp_path / "resume.py"
    script.write_text(
        RESUME.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )
    step = es.make_step(loss_fn, optax.adam(1e-2))
    straight = {}
    for mode in ("value", "ref"):
        model = _in_mode(Net(), mode)
        straight[mode] = train(step, model, step.init(model), 0, 10)
        model = _in_mode(Net(), mode)
        es.save(tmp_path / f"part1-{mode}", train(step, model, step.init(model), 0, 4))
    subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        check=True,
        env=child_env(),
        timeout=300,
    )
    for mode in ("value", "ref"):
        like = (_in_mode(Net(), mode), step.init(Net()))
        resumed = es.load(tmp_path / f"resumed-{mode}", like=like)
        assert_tree_exact(resumed, straight[mode])
        assert int(resumed[0].steps.value) == 10


# --------------------------------------------------------------------------------------
# Missing files and trees that do not match.


def test_missing_file(tmp_path):
    with pytest.raises(es.CheckpointError, match="No checkpoint at"):
        es.load(tmp_path / "nope", like=Net())


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
        + (2).to_bytes(4, "little")
        + (40).to_bytes(8, "little")
        + pickle.dumps(_Payload())
    )
    with pytest.raises(es.CheckpointError):
        es.load(path, like=Net())
    assert not os.path.exists(MARKER)


# Found by an outside review (2026-12-02): the cases below each failed before.


def test_saves_racing_on_one_path_all_land(tmp_path, monkeypatch):
    """A save's stale-temporary cleanup may lock and delete another save's
    temporary file between its creation and its lock. Replayed deterministically:
    another save's cleanup runs just before each save takes its lock. Every save
    must land, and the file must hold the last tree saved (as `torch.save`)."""
    from eqx_state import _checkpoint

    real = _checkpoint.fcntl
    path = tmp_path / "c.eqxs"

    class Racing:
        LOCK_EX, LOCK_NB = real.LOCK_EX, real.LOCK_NB
        raced = 0
        locks = 0

        @staticmethod
        def flock(fd, op):
            Racing.locks += op == real.LOCK_EX
            if op == real.LOCK_EX and Racing.locks % 2:  # before every other lock
                Racing.raced += 1
                _checkpoint._remove_stale_temps(
                    str(tmp_path), _checkpoint._temp_stem(path.name)
                )
            return real.flock(fd, op)

    monkeypatch.setattr(_checkpoint, "fcntl", Racing)
    for seed in range(3):
        es.save(path, Net(seed))
        assert_tree_exact(es.load(path, like=Net()), Net(seed))
    assert Racing.raced >= 3
    assert os.listdir(tmp_path) == ["c.eqxs"]  # no temporary file is left


def test_saves_from_threads_on_one_path_all_land(tmp_path):
    import threading

    path = tmp_path / "c.eqxs"
    trees = [{"a": np.full(4, float(i), np.float32)} for i in range(3)]
    errors = []

    def save_many(tree):
        try:
            for _ in range(40):
                es.save(path, tree)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=save_many, args=(t,)) for t in trees]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:1]
    got = es.load(path, like=trees[0])["a"]
    assert any(np.array_equal(got, t["a"]) for t in trees)
    assert os.listdir(tmp_path) == ["c.eqxs"]


def test_a_target_that_is_not_a_regular_file_is_refused_and_kept(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(es.CheckpointError, match="not a regular file.*file object"):
        es.save(fifo, Net())
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # not replaced by a regular file
    link = tmp_path / "link"
    os.symlink(fifo, link)  # a symlink is written through, to its target
    with pytest.raises(es.CheckpointError, match="not a regular file"):
        es.save(link, Net())
    assert os.path.islink(link) and stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.parametrize("length", [200, 240, 255])
def test_the_longest_file_names_the_system_allows_save(tmp_path, length):
    path = tmp_path / ("é" + "b" * (length - 2))  # 'é' is 2 bytes in UTF-8
    assert len(os.fsencode(path.name)) == length
    with open(path, "wb"):  # the file system takes the name
        pass
    es.save(path, Net(1))
    assert_tree_exact(es.load(path, like=Net()), Net(1))
    assert os.listdir(tmp_path) == [path.name]


def test_a_stream_of_another_format_is_refused_after_its_first_bytes():
    """A `.pt` (a zip) or an endless stream is refused from its first bytes, as
    `np.load` refuses it, not read to its end first."""

    class Endless(io.RawIOBase):
        read_bytes = 0

        def readable(self):
            return True

        def readinto(self, b):
            b[:] = b"PK\x03\x04".ljust(len(b), b"\0")[: len(b)]
            Endless.read_bytes += len(b)
            return len(b)

    with pytest.raises(es.CheckpointError, match="not an eqx_state checkpoint"):
        es.load(Endless(), like=Net())
    assert Endless.read_bytes <= 64


@pytest.mark.parametrize(
    "tail",
    [b"EQXSTATE-garbage-garbage", b"EQXSTATE" + bytes(12), b"\0", b"PK\x03\x04"],
    ids=["the-magic-then-garbage", "version-0", "a-zero-byte", "a-zip"],
)
def test_bytes_after_a_checkpoint_that_start_no_checkpoint_are_corruption(
    tmp_path, tail
):
    single = io.BytesIO()
    es.save(single, Net())
    path = tmp_path / "c.eqxs"
    path.write_bytes(single.getvalue() + tail)
    with pytest.raises(es.CheckpointError, match="followed by (a byte|bytes) that"):
        es.load(path, like=Net())


def test_a_checkpoint_followed_by_a_torn_append_loads_and_the_torn_one_is_refused():
    """A writer killed while appending a second checkpoint to a stream leaves the
    first intact: it loads whatever length of the second was written (as
    `np.load` reads one item), and loading the second reports it."""
    single = io.BytesIO()
    es.save(single, Net(1))
    blob = single.getvalue()
    for n in (1, 7, 8, 10, 12, 19, 20, 40, len(blob) - 1):
        stream = io.BytesIO(blob + blob[:n])
        assert_tree_exact(es.load(stream, like=Net()), Net(1))
        with pytest.raises(es.CheckpointError):
            es.load(stream, like=Net())


def test_a_file_system_without_locks_fails_the_save_cleanly(tmp_path, monkeypatch):
    from eqx_state import _checkpoint

    real = _checkpoint.fcntl

    class NoLocks:
        LOCK_EX, LOCK_NB = real.LOCK_EX, real.LOCK_NB

        @staticmethod
        def flock(fd, op):
            raise OSError(37, "No locks available")

    path = tmp_path / "c.eqxs"
    es.save(path, Net(1))
    monkeypatch.setattr(_checkpoint, "fcntl", NoLocks)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(es.CheckpointError, match="cannot be locked.*file object"):
        es.save(path, Net(2))
    assert len(os.listdir("/proc/self/fd")) == fds  # no descriptor left open
    assert os.listdir(tmp_path) == ["c.eqxs"]  # no temporary file left
    monkeypatch.undo()
    assert_tree_exact(es.load(path, like=Net()), Net(1))  # the old one is intact


@pytest.mark.parametrize("value", [-(2**63), 2**63 - 1, 2**63, 2**64 - 1])
def test_every_64_bit_python_int_round_trips_exactly(value):
    buf = io.BytesIO()
    es.save(buf, {"seed": value})
    buf.seek(0)
    got = es.load(buf, like={"seed": 0})["seed"]
    assert type(got) is int and got == value


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 2**70])
def test_a_python_int_beyond_64_bits_is_refused_by_every_persistence_path(
    tmp_path, value
):
    tree = {"w": jnp.ones(2), "seed": value}
    with pytest.raises(es.CheckpointError, match=r"\['seed'\].*does not fit in 64"):
        es.save(io.BytesIO(), tree)
    with pytest.raises(es.CheckpointError, match=r"\['seed'\].*does not fit in 64"):
        es.to_orbax(tree)
    with pytest.raises(Exception) as info:  # Equinox raises TreePathError from ours
        eqx.tree_serialise_leaves(
            tmp_path / "f.eqx", tree, filter_spec=es.serialise_filter_spec
        )
    cause = info.value
    while cause.__cause__ is not None:
        cause = cause.__cause__
    assert isinstance(cause, es.CheckpointError)
    assert "does not fit in 64" in str(cause)


def test_a_float64_checkpoint_loaded_without_x64_names_the_switch(tmp_path):
    path = tmp_path / "x64.eqxs"
    with jax.enable_x64(True):
        es.save(path, {"w": jnp.ones((2, 2), jnp.float64)})
    assert not jax.config.jax_enable_x64
    with pytest.raises(
        es.CheckpointError, match=r"saved with 64-bit types on.*jax_enable_x64"
    ):
        es.load(path, like={"w": jnp.ones((2, 2))})
    with jax.enable_x64(True):  # the fix it names works
        got = es.load(path, like={"w": jnp.ones((2, 2), jnp.float64)})
        assert got["w"].dtype == np.float64


def test_a_save_whose_temporary_files_keep_vanishing_gives_up_cleanly(
    tmp_path, monkeypatch
):
    """If every temporary file is gone by the time it is locked (a file system
    that does not keep identities), the save stops after a bounded number of tries
    instead of looping, and leaves nothing behind."""
    path = tmp_path / "c.eqxs"
    es.save(path, Net(1))
    monkeypatch.setattr(os.path, "samestat", lambda a, b: False)
    with pytest.raises(es.CheckpointError, match="100 tries"):
        es.save(path, Net(2))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["c.eqxs"]
    assert_tree_exact(es.load(path, like=Net()), Net(1))
