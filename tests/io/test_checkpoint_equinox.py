"""Equinox's own serialisation (`eqx.tree_serialise_leaves` / `tree_deserialise_leaves`)
with eqx_state models: what works with Equinox's defaults, what they lose, and
`es.serialise_filter_spec` / `es.deserialise_filter_spec`, which save everything."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _checkpoint_helpers import assert_tree_exact, consumed_ref_mode_model

import eqx_state as es


class Plain(eqx.Module):
    """Parameters and state cells, no PRNG key."""

    lin: eqx.nn.Linear
    bn: es.nn.BatchNorm
    steps: es.nn.Counter
    scale: jax.Array

    def __init__(self, seed=0):
        self.lin = eqx.nn.Linear(3, 4, key=jax.random.key(seed))
        self.bn = es.nn.BatchNorm(4)
        self.steps = es.nn.Counter()
        self.scale = jnp.asarray(2.0)  # weakly typed

    def __call__(self, x):
        self.steps.increment()
        return self.scale * self.bn(jax.vmap(self.lin)(x))


class WithKey(Plain):
    key: es.RngState

    def __init__(self, seed=0):
        super().__init__(seed)
        self.key = es.RngState(jax.random.key(seed + 1))

    def __call__(self, x):
        k1, k2 = jax.random.split(self.key[...])
        self.key[...] = k1
        return super().__call__(x + 0.01 * jax.random.normal(k2, x.shape))


def root_cause(e):
    """Equinox wraps a filter spec's error in `TreePathError`s ("Error at leaf ...")."""
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def refused_save(path, tree):
    """The error `es.serialise_filter_spec` raised saving `tree` (below Equinox's
    `TreePathError`s)."""
    with pytest.raises(RuntimeError, match="Error at leaf") as info:
        eqx.tree_serialise_leaves(path, tree, filter_spec=es.serialise_filter_spec)
    return root_cause(info.value)


def refused_load(path, like):
    """The error `es.deserialise_filter_spec` raised loading into `like`."""
    with pytest.raises(RuntimeError, match="Error at leaf") as info:
        eqx.tree_deserialise_leaves(path, like, filter_spec=es.deserialise_filter_spec)
    return root_cause(info.value)


@functools.cache
def trained(cls, mode):
    model = cls()
    if mode == "ref":
        model = es.to_refs(model)
    # `scale` is not trained: an optimizer would return it strongly typed (as under
    # `eqx.filter_jit`); untouched, it stays weak, so the round trips below
    # exercise a weak type
    step = es.make_step(
        lambda m, x: jnp.mean(m(x) ** 2),
        optax.adam(1e-2),
        trainable=eqx.tree_at(
            lambda m: m.scale, jax.tree.map(lambda _: True, model), False
        ),
    )
    opt_state = step.init(model)
    for i in range(2):
        model, opt_state = step(model, opt_state, jnp.arange(12.0).reshape(4, 3) + i)
    return model


def test_equinox_defaults_round_trip_a_value_mode_model(tmp_path):
    model = trained(Plain, "value")
    assert float(model.bn.running_mean[...][0]) != 0.0 and model.scale.weak_type
    eqx.tree_serialise_leaves(tmp_path / "m.eqx", model)
    loaded = eqx.tree_deserialise_leaves(tmp_path / "m.eqx", Plain(seed=5))
    # exact, except that Equinox's `jnp.load` returns strongly typed arrays
    assert not loaded.scale.weak_type
    loaded = eqx.tree_at(lambda m: m.scale, loaded, jnp.asarray(float(loaded.scale)))
    assert_tree_exact(loaded, model)
    # and into an abstract model, Equinox's own idiom
    abstract = eqx.filter_eval_shape(Plain, 5)
    loaded = eqx.tree_deserialise_leaves(tmp_path / "m.eqx", abstract)
    np.testing.assert_array_equal(loaded.bn.running_var[...], model.bn.running_var[...])


