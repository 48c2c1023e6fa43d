"""Orbax checkpoints through `es.to_orbax` / `es.orbax_target` / `es.from_orbax` and
Orbax's own `CheckpointManager` + `StandardSave` / `StandardRestore`: every leaf type
in both storage modes, keep-last-N and save-every-K, async saves that do not block
training (and survive the next donating step), and bit-exact resume of
examples/resume_orbax.py across processes, after a clean stop and after a crash."""

import io
import subprocess
import sys
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _checkpoint_helpers import ROOT, assert_tree_exact, child_env
from _scripts import load_script

import eqx_state as es


ocp = pytest.importorskip("orbax.checkpoint")


class Holder(eqx.Module):
    lin: eqx.nn.Linear
    bn: es.nn.BatchNorm
    rng: es.RngState
    raw: es.RngState
    extra: dict
    act: object

    def __init__(self, seed=0):
        self.lin = eqx.nn.Linear(3, 2, key=jax.random.key(seed))
        self.bn = es.nn.BatchNorm(2)
        self.rng = es.RngState(jax.random.key(seed + 1))
        self.raw = es.RngState(jax.random.PRNGKey(seed + 2))
        self.extra = {
            "np_int64": np.array([2**40 + seed], np.int64),
            "np_float64": np.float64(1 / (3 + seed)),
            "np_bool": np.bool_(seed % 2 == 0),
            "py_int": 3 + seed,
            "py_float": 0.5 + seed,
            "py_bool": seed % 2 == 1,
            "py_complex": 1 + 2j * seed,
            "bf16": jnp.array([1.5 + seed], jnp.bfloat16),
            "weak": jnp.asarray(2.5 + seed),
            "uint8": jnp.arange(3, dtype=jnp.uint8) + seed,
        }
        self.act = jax.nn.relu


def in_mode(model, mode):
    return es.to_refs(model) if mode == "ref" else model


def save_and_restore(tmp_path, tree, like):
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(0, args=ocp.args.StandardSave(es.to_orbax(tree)))
        mngr.wait_until_finished()
        target = es.orbax_target(like, mngr.item_metadata(0))
        restored = mngr.restore(0, args=ocp.args.StandardRestore(target))
    return es.from_orbax(restored, like)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_every_leaf_type_round_trips(tmp_path, mode):
    model = in_mode(Holder(seed=1), mode)
    loaded = save_and_restore(tmp_path, model, in_mode(Holder(seed=0), mode))
    assert_tree_exact(loaded, model)  # refs are new refs (checked by assert_exact)


def test_restore_into_an_abstract_model(tmp_path):
    model = Holder(seed=1)
    abstract = eqx.filter_eval_shape(Holder, 0)
    assert not [x for x in jax.tree.leaves(abstract) if eqx.is_array(x)]
    loaded = save_and_restore(tmp_path, model, abstract)
    # an abstract leaf does not say NumPy or JAX, weak or strong: Orbax restores JAX
    # arrays; the values, dtypes of JAX leaves, typed keys and Python values are exact
    want_leaves = dict(jax.tree_util.tree_leaves_with_path(model))
    for path, got in jax.tree_util.tree_leaves_with_path(loaded):
        want = want_leaves[path]
        if isinstance(want, jax.Array):
            if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
                assert got.dtype == want.dtype
                got, want = jax.random.key_data(got), jax.random.key_data(want)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        elif isinstance(want, np.ndarray | np.generic):
            np.testing.assert_array_equal(np.asarray(got), want)
        else:
            assert got == want and type(got) is type(want)
    ref_mode = es.to_refs(loaded)
    assert isinstance(ref_mode.bn.running_mean.value, jax.Ref)


def train_steps(model, opt_state, step, n, start=0):
    for i in range(start, start + n):
        x = jax.random.normal(jax.random.fold_in(jax.random.key(0), i), (4, 3))
        model, opt_state = step(model, opt_state, x)
    return model, opt_state


