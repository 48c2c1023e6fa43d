"""State cells, the two storage modes, filters, and the errors users meet."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest

import eqx_state as es


class Twice(eqx.Module):
    a: es.Buffer
    b: es.Buffer
    lin: eqx.nn.Linear

    def __init__(self):
        cell = es.Buffer(jnp.zeros(2))
        self.a = cell
        self.b = cell  # one cell object at two places: two states (arrays are values)
        self.lin = eqx.nn.Linear(2, 2, key=jax.random.key(0))

    def __call__(self, x):
        self.a[...] = self.a[...] + 1.0
        return jax.vmap(self.lin)(x) + self.b[...]  # `b` is its own state: still 0


def test_params_excludes_state():
    model = Twice()
    p = es.params(model)
    assert p.a is None and p.b is None
    assert p.lin.weight is model.lin.weight
    assert es.is_state(model.a) and not es.is_state(model.lin.weight)
    n_state = sum(es.is_state(x) for x in jax.tree.leaves(model, is_leaf=es.is_state))
    assert n_state == 2


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_one_cell_at_two_places_is_two_states(mode):
    model = Twice()
    if mode == "ref":
        model = es.to_refs(model)
        assert model.a.value is not model.b.value  # one ref per place
    x = jnp.ones((3, 2))
    out, model = es.apply(lambda m, x: m(x), model, x)
    out, model = es.apply(lambda m, x: m(x), model, x)
    np.testing.assert_array_equal(model.a[...], [2.0, 2.0])
    np.testing.assert_array_equal(model.b[...], [0.0, 0.0])
    np.testing.assert_allclose(out, jax.vmap(model.lin)(x))
    step = es.make_step(lambda m, x: jnp.sum(m(x)), optax.sgd(0.1))
    opt_state = step.init(model)
    model, opt_state = step(model, opt_state, x)
    model, opt_state = step(model, opt_state, x)
    np.testing.assert_array_equal(model.a[...], [4.0, 4.0])
    np.testing.assert_array_equal(model.b[...], [0.0, 0.0])
    assert step.trace_count == 1


def test_to_refs_and_freeze_round_trip():
    bn = es.nn.BatchNorm(3)
    bn_r = es.to_refs(bn)
    assert isinstance(bn_r.running_mean.value, jax.Ref)
    assert es.to_refs(bn_r).running_mean.value is bn_r.running_mean.value  # idempotent
    bn_r(jnp.arange(6.0).reshape(2, 3))
    snap = es.freeze(bn_r)
    assert isinstance(snap.running_mean.value, jax.Array)
    np.testing.assert_allclose(snap.running_mean[...], [0.15, 0.25, 0.35], rtol=1e-6)
    bn_r(jnp.arange(6.0).reshape(2, 3))  # later writes do not change the snapshot
    np.testing.assert_allclose(snap.running_mean[...], [0.15, 0.25, 0.35], rtol=1e-6)
    assert int(bn_r.num_batches_tracked[...]) == 2


def test_writes_carry_no_gradient():
    class Probe(eqx.Module):
        w: jax.Array
        seen: es.Buffer

        def __call__(self, x):
            y = self.w * x
            self.seen[...] = y  # a differentiated value written into state
            return jnp.sum(y**2)

    model = Probe(jnp.array(3.0), es.Buffer(jnp.zeros(2)))
    step = es.make_step(lambda m, x: m(x), optax.sgd(0.1))
    model, _ = step(model, step.init(model), jnp.array([1.0, 2.0]))
    np.testing.assert_allclose(model.seen[...], [3.0, 6.0])  # the value, not a tangent
    # d/dw sum(w^2 x^2) = 2 w sum(x^2) = 30: w = 3 - 0.1 * 30 = 0
    np.testing.assert_allclose(model.w, 0.0, atol=1e-6)


def test_value_mode_write_outside_a_step_names_the_fixes():
    bn = es.nn.BatchNorm(3)
    with pytest.raises(es.StateWriteError, match=r"es\.apply|eqx_state\.apply") as e:
        bn(jnp.ones((4, 3)))
    msg = str(e.value)
    assert "make_step" in msg and "to_refs" in msg and "inference_mode" in msg
    # the same inside the user's own jit
    with pytest.raises(es.StateWriteError, match="value mode and no step is running"):
        eqx.filter_jit(lambda m, x: m(x))(bn, jnp.ones((4, 3)))
    # evaluation needs no step
    y = eqx.nn.inference_mode(bn)(jnp.ones((4, 3)))
    assert y.shape == (4, 3)


def test_wrong_shape_or_dtype_write():
    cell = es.to_refs(es.Buffer(jnp.zeros(3)))
    with pytest.raises(
        es.StateWriteError, match=r"shape \(4,\) into the Buffer cell \(shape \(3,\)\)"
    ):
        cell[...] = jnp.zeros(4)
    with pytest.raises(
        es.StateWriteError, match="dtype int32 into the Buffer cell .* of dtype float32"
    ):
        cell[...] = jnp.zeros(3, jnp.int32)
    cell[...] = jnp.ones(3)
    cell[1] = 5.0  # weakly typed Python scalars are cast; indexed writes work
    np.testing.assert_array_equal(cell[...], [1.0, 5.0, 1.0])


class _Writer(eqx.Module):
    buf: es.Buffer

    def __call__(self, x):
        self.buf[...] = x


class _Deep(eqx.Module):
    blocks: list


def test_an_eager_ref_mode_error_names_the_cells_path(tmp_path):
    """Outside a step or an apply (an eager call of a ref-mode model) an error
    about a cell names the cell's path when `es.to_refs` last converted a model
    holding it, as errors inside a step name it; a ref-mode model loaded from a
    checkpoint keeps the names, a model converted again (in value or ref mode)
    renames them, and the names go with the refs."""
    import gc

    from eqx_state import _buffer

    def deep():
        return _Deep([_Writer(es.Buffer(jnp.zeros(3))) for _ in range(2)])

    model = es.to_refs(deep())
    named = r"Buffer cell at `model\.blocks\[1\]\.buf` \(ref mode; its path when `es\.to_refs` last"
    with pytest.raises(es.StateWriteError, match=named + r".*\(shape \(3,\)\)"):
        model.blocks[1](jnp.ones(4))
    np.testing.assert_array_equal(model.blocks[1].buf[...], np.zeros(3))
    # inside a step, the step's own name wins (the same path, named by the call)
    with pytest.raises(es.StateWriteError, match=r"at `model\.blocks\[1\]\.buf` \(ref"):
        es.apply(lambda m, x: m.blocks[1](x), model, jnp.ones(4))
    # a checkpoint loaded into the ref-mode model: new refs, the same names
    es.save(tmp_path / "m.eqx", model)
    loaded = es.load(tmp_path / "m.eqx", model)
    assert loaded.blocks[1].buf.value is not model.blocks[1].buf.value
    with pytest.raises(es.StateWriteError, match=named):
        loaded.blocks[1](jnp.ones(4))
    # converted again as part of another model, in value mode or still in ref
    # mode (its refs kept): named as there
    outer = es.to_refs({"head": es.freeze(model).blocks[0]})
    with pytest.raises(es.StateWriteError, match=r"at `model\['head'\]\.buf`"):
        outer["head"](jnp.ones(4))
    again = es.to_refs({"head": model.blocks[0]})
    assert again["head"].buf.value is model.blocks[0].buf.value
    with pytest.raises(es.StateWriteError, match=r"at `model\['head'\]\.buf`"):
        again["head"](jnp.ones(4))
    # a cell converted alone names no path (it is the whole model)
    cell = es.to_refs(es.Buffer(jnp.zeros(3)))
    with pytest.raises(es.StateWriteError, match=r"into the Buffer cell \(shape"):
        cell[...] = jnp.zeros(4)
    # the names go with their refs
    del model, loaded, outer, cell
    gc.collect()
    before = len(_buffer._ORIGINS)
    for _ in range(20):
        es.to_refs(deep())
    gc.collect()
    assert len(_buffer._ORIGINS) == before


# Indices a cell takes, and what NumPy does with them on a (3, 4) array: the
# reference for a cell's indexing (JAX's arrays clamp an out-of-range read and drop
# such a write; a ref lands it in another slot).
_INDICES = [
    1,
    -1,
    (2, -4),
    (slice(0, 2), 3),
    (Ellipsis, 1),
    np.array([0, 2]),
    (np.array([0, 2]), np.array([1, 3])),
    (slice(None), jnp.array([3, 0])),
    np.int64(2),
    -4,
    3,
    (0, 4),
    (1, -5),
    np.array([0, 3]),
    # slice bounds that are concrete 0-d integers (`i = jnp.argmax(...)`) or True
    slice(jnp.int32(1), None),
    (slice(np.array(1), 3), 0),
    slice(True, None),
]


@pytest.mark.parametrize("where", ["ref mode", "es.apply", "make_apply"])
@pytest.mark.parametrize("idx", _INDICES, ids=repr)
@pytest.mark.split
def test_indexed_reads_and_writes_follow_numpy(idx, where):
    start = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    want = start.copy()
    try:
        part = np.array(want[idx])  # a copy, not a view
    except IndexError:
        part = None  # NumPy refuses the index: so must the cell, on read and write
    new = (
        None
        if part is None
        else -np.arange(part.size, dtype=np.float32).reshape(part.shape)
    )
    if part is not None:
        want[idx] = new

    def rw(cell):
        read = cell[idx]
        cell[idx] = jnp.asarray(new)
        return read

    cell = es.Buffer(jnp.asarray(start))
    if where == "ref mode":
        cell = es.to_refs(cell)
        run = lambda: (rw(cell), cell)  # noqa: E731
    elif where == "es.apply":
        run = lambda: es.apply(rw, cell)  # noqa: E731
    else:
        run = lambda: es.make_apply(rw)(cell)  # noqa: E731
    if part is None:
        with pytest.raises(IndexError, match=r"out of bounds.*\[-n, n\)") as info:
            run()
        assert isinstance(info.value, es.EqxStateError)
        if where == "ref mode":
            np.testing.assert_array_equal(cell[...], start)  # nothing written
        return
    read, cell = run()
    np.testing.assert_array_equal(read, part)
    np.testing.assert_array_equal(cell[...], want)


@pytest.mark.parametrize(
    "idx, hint",
    [
        # NumPy and `jnp` refuse a float index; a ref would truncate it to a slot
        (1.5, "astype"),
        ((0, 2.0), "astype"),
        (np.array([0.0, 1.0]), "astype"),
        # a ref reads a mask as the slots 0 and 1, and refuses a new axis
        (np.array([True, False, True]), "jnp.where"),
        (jnp.array([True, False, True]), "jnp.where"),
        (True, "jnp.where"),
        ((None, 0), r"cell\[i\]\[None\]"),
        # `jnp` and a ref refuse a list (NumPy's index array), each with its own
        # error; a string or a slice of strings is no index at all
        ([0, 1], r"jnp.asarray\(\[0, 1\]\)"),
        ("a", "integers, slices"),
        ((0, "a"), "integers, slices"),
        (slice("a", None), "bounds are integers or None"),
        # JAX's refs take positive steps only (its bare ValueError before)
        (slice(None, None, -1), r"positive step.*\[::-1\]"),
        ((0, [1, 2]), r"jnp.asarray\(\[1, 2\]\)"),
    ],
    ids=repr,
)
@pytest.mark.parametrize("mode", ["value", "ref"])
def test_an_index_a_ref_cannot_take_is_refused_on_read_and_write(idx, hint, mode):
    start = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    cell = es.Buffer(jnp.asarray(start))
    if mode == "ref":
        cell = es.to_refs(cell)
    if mode == "value" and hint in (
        "jnp.where",
        r"cell\[i\]\[None\]",
        r"positive step.*\[::-1\]",
        r"jnp.asarray\(\[1, 2\]\)",
    ):
        # a value-mode read is an array's read: a mask or a new axis as NumPy
        np.testing.assert_array_equal(cell[idx], start[idx])
    else:
        with pytest.raises((TypeError, ValueError), match=hint) as info:
            cell[idx]
        assert isinstance(info.value, es.EqxStateError)
    write = lambda c: c.__setitem__(idx, jnp.ones(()))  # noqa: E731
    with pytest.raises((TypeError, ValueError), match=hint):  # a write: to a ref
        write(cell) if mode == "ref" else es.apply(write, cell)
    np.testing.assert_array_equal(cell[...], start)


def test_a_cell_of_a_symbolic_shape_is_indexed_as_jax_indexes_it():
    """`jax.export` with a symbolic batch: the index check stands aside."""
    f = jax.jit(lambda x: es.Buffer(x)[0] + es.Buffer(x)[1:, 0].sum())
    (n,) = jax.export.symbolic_shape("n")
    exported = jax.export.export(f)(jax.ShapeDtypeStruct((n, 4), jnp.float32))
    x = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    np.testing.assert_allclose(exported.call(x), x[0] + x[1:, 0].sum())


def test_an_indexed_write_of_another_shape_names_the_part_and_the_cell():
    cell = es.to_refs(es.Buffer(jnp.zeros((3, 2))))
    for idx, value, part in [
        (0, jnp.ones(4), r"\(2,\)"),
        (slice(0, 2), jnp.ones(2), r"\(2, 2\)"),
        (slice(0, 2), 1.0, r"\(2, 2\)"),  # no broadcasting, as for `cell[...]`
    ]:
        with pytest.raises(es.StateWriteError, match=f"that part has shape {part}"):
            cell[idx] = value
    np.testing.assert_array_equal(cell[...], np.zeros((3, 2)))
    # inside a call, the message names the cell's path
    bn = es.nn.BatchNorm(3)
    with pytest.raises(es.StateWriteError, match="running_mean"):
        es.apply(lambda m: m.running_mean.__setitem__(0, jnp.ones(2)), bn)


def test_a_traced_integer_index_is_checked_for_its_shape_only():
    """A traced index's values are unknown while tracing: JAX has the last word on
    them; its shape still fixes the part's shape."""
    cell = es.Buffer(jnp.arange(4.0))

    def f(c, i):
        c[i] = c[i] * 10.0
        return c[i]

    out, cell = es.make_apply(f)(cell, jnp.array([1, 3]))
    np.testing.assert_array_equal(out, [10.0, 30.0])
    np.testing.assert_array_equal(cell[...], [0.0, 10.0, 2.0, 30.0])
    with pytest.raises(es.StateWriteError, match=r"that part has shape \(2,\)"):
        es.make_apply(lambda c, i: c.__setitem__(i, jnp.ones(3)))(
            cell, jnp.array([0, 1])
        )