def test_equinox_defaults_skip_ref_mode_state(tmp_path):
    """Pinned so that docs/equinox.md stays true: Equinox's default filter spec writes
    nothing for a `jax.Ref` (it is not an array to Equinox), so a ref-mode model loses
    its state silently with the defaults."""
    model = trained(Plain, "ref")
    eqx.tree_serialise_leaves(tmp_path / "refs.eqx", model)
    without_refs = jax.tree.map(lambda x: None if isinstance(x, jax.Ref) else x, model)
    eqx.tree_serialise_leaves(tmp_path / "no_refs.eqx", without_refs)
    assert (tmp_path / "refs.eqx").read_bytes() == (
        tmp_path / "no_refs.eqx"
    ).read_bytes()
    fresh = es.to_refs(Plain())
    loaded = eqx.tree_deserialise_leaves(tmp_path / "refs.eqx", fresh)
    assert loaded.bn.running_mean.value is fresh.bn.running_mean.value  # not loaded
    assert float(loaded.bn.running_mean[...][0]) == 0.0


def test_equinox_defaults_cannot_write_typed_keys(tmp_path):
    with pytest.raises(RuntimeError, match="Error at leaf") as info:
        eqx.tree_serialise_leaves(tmp_path / "k.eqx", WithKey())
    assert "PRNGKey dtype" in str(root_cause(info.value))


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("cls", [Plain, WithKey])
def test_es_filter_specs_round_trip_exactly(tmp_path, mode, cls):
    model = trained(cls, mode)
    path = tmp_path / "m.eqx"
    eqx.tree_serialise_leaves(path, model, filter_spec=es.serialise_filter_spec)
    like = cls(seed=5)
    like = es.to_refs(like) if mode == "ref" else like
    loaded = eqx.tree_deserialise_leaves(
        path, like, filter_spec=es.deserialise_filter_spec
    )
    assert_tree_exact(loaded, model)  # weak types, typed keys and refs included
    if mode == "ref":
        loaded.steps.increment()  # a new ref: the saved model is not written
        assert int(loaded.steps.value[...]) == int(model.steps.value[...]) + 1


def test_es_filter_specs_write_the_ref_state(tmp_path):
    """With the es filter specs a ref-mode model's state is in the file: every cell's
    bytes, as its frozen (value-mode) copy holds them (Equinox's default writes none
    of them)."""
    model = trained(Plain, "ref")
    eqx.tree_serialise_leaves(
        tmp_path / "a.eqx", model, filter_spec=es.serialise_filter_spec
    )
    eqx.tree_serialise_leaves(tmp_path / "b.eqx", model)  # Equinox's default
    data = (tmp_path / "a.eqx").read_bytes()
    frozen = es.freeze(model)
    for cell in jax.tree.leaves(frozen, is_leaf=es.is_state):
        if es.is_state(cell):
            assert np.asarray(cell[...]).tobytes() in data
            assert (
                np.asarray(cell[...]).tobytes() not in (tmp_path / "b.eqx").read_bytes()
                or not np.asarray(cell[...]).any()
            )


def test_es_filter_specs_refuse_a_consumed_model(tmp_path):
    model = Plain()
    step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(1e-2))
    step(model, step.init(model), jnp.ones((4, 3)))
    cause = refused_save(tmp_path / "m.eqx", model)
    assert isinstance(cause, es.StaleModelError)
    assert "donate=False" in str(cause)


def test_es_filter_specs_reject_a_different_ref_shape(tmp_path):
    eqx.tree_serialise_leaves(
        tmp_path / "m.eqx",
        es.to_refs(es.nn.BatchNorm(3)),
        filter_spec=es.serialise_filter_spec,
    )
    cause = refused_load(tmp_path / "m.eqx", es.to_refs(es.nn.BatchNorm(4)))
    assert isinstance(cause, es.CheckpointError)