class Net(eqx.Module):
    lin: eqx.nn.Linear
    bn: es.nn.BatchNorm

    def __init__(self):
        self.lin = eqx.nn.Linear(3, 2, key=jax.random.key(0))
        self.bn = es.nn.BatchNorm(2)

    def __call__(self, x):
        return self.bn(jax.vmap(self.lin)(x))


def loss_fn(model, x):
    return jnp.mean(model(x) ** 2)


def test_keep_last_n_and_save_every_k(tmp_path):
    step = es.make_step(loss_fn, optax.adam(1e-2))
    model = Net()
    opt_state = step.init(model)
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=3)
    saved = {}
    with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as mngr:
        for i in range(10):
            model, opt_state = train_steps(model, opt_state, step, 1, start=i)
            if mngr.save(
                i, args=ocp.args.StandardSave(es.to_orbax((model, opt_state)))
            ):
                saved[i] = jax.tree.map(np.asarray, (model, opt_state))
        mngr.wait_until_finished()
        assert sorted(saved) == [0, 3, 6, 9]
        assert mngr.all_steps() == [6, 9]
        like = (Net(), step.init(Net()))
        for i in (6, 9):
            restored = mngr.restore(
                i,
                args=ocp.args.StandardRestore(
                    es.orbax_target(like, mngr.item_metadata(i))
                ),
            )
            got = jax.tree.map(np.asarray, es.from_orbax(restored, like))
            jax.tree.map(np.testing.assert_array_equal, got, saved[i])


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_async_save_does_not_block_and_survives_donation(tmp_path, mode):
    """The save returns while Orbax is still working in the background; the next
    steps run meanwhile (value mode: a donating step gets the buffers being saved;
    XLA keeps them while Orbax holds them) and the checkpoint holds the state at the
    time of the save."""
    release = threading.Event()
    options = ocp.CheckpointManagerOptions(
        async_options=ocp.AsyncOptions(
            post_finalization_callback=lambda: release.wait(60)
        )
    )
    step = es.make_step(loss_fn, optax.adam(1e-2))
    model = in_mode(Net(), mode)
    opt_state = step.init(model)
    model, opt_state = train_steps(model, opt_state, step, 2)
    snapshot = jax.tree.map(np.asarray, es.freeze((model, opt_state)))
    with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as mngr:
        try:
            mngr.save(2, args=ocp.args.StandardSave(es.to_orbax((model, opt_state))))
            model, opt_state = train_steps(model, opt_state, step, 3, start=2)
            assert mngr.is_saving_in_progress()  # the steps ran during the save
        finally:
            release.set()
        mngr.wait_until_finished()
        like = (in_mode(Net(), mode), step.init(Net()))
        target = es.orbax_target(like, mngr.item_metadata(2))
        restored = mngr.restore(2, args=ocp.args.StandardRestore(target))
    loaded = es.from_orbax(restored, like)
    got = jax.tree.map(np.asarray, es.freeze(loaded))
    jax.tree.map(np.testing.assert_array_equal, got, snapshot)


def test_a_consumed_model_raises_stale_model_error():
    step = es.make_step(loss_fn, optax.sgd(1e-2))
    model = Net()
    step(model, step.init(model), jnp.ones((4, 3)))
    with pytest.raises(es.StaleModelError, match=r"donate=False"):
        es.to_orbax(model)


def test_to_orbax_refuses_tracers_and_text():
    with pytest.raises(
        es.CheckpointError, match=r"\['s'\]: it is an array of dtype <U1"
    ):
        es.to_orbax({"s": np.array(["a"])})
    with pytest.raises(es.CheckpointError, match="tracer"):
        jax.jit(lambda x: es.to_orbax({"x": x}))(jnp.ones(2))