def test_stale_model_after_donation_names_donate_false():
    model = es.nn.BatchNorm(3)
    step = es.make_step(lambda m, x: jnp.sum(m(x) ** 2), optax.adam(1e-3))
    opt_state = step.init(model)
    x = jnp.ones((4, 3))
    new_model, new_opt_state = step(model, opt_state, x)
    with pytest.raises(es.StaleModelError, match="donate=False"):
        step(model, opt_state, x)
    with pytest.raises(es.StaleModelError, match="donated"):
        eqx.nn.inference_mode(model)(x)
    with pytest.raises(es.StaleModelError, match="donate=False"):
        es.to_refs(model)
    # the returned model is fine, and donate=False keeps old models valid
    step2 = es.make_step(
        lambda m, x: jnp.sum(m(x) ** 2), optax.adam(1e-3), donate=False
    )
    m2, s2 = step2(new_model, new_opt_state, x)
    m3, _ = step2(new_model, new_opt_state, x)
    np.testing.assert_array_equal(m2.running_mean[...], m3.running_mean[...])


def test_vmap_of_unbatched_ref_write_is_a_clear_error():
    bn = es.to_refs(es.nn.BatchNorm(3))
    xs = jnp.ones((2, 4, 3))
    with pytest.raises(es.StateWriteError, match="inside `jax.vmap`"):
        jax.vmap(lambda x: bn(x))(xs)
    # `jacfwd` maps with `vmap` too: the message says so and names `jacrev`
    with pytest.raises(es.StateWriteError, match=r"`jax\.jacfwd`.*`jax\.jacrev`"):
        jax.jacfwd(lambda x: bn(x).sum())(xs[0])