@pytest.mark.parametrize(
    "saved, loaded",
    [(jnp.int32, jnp.uint8), (jnp.float32, jnp.float16), (jnp.float32, jnp.int32)],
)
def test_es_filter_specs_reject_a_different_ref_dtype(tmp_path, saved, loaded):
    """A ref-mode `like` of another dtype is refused as Equinox refuses a
    value-mode one (the reference: Equinox's own check, which does not see a ref):
    an int32 count of 300 came back as int32 in a uint8 model."""
    cell = es.Buffer(jnp.full((3,), 300, saved))
    eqx.tree_serialise_leaves(
        tmp_path / "m.eqx", es.to_refs(cell), filter_spec=es.serialise_filter_spec
    )
    like = es.Buffer(jnp.zeros((3,), loaded))
    with pytest.raises(RuntimeError, match="changed dtype"):  # Equinox, value mode
        eqx.tree_deserialise_leaves(
            tmp_path / "m.eqx", like, filter_spec=es.deserialise_filter_spec
        )
    cause = refused_load(tmp_path / "m.eqx", es.to_refs(like))
    assert isinstance(cause, es.CheckpointError)
    assert f"{jnp.dtype(loaded)}[3] was saved as {jnp.dtype(saved)}[3]" in str(cause)


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.int4], ids=str)
def test_es_filter_specs_refuse_a_dtype_numpy_files_cannot_hold(tmp_path, dtype, mode):
    """`np.save`'s format has no float8 or int4 (Equinox reads bfloat16 back
    itself): such a file failed on load, in value mode with Equinox's "changed
    type", in ref mode as "saved from a different model". Refused on save, naming
    `es.save`, which round-trips it bit for bit."""
    cell = es.Buffer(jnp.asarray([1.0, -2.0, 0.5], jnp.float32).astype(dtype))
    model = es.to_refs(cell) if mode == "ref" else cell
    cause = refused_save(tmp_path / "m.eqx", model)
    assert isinstance(cause, es.CheckpointError)
    assert f"no {jnp.dtype(dtype)}" in str(cause) and "es.save" in str(cause)
    es.save(tmp_path / "c", model)
    back = es.load(tmp_path / "c", like=model)
    np.testing.assert_array_equal(
        np.asarray(back[...]).view(np.uint8), np.asarray(cell[...]).view(np.uint8)
    )


def _refusal(path, tmp_path, tree):
    """The error of one persistence path saving `tree`, or None."""
    try:
        if path == "es.save":
            es.save(tmp_path / "c", tree)
        elif path == "es.to_orbax":
            es.to_orbax(tree)
        elif path == "es.state_dict":
            es.state_dict(tree)
        else:
            eqx.tree_serialise_leaves(
                tmp_path / "m.eqx", tree, filter_spec=es.serialise_filter_spec
            )
    except Exception as e:  # Equinox wraps the filter spec's error
        return root_cause(e)
    return None


@pytest.mark.parametrize(
    "leaf",
    [
        np.array(["a", "bc"]),
        np.array([object()], dtype=object),
        np.zeros(2, dtype=[("a", "f4")]),
        np.array(["2020-01-01"], dtype="datetime64[D]"),
        np.str_("x"),
    ],
    ids=["str", "object", "record", "datetime", "str scalar"],
)
def test_every_persistence_path_refuses_what_no_checkpoint_restores(tmp_path, leaf):
    """One rule for every path (`_checkpoint.saved_value`): Equinox's path wrote
    these (an object array as a pickle that Equinox then failed to read back)."""
    tree = {"ok": jnp.ones(1), "bad": leaf}
    errors = {
        path: _refusal(path, tmp_path, tree)
        for path in ("es.save", "es.to_orbax", "eqx.tree_serialise_leaves")
    }
    for path, error in errors.items():
        assert isinstance(error, es.CheckpointError), (path, error)
        assert f"dtype {np.asarray(leaf).dtype}" in str(error), (path, error)


_SAVING_PATHS = ("es.save", "es.to_orbax", "eqx.tree_serialise_leaves", "es.state_dict")


