"""Sharded parameters on 4 devices in one process: `make_step(..., layout=...)`
(tensor parallel over a 2 x 2 mesh) equals one device, keeps every output where the
layout puts it and gathers no weight; the optimizer state follows its parameters;
Orbax restores a 2 x 2 layout onto a 1 x 4 one; misuse names the fix."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _net import Net, loss_fn
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqx_state as es
from eqx_state import _compat, _modes


LAYOUT = [
    (r"l1\.weight$", P("model", None)),
    (r"bn\.(weight|bias|running_mean|running_var)$", P("model")),
    (r"l2\.weight$", P(None, "model")),
]


@pytest.fixture(scope="module")
def mesh2x2():
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (run through tests/test_multidevice.py)")
    return jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _data(n=3, batch=8):
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (n, batch, 6)), jax.random.normal(ky, (n, batch, 3))


def _arrays(tree):
    return [v for v in jax.tree.leaves(es.freeze(tree)) if isinstance(v, jax.Array)]


def _assert_equals_one_device(model, opt_state, xs, ys):
    """`model, opt_state` equal the same adam steps on one device, leaf by leaf."""
    single = es.make_step(loss_fn, optax.adam(1e-2))
    m = Net(jax.random.key(0))
    s = single.init(m)
    dev = jax.devices()[0]
    for i in range(len(xs)):
        m, s = single(m, s, jax.device_put(xs[i], dev), jax.device_put(ys[i], dev))
    for a, b in zip(_arrays((model, opt_state)), _arrays((m, s)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_tensor_parallel_equals_single_device(mesh2x2, mode):
    xs, ys = _data()
    step = es.make_step(loss_fn, optax.adam(1e-2), mesh=mesh2x2, layout=LAYOUT)
    model = es.place(Net(jax.random.key(0)), mesh2x2, LAYOUT)
    if mode == "ref":
        model = es.to_refs(model)  # the refs are made where the layout put the arrays
    opt_state = step.init(model)
    hlo = step.lower(model, opt_state, xs[0], ys[0]).compile().as_text()
    assert not re.search("all-gather|all-to-all", hlo)  # no weight is assembled
    for i in range(len(xs)):
        model, opt_state = step(model, opt_state, xs[i], ys[i])
    assert step.trace_count == 1

    _assert_equals_one_device(model, opt_state, xs, ys)

    frozen = es.freeze(model)
    assert frozen.l1.weight.sharding.spec == P("model", None)
    assert frozen.l2.weight.sharding.spec == P(None, "model")
    assert frozen.bn.running_var.value.sharding.spec == P("model")
    assert frozen.bn.num_batches_tracked.value.sharding.is_fully_replicated
    assert frozen.l2.bias.sharding.is_fully_replicated
    assert opt_state[0].mu.l1.weight.sharding.spec == P("model", None)
    assert opt_state[0].nu.bn.bias.sharding.spec == P("model")
    assert opt_state[0].count.sharding.is_fully_replicated
    # each device holds half of the hidden layer
    assert frozen.l1.weight.addressable_shards[0].data.shape == (4, 6)


def test_optimizer_state_follows_its_parameters_through_wrappers(mesh2x2):
    """Every copy of a parameter in a nested optimizer state (a chain, weight
    decay, gradient accumulation) is laid out like the parameter."""
    opt = optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), 2
    )
    step = es.make_step(loss_fn, opt, mesh=mesh2x2, layout=LAYOUT)
    model = Net(jax.random.key(0))
    opt_state = step.init(model)
    specs = {
        jax.tree_util.keystr(p): v.sharding.spec
        for p, v in jax.tree_util.tree_flatten_with_path(opt_state)[0]
        if isinstance(v, jax.Array)
    }
    weights = [k for k in specs if k.endswith(".l1.weight")]
    assert len(weights) >= 3  # accumulated gradients, mu, nu
    assert all(specs[k] == P("model", None) for k in weights)
    assert all(specs[k] == P(None, "model") for k in specs if k.endswith(".l2.weight"))
    assert all(specs[k] == P() for k in specs if k.endswith(".l2.bias"))
    # and the step takes it as it is: no copy, one compilation
    xs, ys = _data(2)
    for i in range(2):
        model, opt_state = step(model, opt_state, xs[i], ys[i])
    assert step.trace_count == 1


def test_orbax_restores_a_2x2_layout_onto_1x4(mesh2x2, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    xs, ys = _data(2)
    step = es.make_step(loss_fn, optax.adam(1e-2), mesh=mesh2x2, layout=LAYOUT)
    model = Net(jax.random.key(0))
    model, opt_state = step.place(model, step.init(model))
    model, opt_state = step(model, opt_state, xs[0], ys[0])
    with ocp.CheckpointManager(
        tmp_path, item_handlers=ocp.StandardCheckpointHandler()
    ) as manager:
        manager.save(1, args=ocp.args.StandardSave(es.to_orbax((model, opt_state))))
        manager.wait_until_finished()
        mesh1x4 = jax.make_mesh(
            (1, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
        )
        other = es.make_step(loss_fn, optax.adam(1e-2), mesh=mesh1x4, layout=LAYOUT)

        def fresh():
            m = Net(jax.random.key(1))
            return m, other.init(m)

        like = other.place(*eqx.filter_eval_shape(fresh))  # abstract, 1 x 4 layout
        assert like[0].l1.weight.sharding.spec == P("model", None)
        target = es.orbax_target(like, manager.item_metadata(1))
        restored = manager.restore(1, args=ocp.args.StandardRestore(target))
    m2, s2 = es.from_orbax(restored, like)
    assert m2.l1.weight.sharding.mesh.shape == {"data": 1, "model": 4}
    assert m2.l1.weight.addressable_shards[0].data.shape == (2, 6)
    for a, b in zip(_arrays((m2, s2)), _arrays((model, opt_state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and it trains on, on the new mesh
    m2, s2 = other(m2, s2, xs[1], ys[1])
    assert int(m2.steps.count[...]) == 2


@pytest.mark.parametrize("where", ["device 1", "sharded"])
def test_orbax_numpy_data_goes_where_a_ref_mode_like_is(mesh2x2, where):
    # What Orbax restored as NumPy (no target, or a handler that gives NumPy) goes
    # where `like`'s leaf is: a ref's new ref too (its array was put on the default
    # device, away from the model's other arrays and from a mesh)
    def put(a):
        if not isinstance(a, jax.Array):
            return a
        if where == "device 1":
            return jax.device_put(a, jax.devices()[1])
        return jax.device_put(a, NamedSharding(mesh2x2, P("model") if a.ndim else P()))

    bn = es.nn.BatchNorm(4)
    like = es.to_refs(jax.tree.map(put, bn))
    saved = jax.tree.map(np.asarray, es.to_orbax(bn))  # as Orbax gives NumPy
    saved = eqx.tree_at(
        lambda m: m.running_mean.value, saved, np.arange(4, dtype=np.float32)
    )
    got = es.from_orbax(saved, like)
    for name in ("running_mean", "running_var"):
        new, old = getattr(got, name).value, getattr(like, name).value
        assert isinstance(new, jax.Ref) and new is not old
        assert new.sharding == old.sharding, name
    np.testing.assert_array_equal(got.running_mean[...], np.arange(4))
    assert got.weight.sharding == like.weight.sharding  # as a JAX array's


def test_ref_mode_cells_off_the_layout_name_the_fix(mesh2x2):
    rep = NamedSharding(mesh2x2, P())
    model = es.to_refs(Net(jax.random.key(0)), sharding=rep)  # replicated refs
    step = es.make_step(loss_fn, optax.sgd(0.1), mesh=mesh2x2, layout=LAYOUT)
    xs, ys = _data(1)
    with pytest.raises(
        es.StepError, match=r"`model\.bn\.running_mean`.*es\.to_refs\(es\.place\("
    ):
        step(model, step.init(model), xs[0], ys[0])
    with pytest.raises(es.StateError, match="JAX cannot move a ref"):
        es.place(model, mesh2x2, LAYOUT)
    # after a call that compiled the step for a placed model, the same refusal
    # (the check ran only when a call compiled: a warm step took the refs and
    # moved their arrays)
    placed = es.to_refs(es.place(Net(jax.random.key(0)), mesh2x2, LAYOUT))
    step(placed, step.init(placed), xs[0], ys[0])
    with pytest.raises(
        es.StepError, match=r"`model\.bn\.running_mean`.*es\.to_refs\(es\.place\("
    ):
        step(model, step.init(model), xs[0], ys[0])
    assert model.bn.running_mean.value.sharding.is_equivalent_to(rep, 1)  # unmoved


def test_explicit_axes_with_a_split_contraction_say_use_auto():
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh((2, 2), ("data", "model"))  # JAX's default: Explicit
    step = es.make_step(loss_fn, optax.sgd(0.1), mesh=mesh, layout=LAYOUT)
    model = Net(jax.random.key(0))
    xs, ys = _data(1)
    with pytest.raises(Exception, match="Contracting dimensions") as info:
        step(model, step.init(model), xs[0], ys[0])
    assert "AxisType.Auto" in "".join(getattr(info.value, "__notes__", []))


def test_layout_that_does_not_divide_names_the_path(mesh2x2):
    with pytest.raises(es.StepError, match=r"`l2\.bias` \(shape \(3,\)\)"):
        es.place(Net(jax.random.key(0)), mesh2x2, [(r"l2\.bias", P("model"))])
    step = es.make_step(
        loss_fn, optax.sgd(0.1), mesh=mesh2x2, layout=[(r"l2\.bias", P("data"))]
    )
    with pytest.raises(es.StepError, match="does not divide 3"):
        step.init(Net(jax.random.key(0)))


def test_process_slice_on_one_process(mesh2x2):
    assert es.process_slice(8, mesh2x2) == slice(0, 8)
    with pytest.raises(ValueError, match="does not divide"):
        es.process_slice(7, mesh2x2)
    x = es.global_batch(np.ones((8, 6), np.float32), mesh2x2)
    assert x.sharding.spec == P("data") and x.addressable_shards[0].data.shape == (4, 6)


def test_scan_with_a_layout_equals_single_device_steps(mesh2x2):
    """`step.scan` carries a sharded model and optimizer state through its loop and
    returns them in the layout."""
    xs, ys = _data(3)
    step = es.make_step(loss_fn, optax.adam(1e-2), mesh=mesh2x2, layout=LAYOUT)
    model = Net(jax.random.key(0))
    model, opt_state = step.scan(model, step.init(model), xs, ys)
    assert step.trace_count == 1
    assert model.l1.weight.sharding.spec == P("model", None)
    assert opt_state[0].nu.l2.weight.sharding.spec == P(None, "model")
    _assert_equals_one_device(model, opt_state, xs, ys)


def test_a_new_batch_size_on_the_mesh_warns_once(mesh2x2):
    """A ragged batch compiles the mesh step again, with the same warning as on one
    device."""
    lin = eqx.nn.Linear(6, 4, key=jax.random.key(0))
    step = es.make_step(
        lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), optax.sgd(0.1), mesh=mesh2x2
    )
    opt_state = step.init(lin)
    lin, opt_state = step(lin, opt_state, jnp.ones((8, 6)))
    with pytest.warns(es.RecompileWarning, match=r"\(8, 6\)"):
        lin, opt_state = step(lin, opt_state, jnp.ones((4, 6)))
    assert step.trace_count == 2


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_make_apply_keeps_the_layout_of_the_state_it_writes(mesh2x2, mode):
    """Train, recalibrate BatchNorm with `make_apply`, train on: the replicated
    statistics came back from `make_apply` sharded like the parameters they were
    computed from (XLA chose), and in ref mode the next step refused the model.
    Every state leaf keeps its layout, and the numbers equal the same calls on
    one device."""
    layout = [(r"l1\.weight$", P("model", None)), (r"l2\.weight$", P(None, "model"))]
    xs, ys = _data(2)
    step = es.make_step(loss_fn, optax.sgd(0.1), mesh=mesh2x2, layout=layout)
    recalibrate = es.make_apply(lambda m, x: m(x))
    # compiled first for a model on one device: its plan is not reused on the mesh
    recalibrate(Net(jax.random.key(0)), jax.device_put(xs[1], jax.devices()[0]))
    model = es.place(Net(jax.random.key(0)), mesh2x2, layout)
    model = es.to_refs(model) if mode == "ref" else model
    opt_state = step.init(model)
    model, opt_state = step(model, opt_state, xs[0], ys[0])
    before = [x.sharding for x in _arrays(model)]
    _, model = recalibrate(model, xs[1])
    for x, want in zip(_arrays(model), before, strict=True):
        assert x.sharding.is_equivalent_to(want, x.ndim)
    model, opt_state = step(model, opt_state, xs[1], ys[1])  # refused in ref mode
    # one device: the same three calls
    single = es.make_step(loss_fn, optax.sgd(0.1))
    m = Net(jax.random.key(0))
    s = single.init(m)
    m, s = single(m, s, xs[0], ys[0])
    _, m = es.make_apply(lambda m, x: m(x))(m, xs[1])
    m, s = single(m, s, xs[1], ys[1])
    for a, b in zip(_arrays(model), _arrays(m), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_ref_on_one_device_beside_a_model_on_the_mesh_names_the_fix(mesh2x2):
    """`make_apply` (no mesh of its own) gave JAX's bare "Received incompatible
    devices" for refs made on one device beside parameters on the mesh (the KV
    cache idiom `es.to_refs(es.nn.with_kv_cache(placed_model, ...))`)."""
    placed = es.place(Net(jax.random.key(0)), mesh2x2, LAYOUT)
    dev = jax.devices()[0]
    on_one = jax.tree.map(
        lambda x: jax.device_put(x, dev) if eqx.is_array(x) else x, placed.bn
    )
    on_one = es.to_refs(on_one)  # the cells on one device, the affine on the mesh
    on_one = eqx.tree_at(
        lambda b: (b.weight, b.bias), on_one, (placed.bn.weight, placed.bn.bias)
    )
    model = eqx.tree_at(lambda m: m.bn, placed, on_one)
    xs, _ = _data(1)
    with pytest.raises(
        es.StepError, match=r"`model\.bn\.running_mean`.*es\.to_refs\(es\.place\("
    ):
        es.make_apply(lambda m, x: m(x))(model, xs[0])
    fixed = es.to_refs(es.place(es.freeze(model), mesh2x2, LAYOUT))
    out, _ = es.make_apply(lambda m, x: m(x))(fixed, xs[0])
    want, _ = es.apply(lambda m, x: m(x), Net(jax.random.key(0)), xs[0])
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)


def _placements(tree):
    """`{(committed, device)}` of every array of `tree`, a ref's array included
    (read without JAX's eager read, which would commit it)."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, jax.Ref))
    arrays = [
        _compat.ref_buffer(a) if isinstance(a, jax.Ref) else a
        for a in leaves
        if isinstance(a, jax.Array | jax.Ref)
    ]
    return {(a.committed, *a.devices()) for a in arrays}


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_a_reset_or_a_load_keeps_a_model_made_on_another_default_device_there(
    tmp_path, mode
):
    """A model made under `jax.default_device(d)` holds uncommitted arrays on `d`:
    a reset and a load give the cells they replace new arrays there, still
    uncommitted (`_compat.put_as`), outside that block too. Reference: JAX's own
    placement and flags (a jitted call on the model then runs on the default
    device, as JAX runs uncommitted inputs). With a weakly typed leaf (made weak
    again after a load) and a converted layer's cells (`EMA`: computed from the
    PyTorch arrays). In ref mode, `es.to_refs` outside the block, a reset (in
    place) and each load kept the cells' arrays there too: JAX's eager `new_ref`
    moved them to the default device (every new ref of a conversion or a load),
    and a reset's fill, made there, committed the ref's array when written."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (run through tests/test_multidevice.py)")
    device = jax.devices()[1]
    with jax.default_device(device):
        net = Net(jax.random.key(0))
        model = {"net": net, "ema": es.nn.EMA(net.l1, 0.9), "gain": jnp.asarray(0.5)}
    if mode == "ref":
        model = es.to_refs(model)
        assert _placements(model) == {(False, device)}
    es.save(tmp_path / "m.eqx", model)
    for new in [
        es.reset(model, es.CounterState),
        es.load(tmp_path / "m.eqx", model),
        es.load_state_dict(model, es.state_dict(model)),
    ]:
        assert _placements(new) == {(False, device)}
        assert jax.typeof(new["gain"]).weak_type
    if mode == "ref":  # the witnesses a load's new refs get (`with_witnesses`)
        again = _modes.with_witnesses(_modes.without_witnesses(model))
        assert _placements(again) == {(False, device)}
    # An eager write of a value made on the default device (ref mode: into the
    # ref's array, on `device`) commits nothing, as in value mode: a step on data
    # committed to the default device then runs (a committed cell refused it).
    _, net = es.apply(lambda m: m.steps.increment(), model["net"])
    assert {c for c, _ in _placements(net)} == {False}
    step = es.make_step(loss_fn, optax.sgd(0.1))
    x, y = (jax.device_put(jnp.ones(s), jax.devices()[0]) for s in [(8, 6), (8, 3)])
    net, opt_state = step(net, step.init(net), x, y)
    assert int(net.steps.count[...]) == 2 and step.trace_count == 1


def test_a_weakly_typed_array_sharded_over_an_explicit_mesh_loads(tmp_path):
    """`es.load` makes a weakly typed leaf weak again where it is: over a mesh of
    explicit axes JAX's scatter needs the fill sharded as the data (it refused an
    unsharded fill). Reference: the saved values, shardings and weak types."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (run through tests/test_multidevice.py)")
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    tree = {
        "w": jax.device_put(jax.lax.full((4,), 2.0), NamedSharding(mesh, P("d"))),
        "g": jax.device_put(jnp.asarray(1.5), NamedSharding(mesh, P())),
    }
    es.save(tmp_path / "m.eqx", tree)
    loaded = es.load(tmp_path / "m.eqx", tree)
    for k, v in tree.items():
        assert jax.typeof(loaded[k]) == jax.typeof(v)  # weak, sharded as saved
        assert loaded[k].sharding == v.sharding
        np.testing.assert_array_equal(loaded[k], v)


