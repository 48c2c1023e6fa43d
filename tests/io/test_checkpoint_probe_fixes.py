"""Leaves that every persistence path (`es.save`, `es.to_orbax`,
`es.serialise_filter_spec`) used to drop without a word, the advice for Python ints
beyond 64 bits, the x64 message of the Orbax path, and the name of a file object
made by `os.fdopen`. Found by an adversarial probe."""

import decimal
import enum
import fractions
import io
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_state as es


class Color(enum.IntEnum):
    RED = 1
    BLUE = 2


def round_trip(tree, like):
    buffer = io.BytesIO()
    es.save(buffer, tree)
    buffer.seek(0)
    return es.load(buffer, like=like)


def refused_save(tree):
    """The error `es.save` raised, after checking it wrote nothing."""
    buffer = io.BytesIO()
    with pytest.raises(es.CheckpointError) as info:
        es.save(buffer, tree)
    assert buffer.getvalue() == b""  # refused before any byte was written
    return str(info.value)


def refused_serialise(tmp_path, tree):
    """The error `es.serialise_filter_spec` raised (below Equinox's wrapping)."""
    with pytest.raises(RuntimeError, match="Error at leaf") as info:
        eqx.tree_serialise_leaves(
            tmp_path / "m.eqx", tree, filter_spec=es.serialise_filter_spec
        )
    e = info.value
    while e.__cause__ is not None:
        e = e.__cause__
    assert isinstance(e, es.CheckpointError)
    return str(e)


def make():
    return {"w": jnp.ones(3), "bn": es.nn.BatchNorm(3)}


# ------------------------------------------------------------------------------------
# 1. Abstract leaves (`jax.ShapeDtypeStruct`) hold no values: refused by every path.


def test_save_refuses_an_abstract_model_naming_the_leaf():
    message = refused_save(eqx.filter_eval_shape(make))
    assert "['bn'].weight" in message  # the first leaf, in flattening order
    assert "ShapeDtypeStruct" in message and "float32[3]" in message


def test_save_refuses_one_abstract_leaf_among_concrete_ones():
    tree = {"a": jnp.arange(2.0), "b": jax.ShapeDtypeStruct((4,), jnp.int32)}
    message = refused_save(tree)
    assert "['b']" in message and "int32[4]" in message


def test_to_orbax_refuses_an_abstract_leaf_instead_of_none():
    tree = {"a": jnp.arange(2.0), "b": jax.ShapeDtypeStruct((4,), jnp.int32)}
    with pytest.raises(es.CheckpointError, match=r"\['b'\].*ShapeDtypeStruct"):
        es.to_orbax(tree)


def test_serialise_filter_spec_refuses_an_abstract_leaf(tmp_path):
    tree = {"a": jnp.arange(2.0), "b": jax.ShapeDtypeStruct((4,), jnp.int32)}
    assert "ShapeDtypeStruct" in refused_serialise(tmp_path, tree)


def test_an_abstract_like_still_loads_a_concrete_checkpoint():
    saved = make()
    got = round_trip(saved, eqx.filter_eval_shape(make))
    np.testing.assert_array_equal(np.asarray(got["w"]), np.ones(3, np.float32))


# ------------------------------------------------------------------------------------
# 2. Data the format does not hold: refused, with the fix; an IntEnum is saved.


def test_masked_array_is_refused_with_the_fix():
    ma = np.ma.masked_array([1.0, 2.0, 3.0], mask=[0, 1, 0])
    message = refused_save({"x": ma})
    assert "['x']" in message and "masked array" in message
    assert "np.ma.getmaskarray" in message


def test_the_fix_for_a_masked_array_keeps_its_mask():
    ma = np.ma.masked_array([1.0, 2.0, 3.0], mask=[0, 1, 0])
    tree = {"data": ma.data, "mask": np.ma.getmaskarray(ma)}
    like = {"data": np.zeros(3), "mask": np.zeros(3, bool)}
    got = round_trip(tree, like)
    back = np.ma.masked_array(got["data"], mask=got["mask"])
    assert back.mask.tolist() == [False, True, False]
    assert back.compressed().tolist() == [1.0, 3.0]


def test_torch_tensor_is_refused_with_the_conversion():
    torch = pytest.importorskip("torch")
    message = refused_save({"x": torch.ones(3) * 7})
    assert "['x']" in message and "torch.Tensor" in message
    assert "jnp.asarray(t.detach().cpu().numpy())" in message