@pytest.mark.parametrize("path", _SAVING_PATHS)
def test_every_persistence_path_refuses_a_tracer(tmp_path, path):
    errors = []

    @jax.jit
    def f(x):
        errors.append(_refusal(path, tmp_path, {"x": x}))
        return x

    f(jnp.ones(2))
    assert isinstance(errors[0], es.CheckpointError), (path, errors)
    assert f"tracer (`{path}` was called inside" in str(errors[0])
    if path != "eqx.tree_serialise_leaves":  # Equinox opens its file first
        assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("path", _SAVING_PATHS)
def test_every_persistence_path_refuses_a_ref_mode_model_closed_over_by_a_trace(
    tmp_path, path
):
    """A concrete ref-mode model closed over by `jax.jit` (as the docs recommend
    inside compiled code): its cells' values are tracers there. Refused as a traced
    array is (JAX's conversion errors, or silently tracers from `es.to_orbax`,
    before), and the ref is still usable in the trace and after."""
    bn = es.to_refs(es.nn.BatchNorm(3))
    errors = []

    @jax.jit
    def f(x):
        errors.append(_refusal(path, tmp_path, bn))
        return x + bn.running_var[...]

    np.testing.assert_array_equal(f(jnp.ones(3)), np.full(3, 2.0, np.float32))
    assert isinstance(errors[0], es.CheckpointError), (path, errors)
    assert f"tracer (`{path}` was called inside" in str(errors[0])
    if path != "eqx.tree_serialise_leaves":  # there Equinox's error names the path
        assert "running_mean" in str(errors[0])  # the first cell, named
        assert not list(tmp_path.iterdir())  # and Equinox opens its file first
    # outside the trace the same model saves
    assert _refusal(path, tmp_path, bn) is None


# ------------------------------------------------------ the file is the frozen model's


def _frozen_bits(model):
    """Every array leaf of the value-mode copy, as NumPy bits (typed keys as data)."""
    out = []
    for leaf in jax.tree.leaves(es.freeze(model)):
        if isinstance(leaf, jax.Array):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            leaf = np.asarray(leaf)
            out.append((leaf.dtype, leaf.shape, leaf.tobytes()))
    return out


def test_es_filter_spec_writes_the_bytes_of_the_frozen_model(tmp_path):
    """docs/equinox.md: the same bytes as Equinox's default on `es.freeze(model)`;
    the zero-size shape witnesses of ref-mode cells are not written."""
    model = trained(Plain, "ref")
    eqx.tree_serialise_leaves(
        tmp_path / "spec.eqx", model, filter_spec=es.serialise_filter_spec
    )
    eqx.tree_serialise_leaves(tmp_path / "frozen.eqx", es.freeze(model))
    assert (tmp_path / "spec.eqx").read_bytes() == (
        tmp_path / "frozen.eqx"
    ).read_bytes()
    eqx.tree_serialise_leaves(
        tmp_path / "value.eqx", es.freeze(model), filter_spec=es.serialise_filter_spec
    )
    assert (tmp_path / "value.eqx").read_bytes() == (
        tmp_path / "frozen.eqx"
    ).read_bytes()


@pytest.mark.parametrize("cls", [Plain, WithKey])
@pytest.mark.parametrize("saved, loaded", [("ref", "value"), ("value", "ref")])
def test_es_filter_spec_files_load_into_either_mode(tmp_path, cls, saved, loaded):
    model = trained(cls, saved)
    path = tmp_path / "m.eqx"
    eqx.tree_serialise_leaves(path, model, filter_spec=es.serialise_filter_spec)
    like = cls(seed=5)
    like = es.to_refs(like) if loaded == "ref" else like
    got = eqx.tree_deserialise_leaves(
        path, like, filter_spec=es.deserialise_filter_spec
    )
    assert _frozen_bits(got) == _frozen_bits(model)
    if loaded == "ref":
        for cell in jax.tree.leaves(got, is_leaf=es.is_state):
            if es.is_state(cell):
                assert isinstance(cell.value, jax.Ref)
                assert cell.witness.shape == (*cell.value.shape, 0)
        got.steps.increment()  # the loaded model runs, with its own refs
        assert (
            int(got.steps.value[...])
            == int(np.asarray(es.freeze(model).steps.value)) + 1
        )
    else:
        assert_tree_exact(got, es.freeze(model))