def test_loss_must_be_scalar_and_aux_a_pair():
    model = es.nn.BatchNorm(3)
    x = jnp.ones((4, 3))
    step = es.make_step(lambda m, x: m(x), optax.sgd(0.1))
    with pytest.raises(es.StepError, match="must return a scalar loss"):
        step(model, step.init(model), x)
    step = es.make_step(lambda m, x: jnp.sum(m(x)), optax.sgd(0.1), has_aux=True)
    with pytest.raises(es.StepError, match=r"return a pair `\(loss, aux\)`"):
        step(model, step.init(model), x)
    # `(loss, aux)` without `has_aux=True`: a tracer-conversion error from
    # `jnp.shape` of the pair, with no word of `has_aux`
    step = es.make_step(lambda m, x: (jnp.sum(m(x)), {"n": 1.0}), optax.sgd(0.1))
    with pytest.raises(es.StepError, match=r"got a tuple of 2.*`has_aux=True`"):
        step(model, step.init(model), x)
    step = es.make_step(lambda m, x: {"loss": jnp.sum(m(x))}, optax.sgd(0.1))
    with pytest.raises(es.StepError, match=r"scalar loss, got a dict\.\n"):
        step(model, step.init(model), x)
    assert int(model.num_batches_tracked[...]) == 0  # the model is intact