def test_the_fix_for_a_torch_tensor_keeps_its_values():
    torch = pytest.importorskip("torch")
    t = torch.tensor([7.0, -1.5, 2.25])
    got = round_trip({"x": jnp.asarray(t.detach().cpu().numpy())}, {"x": jnp.zeros(3)})
    assert np.asarray(got["x"]).tolist() == [7.0, -1.5, 2.25]


class _ForeignArray:
    """An array of some other library: NumPy's array protocol, nothing else."""

    def __array__(self, dtype=None, copy=None):
        return np.arange(3.0)


def test_an_array_of_another_library_is_refused():
    message = refused_save({"x": _ForeignArray()})
    assert "['x']" in message and "_ForeignArray" in message
    assert "np.asarray(x)" in message


@pytest.mark.parametrize(
    "value", [fractions.Fraction(1, 3), decimal.Decimal("1.5")], ids=type
)
def test_other_python_numbers_are_refused(value):
    message = refused_save({"x": value})
    assert "['x']" in message and type(value).__name__ in message
    assert "float(x)" in message


def test_odd_leaves_are_refused_by_to_orbax_and_the_filter_spec(tmp_path):
    ma = np.ma.masked_array([1.0, 2.0], mask=[0, 1])
    for leaf in (ma, fractions.Fraction(1, 3), _ForeignArray()):
        with pytest.raises(es.CheckpointError, match=r"leaf at \['x'\]"):
            es.to_orbax({"x": leaf})
        refused_serialise(tmp_path, {"x": leaf})


def test_an_int_enum_is_saved_as_its_value_and_restored_as_the_enum():
    got = round_trip({"x": Color.BLUE}, {"x": Color.RED})["x"]
    assert type(got) is Color and got is Color.BLUE
    plain = round_trip({"x": Color.BLUE}, {"x": 0})["x"]  # an int: its value
    assert type(plain) is int and plain == 2
    into_enum = round_trip({"x": 1}, {"x": Color.BLUE})["x"]
    assert into_enum is Color.RED


def test_an_int_enum_value_the_like_enum_lacks_is_refused():
    with pytest.raises(es.CheckpointError, match=r"\['x'\].*Color"):
        round_trip({"x": 7}, {"x": Color.RED})


def test_an_int_enum_round_trips_through_the_filter_specs(tmp_path):
    path = tmp_path / "e.eqx"
    eqx.tree_serialise_leaves(
        path, {"x": Color.BLUE}, filter_spec=es.serialise_filter_spec
    )
    got = eqx.tree_deserialise_leaves(
        path, {"x": Color.RED}, filter_spec=es.deserialise_filter_spec
    )["x"]
    assert got is Color.BLUE


def test_an_int_enum_value_the_like_enum_lacks_is_refused_by_the_filter_specs_too(
    tmp_path,
):
    """The same rule as `es.load`'s (one home: `_python_leaf`): a `CheckpointError`
    naming the enum, under Equinox's error that names the leaf's path; the plain
    numbers still load as Equinox loads them."""
    path = tmp_path / "e.eqx"
    saved = {"x": 7, "f": 0.5, "b": True, "i": 2**40}
    eqx.tree_serialise_leaves(path, saved, filter_spec=es.serialise_filter_spec)
    like = {"x": Color.RED, "f": 0.0, "b": False, "i": 0}
    with pytest.raises(Exception, match="'x'") as caught:
        eqx.tree_deserialise_leaves(path, like, filter_spec=es.deserialise_filter_spec)
    causes, e = [], caught.value
    while e is not None:
        causes.append(e)
        e = e.__cause__
    (ours,) = [c for c in causes if isinstance(c, es.CheckpointError)]
    assert "Color" in str(ours)
    like["x"] = 0
    got = eqx.tree_deserialise_leaves(
        path, like, filter_spec=es.deserialise_filter_spec
    )
    reference = eqx.tree_deserialise_leaves(path, like)  # Equinox's own reader
    assert got == reference == saved
    assert {k: type(v) for k, v in got.items()} == {
        k: type(v) for k, v in saved.items()
    }