def test_es_filter_spec_names_a_consumed_leaf_and_equinox_its_path(tmp_path):
    model = Plain()
    step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(1e-2))
    step(model, step.init(model), jnp.ones((4, 3)))
    with pytest.raises(RuntimeError, match=r"path.*'lin'.*'weight'") as info:
        eqx.tree_serialise_leaves(
            tmp_path / "m.eqx", model, filter_spec=es.serialise_filter_spec
        )
    message = str(root_cause(info.value))
    assert message.startswith(
        "The leaf that `eqx.tree_serialise_leaves` was writing (an array of "
        "float32[4, 3]"
    )
    assert "TreePathError" in message and "The A " not in message


def test_es_filter_spec_names_a_consumed_ref_mode_cell(tmp_path):
    """JAX donates ref arguments to a jitted call, even one that then fails."""
    model = consumed_ref_mode_model()
    with pytest.raises(RuntimeError, match=r"path.*'value'") as info:
        eqx.tree_serialise_leaves(
            tmp_path / "m.eqx", model, filter_spec=es.serialise_filter_spec
        )
    assert isinstance(root_cause(info.value), es.StaleModelError)
    assert str(root_cause(info.value)).startswith(
        "The leaf that `eqx.tree_serialise_leaves` was writing (a ref-mode cell of "
        "float32[2]"
    )


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_es_filter_specs_refuse_a_64_bit_file_without_x64(tmp_path, mode):
    """A count of 2**40 + 7 and a float64 saved with x64 on came back as 7 and a
    rounded float32 without it (`jnp.load` cut them; Equinox's check compared the
    cut arrays), where `es.load` refuses: refused alike, naming the switch."""
    with jax.enable_x64(True):
        saved = es.nn.Counter(dtype=jnp.int64)
        saved = eqx.tree_at(
            lambda c: c.count.value, saved, jnp.asarray(2**40 + 7, jnp.int64)
        )
        eqx.tree_serialise_leaves(
            tmp_path / "m.eqx", saved, filter_spec=es.serialise_filter_spec
        )
    like = es.nn.Counter()  # int32 without x64
    like = es.to_refs(like) if mode == "ref" else like
    cause = refused_load(tmp_path / "m.eqx", like)
    assert isinstance(cause, es.CheckpointError)
    assert "int64 values that int32 cannot hold (e.g. 1099511627783)" in str(cause)
    with jax.enable_x64(True):  # the fix it names works
        like = es.nn.Counter(dtype=jnp.int64)
        like = es.to_refs(like) if mode == "ref" else like
        got = eqx.tree_deserialise_leaves(
            tmp_path / "m.eqx", like, filter_spec=es.deserialise_filter_spec
        )
        assert int(got.count[...]) == 2**40 + 7


def test_es_filter_specs_load_64_bit_values_that_fit_as_equinox_does(tmp_path):
    """NumPy float64 / int64 data (or a count that fits) loaded into 32-bit leaves
    without x64 is cast as Equinox casts it: only integers that 32 bits cannot
    hold are refused (the reference: Equinox's own default spec)."""

    class Saved(eqx.Module):
        w: np.ndarray
        n: np.ndarray

    saved = Saved(np.asarray([0.1, 2.5]), np.asarray([3, -4], np.int64))
    eqx.tree_serialise_leaves(tmp_path / "m.eqx", saved)
    like = Saved(jnp.zeros(2), jnp.zeros(2, jnp.int32))  # pyright: ignore
    want = eqx.tree_deserialise_leaves(tmp_path / "m.eqx", like)
    got = eqx.tree_deserialise_leaves(
        tmp_path / "m.eqx", like, filter_spec=es.deserialise_filter_spec
    )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