def test_one_parameter_array_at_two_places_is_two_parameters():
    """As in Equinox: the same array at two places is two copies that train
    independently. The reference is the plain `eqx.filter_jit` + optax loop."""
    w = jnp.array([1.0, 2.0])

    class Two(eqx.Module):
        a: jax.Array
        b: jax.Array

    def loss(m):
        return jnp.sum(m.a * m.a) + 3.0 * jnp.sum(m.b)

    opt = optax.sgd(0.1)
    ref_model = Two(jnp.copy(w), jnp.copy(w))
    ref_state = opt.init(ref_model)
    step = es.make_step(loss, opt)
    model = Two(w, w)  # donated by the step: `w` is consumed
    opt_state = step.init(model)

    @eqx.filter_jit
    def ref_step(m, s):
        g = eqx.filter_grad(loss)(m)
        u, s = opt.update(g, s, m)
        return eqx.apply_updates(m, u), s

    for _ in range(3):
        model, opt_state = step(model, opt_state)
        ref_model, ref_state = ref_step(ref_model, ref_state)
    np.testing.assert_allclose(model.a, ref_model.a, rtol=1e-6)
    np.testing.assert_allclose(model.b, ref_model.b, rtol=1e-6)
    assert not np.allclose(model.a, model.b)


def test_apply_in_ref_mode_returns_the_same_refs():
    counter = es.to_refs(es.nn.Counter())
    out, same = es.apply(lambda c: c.increment(), counter)
    assert int(out) == 1 and same.count.value is counter.count.value