def test_an_int_enum_round_trips_through_orbax(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = {"x": Color.BLUE, "w": jnp.arange(3.0)}
    like = {"x": Color.RED, "w": jnp.zeros(3)}
    assert es.to_orbax(tree)["x"] == 2 and type(es.to_orbax(tree)["x"]) is int
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(0, args=ocp.args.StandardSave(es.to_orbax(tree)))
        mngr.wait_until_finished()
        target = es.orbax_target(like, mngr.item_metadata(0))
        restored = mngr.restore(0, args=ocp.args.StandardRestore(target))
    got = es.from_orbax(restored, like)
    assert got["x"] is Color.BLUE
    assert np.asarray(got["w"]).tolist() == [0.0, 1.0, 2.0]


def test_documented_unsaved_leaves_still_come_from_like():
    def f(x):
        return x

    def g(x):
        return -x

    tree = {"s": "saved", "f": f, "n": None, "e": enum.Enum("E", "A B").B, "v": 3}
    like = {"s": "like", "f": g, "n": None, "e": "other", "v": 0}
    got = round_trip(tree, like)
    assert got["s"] == "like" and got["f"] is g and got["n"] is None
    assert got["e"] == "other" and got["v"] == 3


# ------------------------------------------------------------------------------------
# 3. Python ints beyond 64 bits: the advice keeps the value.


def test_the_advice_for_a_huge_int_keeps_its_value():
    big = 2**64 + 5
    message = refused_save({"x": big})
    assert "['x']" in message and str(big) in message
    assert "as a string" not in message  # strings are never saved
    assert "to_bytes(16, 'little', signed=True)" in message
    for x in (big, -(2**100) - 3):  # the advice, followed
        a = np.frombuffer(x.to_bytes(16, "little", signed=True), np.uint8)
        got = round_trip({"x": a}, {"x": np.zeros(16, np.uint8)})["x"]
        assert int.from_bytes(got.tobytes(), "little", signed=True) == x


# ------------------------------------------------------------------------------------
# 4. A 64-bit checkpoint restored without x64: every path names the switch.


def test_load_names_x64_for_an_abstract_64_bit_like(tmp_path):
    path = tmp_path / "x64.eqxs"
    with jax.enable_x64(True):
        es.save(path, {"w": jnp.asarray([0.1, 1 + 1e-12], jnp.float64)})
    assert not jax.config.jax_enable_x64
    like = {"w": jax.ShapeDtypeStruct((2,), jnp.float64)}
    with pytest.raises(es.CheckpointError, match=r"\['w'\].*64-bit types on.*x64"):
        es.load(path, like=like)


def test_orbax_target_names_x64_for_an_abstract_64_bit_like(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    with jax.enable_x64(True):
        tree = {"w": jnp.asarray([0.1, 1 + 1e-12], jnp.float64)}
        with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
            mngr.save(0, args=ocp.args.StandardSave(es.to_orbax(tree)))
            mngr.wait_until_finished()
    assert not jax.config.jax_enable_x64
    with ocp.CheckpointManager(
        tmp_path / "ckpt", item_handlers=ocp.StandardCheckpointHandler()
    ) as mngr:
        meta = mngr.item_metadata(0)
    for like in (
        {"w": jax.ShapeDtypeStruct((2,), jnp.float64)},  # the probe's abstract like
        {"w": jnp.zeros(2)},  # float32: what a model built without x64 holds
    ):
        with pytest.raises(es.CheckpointError, match=r"\['w'\].*64-bit types on.*x64"):
            es.orbax_target(like, meta)


def test_from_orbax_names_x64_for_a_32_bit_restore_of_a_64_bit_like():
    like = {"w": jax.ShapeDtypeStruct((2,), jnp.float64)}
    restored = {"w": jnp.zeros(2, jnp.float32)}  # what Orbax restores without x64
    with pytest.raises(es.CheckpointError, match=r"\['w'\].*64-bit types on.*x64"):
        es.from_orbax(restored, like)


# ------------------------------------------------------------------------------------
# 5. A file object named by its descriptor.


def test_a_file_object_on_a_descriptor_is_named_as_such():
    r, w = os.pipe()
    with os.fdopen(w, "wb") as f:
        es.save(f, {"a": jnp.ones(2)})
    with os.fdopen(r, "rb") as f:
        got = es.load(f, like={"a": jnp.zeros(2)})
        assert np.asarray(got["a"]).tolist() == [1.0, 1.0]
        with pytest.raises(es.CheckpointError) as info:
            es.load(f, like={"a": jnp.zeros(2)})
    message = str(info.value)
    assert f"file descriptor {r}" in message
    assert not message.startswith(f"{r} ")
    assert "not an eqx_state checkpoint" in message