def test_a_state_dict_load_puts_an_abstract_models_arrays_on_their_shardings(
    mesh2x2,
):
    """An abstract model whose structs name shardings (a model too large to build
    on one device) is filled on them, as `es.load` fills it: `load_state_dict`
    left every array on the default device. A parameter, a typed key field and a
    cell; reference: the sharding each struct names, and the values given."""

    class Keyed(eqx.Module):
        w: jax.Array
        key: jax.Array
        count: es.Buffer

    def make():
        return Keyed(
            jnp.arange(4.0), jax.random.split(jax.random.key(1), 4), es.Buffer(0)
        )

    row = NamedSharding(mesh2x2, P("model"))
    structs = eqx.filter_eval_shape(make)
    abstract = eqx.tree_at(
        lambda m: (m.w, m.key, m.count.value),
        structs,
        [
            jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)
            for s, sh in [
                (structs.w, row),
                (structs.key, row),
                (structs.count.value, NamedSharding(mesh2x2, P())),
            ]
        ],
    )
    sd = es.state_dict(make())
    loaded = es.load_state_dict(abstract, sd)
    assert loaded.w.sharding == row and loaded.key.sharding == row
    assert loaded.count.value.sharding == NamedSharding(mesh2x2, P())
    np.testing.assert_array_equal(loaded.w, sd["w"])
    np.testing.assert_array_equal(jax.random.key_data(loaded.key), sd["key"])