def test_to_orbax_refuses_an_empty_array_that_orbax_cannot_write(tmp_path):
    """Orbax's save fails on a zero-size array with a bare `ValueError` after
    `to_orbax` took it; it is refused by name, with `es.save`, which writes it, as
    the fix."""
    tree = {"w": jnp.ones(2), "empty": jnp.zeros((0, 4))}
    with pytest.raises(es.CheckpointError, match=r"\['empty'\].*zero size.*es.save"):
        es.to_orbax(tree)
    es.save(tmp_path / "c", tree)
    assert es.load(tmp_path / "c", like=tree)["empty"].shape == (0, 4)


@pytest.mark.skipif(
    np.dtype(np.longdouble).itemsize == 8, reason="longdouble is float64 here"
)
def test_to_orbax_refuses_extended_precision_as_es_save_does(tmp_path):
    """One dtype rule for both paths, with the same message."""
    tree = {"x": np.array([1 / 3], np.longdouble)}
    with pytest.raises(es.CheckpointError) as by_orbax:
        es.to_orbax(tree)
    with pytest.raises(es.CheckpointError) as by_save:
        es.save(tmp_path / "c", tree)
    assert str(by_orbax.value) == str(by_save.value)
    assert "NumPy's extended precision (`np.longdouble`)" in str(by_orbax.value)


class TwoCounters(eqx.Module):
    a: es.nn.Counter
    b: es.nn.Counter


def test_one_ref_at_two_places_is_refused():
    counter = es.to_refs(es.nn.Counter())
    with pytest.raises(es.CheckpointError) as info:
        es.to_orbax(TwoCounters(counter, counter))
    message = str(info.value)
    assert message.startswith("`es.to_orbax` refuses a tree that holds one ref at two")
    assert (
        "`model.a.count` and `model.b.count`" in message and "eqx.nn.Shared" in message
    )
    assert isinstance(info.value, es.StateError)


def test_arrays_pass_through_unchanged(tmp_path):
    """Sharded arrays reach Orbax as they are (Orbax writes each shard), and the
    restore target carries each array's sharding."""
    x = jnp.arange(4.0)
    tree = {"x": x, "cell": es.to_refs(es.Buffer(jnp.ones(2)))}
    out = es.to_orbax(tree)
    assert out["x"] is x
    assert not isinstance(out["cell"].value, jax.Ref)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(0, args=ocp.args.StandardSave(out))
        mngr.wait_until_finished()
        target = es.orbax_target(tree, mngr.item_metadata(0))
    assert target["x"].sharding == x.sharding
    assert target["cell"].value.sharding == tree["cell"].value.sharding


def saved_metadata(tmp_path, tree):
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(0, args=ocp.args.StandardSave(es.to_orbax(tree)))
        mngr.wait_until_finished()
        return mngr.item_metadata(0)


def test_orbax_target_checks_like_against_the_checkpoint(tmp_path):
    """Orbax casts to the target dtype silently; `es.orbax_target` refuses."""
    meta = saved_metadata(
        tmp_path, {"w": jnp.zeros(3), "k": jax.random.key(0), "n": 1, "e": {"a": 1.0}}
    )
    like = {"w": jnp.zeros(3), "k": jax.random.key(1), "n": 2, "e": {"a": 2.0}}
    es.orbax_target(like, meta)  # fine
    for change, match in [
        (
            {"w": jnp.zeros(3, jnp.bfloat16)},
            r"At \['w'\] .* float32\(3,\) .* bfloat16\(3,\)",
        ),
        ({"w": jnp.zeros(4)}, r"At \['w'\] .* float32\(3,\) .* float32\(4,\)"),
        (
            {"k": jax.random.key(0, impl="rbg")},
            r"At \['k'\] .* uint32\(2,\) .* uint32\(4,\)",
        ),
        ({"n": 2.0}, r"At \['n'\] .* expects a Python float"),
        ({"e": {"a": 1.0, "b": 2.0}}, r"no array at \['e'\]\['b'\]"),
        ({"e": {}}, r"holds an array named 'e.a'"),
    ]:
        with pytest.raises(es.CheckpointError, match=match):
            es.orbax_target({**like, **change}, meta)