def test_apply_is_pure_in_value_mode_and_jits():
    counter = es.nn.Counter()
    run = eqx.filter_jit(lambda c: es.apply(lambda c: c.increment(), c))
    n1, c1 = run(counter)
    n2, c2 = run(c1)
    n1b, _ = run(counter)  # the old model is a valid snapshot
    assert (int(n1), int(n2), int(n1b)) == (1, 2, 1)
    assert int(counter.value) == 0


# -- host values a write converts ---------------------------------------------------


def _write_both_modes(cell, value):
    """Write `value` into `cell` eagerly in ref mode and inside `es.apply` in value
    mode; return the two cells' values afterwards (or raise)."""
    ref = es.to_refs(cell)
    ref[...] = value
    _, written = es.apply(lambda c: c.__setitem__(..., value), cell)
    return ref[...], written[...]


@pytest.mark.parametrize(
    "value",
    [np.int64(2**33 + 5), np.array(2**31, np.int64), 2**40, np.uint64(2**32)],
    ids=["np.int64", "array", "python-int", "np.uint64"],
)
def test_an_integer_that_does_not_fit_the_cell_is_refused_not_wrapped(value):
    """With 64-bit types off JAX keeps a NumPy int64 in int32, wrapping it (NumPy's
    own cast shows what was written: `np.int64(2**33 + 5)` became 5); now refused,
    naming the cell, in both modes, and the cell keeps its value."""
    assert np.int64(2**33 + 5).astype(np.int32) == 5  # the wrap that was written
    cell = es.CounterState(jnp.int32(3))
    ref = es.to_refs(cell)
    with pytest.raises(
        es.StateWriteError, match=r"CounterState cell.*does not fit u?int32"
    ):
        ref[...] = value
    assert int(ref[...]) == 3
    with pytest.raises(es.StateWriteError, match="does not fit u?int32"):
        es.apply(lambda c: c.__setitem__(..., value), cell)