def test_a_sharding_that_does_not_fit_a_loaded_leaf_names_it(mesh2x2, tmp_path):
    """An abstract model whose struct names a sharding that does not divide its
    shape: JAX's error named no leaf of the model. Each load names it in a note."""
    tree = {"w": jnp.zeros(3)}
    es.save(tmp_path / "m.eqx", tree)
    bad = {
        "w": jax.ShapeDtypeStruct(
            (3,), jnp.float32, sharding=NamedSharding(mesh2x2, P("model"))
        )
    }
    for load, where in [
        (lambda: es.load(tmp_path / "m.eqx", bad), "['w']"),
        (lambda: es.load_state_dict(bad, {"w": np.zeros(3, np.float32)}), "`w`"),
    ]:
        with pytest.raises(ValueError, match="divide") as info:
            load()
        assert f"placing the value loaded for {where}" in "".join(
            getattr(info.value, "__notes__", [])
        )


def test_a_committed_state_dict_value_loads_where_the_model_is():
    """PyTorch's `load_state_dict` copies into the module's own tensors, wherever
    the given ones are. A state-dict value that is a JAX array committed to
    another device made the loaded leaf committed there (the next call ran on
    that device, or failed for mixed devices). Now each array is loaded where the
    model's is, uncommitted as the model's (a fresh model's, one made under
    `jax.default_device`, an abstract one naming no sharding), and committed
    where the model's is committed: every leaf in every case, with the values
    given."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (run through tests/test_multidevice.py)")
    d0, d1 = jax.devices()[:2]
    with jax.default_device(d1):
        net = Net(jax.random.key(0))
    sd = {
        k: jax.device_put(jnp.asarray(v) + 1, d0) for k, v in es.state_dict(net).items()
    }
    committed = jax.tree.map(
        lambda x: jax.device_put(x, d1) if eqx.is_array(x) else x, net
    )
    for model, want in [
        (net, (False, d1)),
        (eqx.filter_eval_shape(lambda: Net(jax.random.key(0))), (False, d0)),
        (committed, (True, d1)),
        (es.to_refs(net), (False, d1)),
    ]:
        loaded = es.load_state_dict(model, sd)
        assert _placements(loaded) == {want}
        got = es.state_dict(loaded)
        for k, v in sd.items():
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v))