def test_from_orbax_refuses_what_does_not_have_like_s_shape_or_dtype(tmp_path):
    """Restored without `orbax_target` (Orbax then restores what the file holds),
    `from_orbax` returned a cell of shape (3,) holding a value of shape (5,), or a
    float16 weight in a float32 model."""
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        saved = {"cell": es.Buffer(jnp.zeros(5))}
        mngr.save(0, args=ocp.args.StandardSave(es.to_orbax(saved)))
        mngr.save(
            1,
            args=ocp.args.StandardSave(
                {"w": np.zeros(3, np.float16), "n": np.array([2**40])}
            ),
        )
        mngr.wait_until_finished()
        # restored into the tree it was saved from, not `es.orbax_target(like, ...)`
        std = ocp.args.StandardRestore
        shape = mngr.restore(0, args=std(es.to_orbax(saved)))
        dtype = mngr.restore(
            1, args=std({"w": np.zeros(3, np.float16), "n": np.zeros(1, np.int64)})
        )
    with pytest.raises(
        es.CheckpointError,
        match=r"At \['cell'\]\.value Orbax restored float32\(5,\) but `like` "
        r"holds float32\(3,\).*orbax_target",
    ):
        es.from_orbax(shape, {"cell": es.Buffer(jnp.zeros(3))})
    with pytest.raises(es.CheckpointError, match=r"At \['w'\] .*float16.*float32"):
        es.from_orbax(dtype, {"w": jnp.zeros(3), "n": np.array([0])})
    # NumPy int64 data into `filter_eval_shape`'s int32 description still fits
    got = es.from_orbax(
        dtype,
        {"w": np.zeros(3, np.float16), "n": jax.ShapeDtypeStruct((1,), jnp.int32)},
    )
    assert got["n"].dtype == np.int64 and got["n"][0] == 2**40


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_numpy_64_bit_data_where_like_holds_a_jax_array(mode):
    """NumPy float64 / int64 data (a tree restored without a target, or by a
    handler that gives NumPy) where `like` holds JAX float32 / int32 arrays: the
    model got NumPy leaves (a float64 weight in a float32 model) and an int64 count
    beyond int32 that JAX then wrapped (`2**32 + 7` read as 7). Now values that the
    JAX dtype holds exactly come back as JAX arrays of `like`'s dtype (equal to
    NumPy's cast), and the others are refused by name."""
    bn = es.nn.BatchNorm(3)
    like = es.to_refs(bn) if mode == "ref" else bn
    saved = es.to_orbax(like)

    def widen(add_int=0, add_float=0.0):
        def one(x):
            x = np.asarray(x)
            if x.dtype == np.float32:
                return x.astype(np.float64) + add_float
            return x.astype(np.int64) + add_int if x.dtype == np.int32 else x

        return jax.tree.map(one, saved)

    got = es.from_orbax(widen(add_int=5), like)
    pairs = zip(jax.tree.leaves(es.freeze(got)), jax.tree.leaves(bn), strict=True)
    for a, b in ((a, b) for a, b in pairs if isinstance(b, jax.Array)):
        assert isinstance(a, jax.Array) and a.dtype == b.dtype
        np.testing.assert_array_equal(
            a, np.asarray(b) + (5 if b.dtype == jnp.int32 else 0)
        )
    with pytest.raises(es.CheckpointError, match=r"num_batches_tracked.*int64.*int32"):
        es.from_orbax(widen(add_int=2**32), like)
    with pytest.raises(es.CheckpointError, match=r"float64 values that float32"):
        es.from_orbax(widen(add_float=1e-10), like)


def test_numpy_int64_into_an_abstract_like_is_not_downcast(tmp_path):
    tree = {"n": np.array([2**40 + 3]), "s": np.float64(1 / 3), "j": jnp.arange(2)}
    abstract = eqx.filter_eval_shape(lambda: tree)
    assert abstract["n"].dtype == jnp.int32  # what eval_shape says without x64
    loaded = save_and_restore(tmp_path, tree, abstract)
    assert loaded["n"].dtype == np.int64 and int(loaded["n"][0]) == 2**40 + 3
    assert loaded["s"].dtype == np.float64 and float(loaded["s"]) == 1 / 3
    assert isinstance(loaded["j"], jax.Array)