def test_a_float_beyond_float32_is_refused_not_made_inf():
    cell = es.BatchStat(jnp.zeros(2))
    for value in (np.array([1e300, 1.0]), 1e300):
        with pytest.raises(es.StateWriteError, match="does not fit float32.*inf"):
            _write_both_modes(cell, value)
    # an infinity given is written (nothing is changed by the conversion)
    for got in _write_both_modes(cell, np.array([np.inf, 1.0])):
        np.testing.assert_array_equal(got, np.array([np.inf, 1.0], np.float32))


def test_host_values_that_fit_are_written_as_numpy_converts_them():
    for got in _write_both_modes(es.CounterState(jnp.int32(0)), np.int64(-7)):
        assert got.dtype == jnp.int32 and int(got) == -7
    x = np.array([0.1, 2.5e38], np.float64)  # rounded to float32, not refused
    for got in _write_both_modes(es.BatchStat(jnp.zeros(2)), x):
        np.testing.assert_array_equal(got, x.astype(np.float32))


@pytest.mark.parametrize("value", [None, "abc", [1.0, [2.0]], object()])
def test_a_value_that_is_not_numeric_is_refused_by_name(value):
    cell = es.to_refs(es.BatchStat(jnp.zeros(2)))
    with pytest.raises(es.StateWriteError, match="A write into the BatchStat cell"):
        cell[...] = value


def test_an_exact_widening_is_written_and_a_narrowing_refused():
    """A strongly-typed value of a narrower type of the same kind loses nothing
    (bfloat16 or float16 into float32, int8 into int32): written, equal to
    NumPy's float32 / int32 conversion of the same values. uint32 into int32, bool
    into int32 and bfloat16 into float16 (fewer exponent bits) are refused."""
    f32 = es.BatchStat(jnp.zeros(3))
    for dt in (jnp.bfloat16, jnp.float16):
        v = jnp.asarray([1.5, -2.25, 3e3], dt)
        for got in _write_both_modes(f32, v):
            assert got.dtype == jnp.float32
            np.testing.assert_array_equal(got, np.asarray(v).astype(np.float32))
    i32 = es.Buffer(jnp.zeros(3, jnp.int32))
    for got in _write_both_modes(i32, jnp.asarray([-128, 0, 127], jnp.int8)):
        np.testing.assert_array_equal(got, np.array([-128, 0, 127], np.int32))
    refused = [
        (i32, jnp.asarray([1, 2, 3], jnp.uint32)),
        (i32, jnp.ones(3, bool)),
        (es.Buffer(jnp.zeros(3, jnp.float16)), jnp.ones(3, jnp.bfloat16)),
        (f32, jnp.ones(3, jnp.int32)),
    ]
    for cell, v in refused:
        with pytest.raises(es.StateWriteError, match="state cells keep their dtype"):
            _write_both_modes(cell, v)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_a_cell_used_as_its_value_says_how_to_read_it(mode):
    """PyTorch's buffers are tensors, so `bn.num_batches_tracked == 0` and `if
    counter.count:` read the value there. A cell is not its value: the comparison
    was silently False, the truth test True and `np.asarray(cell)` an object array.
    Each now raises a `TypeError` of the library's naming the read (`cell[...]`),
    whose result is PyTorch's."""
    torch = pytest.importorskip("torch")
    bn = es.nn.BatchNorm(3)
    bn = es.to_refs(bn) if mode == "ref" else bn
    cell = bn.num_batches_tracked
    misuses = (
        lambda: cell == 0,
        lambda: 0 == cell,
        lambda: cell != 0,
        lambda: bool(cell),
        lambda: np.asarray(cell),
        lambda: cell == np.int64(0),
        lambda: cell == jnp.zeros(()),
    )
    for misuse in misuses:
        with pytest.raises(
            TypeError, match=r"read the value with `cell\[\.\.\.\]`"
        ) as e:
            misuse()
        assert isinstance(e.value, es.EqxStateError)
    want = torch.nn.BatchNorm1d(3).num_batches_tracked
    assert bool(cell[...] == 0) == bool(want == 0)
    assert np.asarray(cell[...]).tolist() == want.numpy().tolist()
    # what stays: a cell is not None, not a string, not array-like to Equinox's
    # filters (`eqx.filter(bn, eqx.is_array_like, is_leaf=es.is_state)` drops it),
    # and two cells compare as Equinox modules do
    assert (cell == None) is False  # noqa: E711
    assert (cell == "running_mean") is False
    assert cell not in (None, "x")
    assert not eqx.is_array_like(cell) and not eqx.is_inexact_array_like(cell)
    if mode == "value":  # (`in` compares by `==` once identity fails)
        assert cell == es.nn.BatchNorm(3).num_batches_tracked
        assert es.nn.BatchNorm(3).num_batches_tracked in [cell]