class Loader(eqx.Module):
    """A model with NumPy data positions: a NumPy scalar and a 0-d NumPy array."""

    bn: es.nn.BatchNorm
    position: np.int64
    epoch: np.ndarray

    def __init__(self, seed=0):
        self.bn = es.nn.BatchNorm(2)
        self.position = np.int64(2**40 + seed)
        self.epoch = np.asarray(np.float32(seed + 0.5))


def _load_bytes(blob, like):
    return es.load(io.BytesIO(blob), like=like)


def _saved(tree):
    buffer = io.BytesIO()
    es.save(buffer, tree)
    return buffer.getvalue()


def _assert_numpy_leaves(got, like, want):
    """`got`'s NumPy leaves have the type of `like`'s (one rule for every load
    path) and hold `want`'s values, by NumPy's own comparison."""
    for name in ("position", "epoch"):
        g, w = getattr(got, name), getattr(want, name)
        assert type(g) is type(getattr(like, name)), (name, type(g))
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_numpy_data_positions_orbax_then_es_load(tmp_path, mode):
    """Orbax stores a NumPy scalar as a 0-d array. Restored into an abstract model,
    it comes back as `es.load` gives it (the same rule, one function): a 0-d NumPy
    value as a NumPy scalar. A later `es.save` / `es.load` into a normally built
    model then gives that model's types: a NumPy scalar and a 0-d array."""
    model = in_mode(Loader(seed=3), mode)
    abstract = eqx.filter_eval_shape(Loader, 0)
    restored = save_and_restore(tmp_path, model, abstract)
    via_es = _load_bytes(_saved(model), abstract)  # the other path, same like
    for name in ("position", "epoch"):
        got, other = getattr(restored, name), getattr(via_es, name)
        assert type(got) is type(other) and isinstance(got, np.generic)
    built = in_mode(Loader(seed=0), mode)
    again = _load_bytes(_saved(restored), built)
    _assert_numpy_leaves(again, built, model)
    assert isinstance(again.bn.running_mean.value, type(built.bn.running_mean.value))
    concrete = save_and_restore(tmp_path / "2", model, built)  # concrete like
    _assert_numpy_leaves(concrete, built, model)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_numpy_data_positions_es_load_then_orbax(tmp_path, mode):
    """The other way round: `es.load` into an abstract model, then an Orbax
    save and a restore into a normally built model, and into an abstract one."""
    model = in_mode(Loader(seed=3), mode)
    abstract = eqx.filter_eval_shape(Loader, 0)
    loaded = _load_bytes(_saved(model), abstract)
    built = in_mode(Loader(seed=0), mode)
    restored = save_and_restore(tmp_path, loaded, built)
    _assert_numpy_leaves(restored, built, model)
    back = save_and_restore(tmp_path / "2", loaded, abstract)
    _assert_numpy_leaves(back, loaded, model)
    # a 0-d NumPy array saved by es.save loads into a NumPy scalar and back
    swapped = eqx.tree_at(lambda m: m.epoch, built, np.float32(0))
    _assert_numpy_leaves(_load_bytes(_saved(model), swapped), swapped, model)


@pytest.mark.slow  # a fresh interpreter (~8 s)
def test_the_package_imports_without_orbax():
    code = (
        "import sys\n"
        "sys.modules['orbax'] = None\n"
        "sys.modules['orbax.checkpoint'] = None\n"
        "import jax.numpy as jnp, eqx_state as es\n"
        "print(es.to_orbax({'x': jnp.ones(1)})['x'].shape)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(1,)"


# --------------------------------------------------------------------------------------
# examples/resume_orbax.py: resume in a fresh process, bit for bit.

STEPS = 12


@pytest.fixture(scope="module")
def example():
    return load_script("examples", "resume_orbax", module_name="resume_orbax_example")


def resume_in_a_fresh_process(directory, mode, final):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "resume_orbax.py"),
            *("--dir", str(directory), "--steps", str(STEPS), "--mode", mode),
            *("--save-every", "4", "--final", str(final)),
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def assert_equals_uninterrupted(example, tmp_path, mode, resumed):
    model, opt_state, start = example.train(
        tmp_path / "straight", steps=STEPS, mode=mode, save_every=4
    )
    assert start == 0
    assert_tree_exact(resumed, (model, opt_state))  # ref mode restored as ref mode
    assert int(resumed[0].steps.value) == STEPS


@pytest.mark.slow  # the example end to end; Orbax's round trips run by default above
def test_example_resumes_bit_exactly_after_a_stop(example, tmp_path):
    """Ref mode: train 10 of 12 steps here and stop; a fresh process resumes from
    the latest checkpoint (8) and finishes."""
    model, _, start = example.train(
        tmp_path / "run", steps=STEPS, mode="ref", save_every=4, stop_at=10
    )
    assert start == 0 and int(model.steps.value) == 10
    out = resume_in_a_fresh_process(tmp_path / "run", "ref", tmp_path / "final.eqxs")
    assert out.startswith("started at step 8, finished at step 12")
    assert_equals_uninterrupted(
        example,
        tmp_path,
        "ref",
        es.load(tmp_path / "final.eqxs", like=example.fresh(5, "ref")),
    )


@pytest.mark.slow
def test_example_resumes_bit_exactly_after_a_crash(example, tmp_path):
    """Value mode: a process crashes after step 10 (an in-flight save is lost); this
    process resumes from whatever checkpoint is finalised and finishes."""
    crash = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "resume_orbax.py"),
            *("--dir", str(tmp_path / "run"), "--steps", str(STEPS)),
            *("--save-every", "4", "--crash-at", "10"),
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert crash.returncode == 3, crash.stderr
    model, opt_state, start = example.train(
        tmp_path / "run", steps=STEPS, mode="value", save_every=4
    )
    assert start in {0, 1, 4, 8}  # whichever checkpoint the crash left finalised
    assert_equals_uninterrupted(example, tmp_path, "value", (model, opt_state))


def test_a_jax_array_and_a_python_scalar_do_not_stand_for_each_other(tmp_path):
    """An `optax.inject_hyperparams` learning rate saved as a float32 array loaded
    into a state that holds a Python float came back as 0.009999999776 (Orbax casts
    it), where `es.load` refuses: both paths now refuse, in both directions, with
    one message."""
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    as_array = opt.init({"w": jnp.ones(3)})
    as_float = opt.init({"w": jnp.ones(3)})
    as_float.hyperparams["learning_rate"] = 0.05
    for i, (saved, like, holds) in enumerate(
        [(as_array, as_float, "a JAX array"), (as_float, as_array, "a Python scalar")]
    ):
        es.save(tmp_path / f"{i}.eqxs", saved)
        with pytest.raises(es.CheckpointError, match=f"holds {holds} but `like`"):
            es.load(tmp_path / f"{i}.eqxs", like)
        with pytest.raises(es.CheckpointError, match=f"holds {holds} but `like`"):
            save_and_restore(tmp_path / str(i), saved, like)


def test_a_typed_key_restored_into_a_raw_key_cell_names_the_keys(tmp_path):
    """`orbax_target` cannot tell typed keys from raw key data (both are saved as
    data); `from_orbax` refused with advice to restore with `orbax_target`, which
    was what had been done. It names the keys, as `es.load` does."""
    saved = {"k": es.RngState(jax.random.key(0))}
    like = {"k": es.RngState(jax.random.PRNGKey(1))}
    with pytest.raises(es.CheckpointError, match=r"same keys \(typed"):
        save_and_restore(tmp_path, saved, like)
    es.save(tmp_path / "k.eqxs", saved)
    with pytest.raises(es.CheckpointError, match=r"same kind of key|typed"):
        es.load(tmp_path / "k.eqxs", like)