def test_a_list_of_jax_values_is_stacked_as_jnp_asarray_stacks_it(monkeypatch):
    """Review finding: the host-value check took a list of tracers (or of typed
    keys) to NumPy and refused it. JAX values in a list go to `jnp.asarray` as
    they did: a write, a cell's initial value and a metric input, under `jit`."""
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)  # a list

    class M(eqx.Module):
        c: es.Buffer

        def __call__(self, v):
            self.c[...] = v

    @eqx.filter_jit
    def run(a, b):
        _, m = es.apply(lambda m: m([a, b]), M(es.Buffer(jnp.zeros(2))))
        _, s = es.apply(lambda s: s.update([a, b]), es.metrics.Sum())
        return m.c[...], s.compute(), es.Buffer([a, b]).value

    written, total, initial = run(jnp.float32(1), jnp.float32(2))
    np.testing.assert_array_equal(written, np.array([1.0, 2.0], np.float32))
    np.testing.assert_array_equal(initial, np.array([1.0, 2.0], np.float32))
    assert float(total) == 3.0
    keys = es.Buffer([jax.random.key(0), jax.random.key(1)])
    assert keys.value.shape == (2,)


@pytest.mark.parametrize(
    "src, dst",
    [
        (jnp.float8_e4m3fn, jnp.float8_e4m3fnuz),
        (jnp.float8_e5m2fnuz, jnp.float8_e5m2),
        (jnp.float8_e4m3b11fnuz, jnp.float8_e4m3fn),
    ],
)
def test_float8_writes_of_another_float8_type_are_refused(src, dst):
    """Review finding: comparing exponent and mantissa bits took float8 types of
    other biases and inf/NaN rules as widenings (448 in e4m3fn written as NaN in
    e4m3fnuz). Only the IEEE-like types widen; NumPy's own cast of the values
    shows the change the refusal prevents."""
    # some value of `src` that `dst` does not hold (the casts show it)
    every = jnp.asarray(np.arange(256, dtype=np.uint8).view(jnp.dtype(src)))
    back = every.astype(dst).astype(src)
    same = (back == every) | (jnp.isnan(back) & jnp.isnan(every))
    assert not bool(jnp.all(same))
    cell = es.to_refs(es.Buffer(jnp.zeros(256, dst)))
    with pytest.raises(es.StateWriteError, match="state cells keep their dtype"):
        cell[...] = every


def test_a_bare_ref_at_two_places_is_not_state_of_the_model():
    """Review finding: the one shared-ref check, given a tree, also refused a bare
    ref (not in a cell) at two places, which `es.freeze` does not touch."""
    r = jax.new_ref(jnp.zeros(3))
    frozen = es.freeze({"a": r, "b": r})
    assert frozen["a"] is r and frozen["b"] is r


def test_eager_write_of_a_number_reads_back_as_jax_reads_its_ref():
    """A Python number written into a ref-mode cell outside a step reads back in
    the cell's own strong type, as JAX reads a ref it wrote the number into (the
    reference), so arithmetic with a narrow array promotes as it would with the
    array (a weakly typed read would give int8 and wrap 200 to -56). The cell's
    array stays uncommitted, as the step that takes it next expects."""
    from eqx_state import _compat

    c = es.to_refs(es.nn.Counter())
    c.count[...] = 100
    twin = jax.new_ref(jnp.zeros((), jnp.int32))
    twin[...] = 100
    got, want = c.count[...], twin[...]
    assert jax.typeof(got) == jax.typeof(want) == jax.typeof(jnp.int32(0))
    assert (got + jnp.int8(100)).dtype == (want + jnp.int8(100)).dtype == jnp.int32
    assert int(got + jnp.int8(100)) == int(want + jnp.int8(100)) == 200
    buf = _compat.ref_buffer(c.count.value)
    assert not buf.committed and not buf.weak_type
    # a snapshot through the checkpoint path reads it the same way
    np.testing.assert_array_equal(es.freeze(c).count[...], 100)
    assert not _compat.ref_buffer(c.count.value).committed
