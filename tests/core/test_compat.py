"""Every JAX internal that eqx_state uses lives in `eqx_state/_compat.py`. These
tests check each one against the installed JAX, so that an upgrade that moves or
changes one fails here, loudly, instead of somewhere inside a training step."""

import copy
import functools
import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_state as es
from eqx_state import _compat


PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "eqx_state"


def test_no_private_jax_outside_the_compat_module():
    # `jax.core` too: its `Tracer` is public, but the package names it in one place
    # (`_compat.Tracer`), as JAX moves the rest of `jax.core` out of the public API
    pattern = re.compile(
        r"jax\._src|jax\.core|from jax import core|_refs\._buf|equinox\._|"
        r"from equinox import _"
    )
    offenders = [
        f"{p.relative_to(PACKAGE)}:{i}"
        for p in PACKAGE.rglob("*.py")
        if p.name != "_compat.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


def test_ref_types_include_views():
    assert jax.Ref in _compat.REF_TYPES
    assert len(_compat.REF_TYPES) == 2, "TransformedRef moved: update _compat.py"

    @jax.jit
    def f(x):
        r = jax.new_ref(x)
        view = r.at[0]
        assert isinstance(view, _compat.REF_TYPES)
        assert not isinstance(view, jax.Array)
        view[...] = view[...] + 1.0
        return jax.freeze(r)

    assert f(jnp.zeros((2, 3))).tolist() == [[1.0] * 3, [0.0] * 3]


def test_is_batched_sees_vmapped_values_only():
    seen = []
    jax.vmap(lambda x: seen.append(_compat.is_batched(x)) or x)(jnp.ones((2, 3)))
    assert seen == [True]
    assert not _compat.is_batched(jnp.ones(3))
    assert _compat._BatchTracer is not None, "BatchTracer moved: update _compat.py"


@pytest.mark.parametrize("wrap", ["checkpoint", "scan"])
def test_is_unmapped_ref_write_recognises_jaxs_refusal(wrap):
    """JAX refuses a vmapped write into an unmapped ref with a bare `Exception`;
    inside `jax.checkpoint` or `lax.scan` it comes from their batching rule, so
    only its text names it. If JAX changes the text, this fails: update
    `_compat.is_unmapped_ref_write`."""
    ref = jax.new_ref(jnp.zeros(()))

    def write(x):
        ref[...] = x
        return x

    if wrap == "checkpoint":
        body = jax.checkpoint(write)
    else:

        def body(x):
            return jax.lax.scan(lambda c, z: (c, write(z)), 0, x[None])[1][0]

    with pytest.raises(Exception) as info:
        jax.vmap(body)(jnp.ones(3))
    assert _compat.is_unmapped_ref_write(info.value), repr(info.value)
    assert not _compat.is_unmapped_ref_write(Exception("another error"))


def test_only_vmapped_tells_vmap_from_differentiation_and_jit():
    seen = {}

    def probe(name):
        def f(x):
            seen[name] = _compat.only_vmapped()
            return x

        return f

    probe("eager")(1.0)
    jax.vmap(probe("vmap"))(jnp.ones(2))
    jax.vmap(jax.vmap(probe("vmap of vmap")))(jnp.ones((2, 2)))
    jax.grad(probe("grad"))(1.0)
    jax.linearize(probe("linearize"), 1.0)
    jax.vmap(jax.grad(probe("vmap of grad")))(jnp.ones(2))
    jax.grad(lambda x: jax.vmap(probe("grad of vmap"))(x).sum())(jnp.ones(2))
    jax.jit(probe("jit"))(1.0)
    assert seen == {
        "eager": True,
        "vmap": True,
        "vmap of vmap": True,
        "grad": False,
        "linearize": False,
        "vmap of grad": False,
        "grad of vmap": False,
        "jit": False,
    }, "JAX's traces changed: update _compat.only_vmapped"


def test_mapped_by_same_vmap_tells_the_inner_vmap_from_an_outer_one():
    seen = {}

    def outer(w):
        def inner(x):
            seen["per example"] = _compat.mapped_by_same_vmap(x * w, x)
            seen["per member only"] = _compat.mapped_by_same_vmap(w, x)
            seen["reduced"] = _compat.mapped_by_same_vmap(jax.lax.psum(x, "i"), x)
            seen["unbatched like"] = _compat.mapped_by_same_vmap(x, w + 0.0 * w)
            return x

        return jax.vmap(inner, axis_name="i")(jnp.ones(3))

    jax.vmap(outer)(jnp.ones(2))
    assert seen == {
        "per example": True,
        "per member only": False,
        "reduced": False,
        "unbatched like": False,
    }, "JAX's batch tracers changed: update _compat.mapped_by_same_vmap"


def test_differentiation_trace_sees_grad_jvp_and_linearize_through_vmap():
    seen = {}

    def probe(name):
        def f(x):
            seen[name] = _compat.differentiation_trace(x) is not None
            return jnp.sum(x * x)

        return f

    x = jnp.ones(2)
    probe("eager")(x)
    jax.grad(probe("grad"))(x)
    jax.jvp(probe("jvp"), (x,), (x,))
    jax.linearize(probe("linearize"), x)
    jax.grad(lambda x: jax.vmap(probe("grad of vmap"))(x[:, None]).sum())(x)
    jax.vmap(jax.grad(probe("vmap of grad")))(x[:, None])
    jax.vmap(probe("vmap"))(x)
    jax.jit(probe("jit"))(x)
    jax.grad(lambda x: probe("a constant under grad")(jnp.ones(2)) + x)(1.0)
    assert seen == {
        "eager": False,
        "grad": True,
        "jvp": True,
        "linearize": True,
        "grad of vmap": True,
        "vmap of grad": True,
        "vmap": False,
        "jit": False,
        "a constant under grad": False,
    }, "JAX's differentiation tracers changed: update _compat.differentiation_trace"


def test_unbatched_finds_the_ref_every_vmap_call_maps():
    ref = jax.new_ref(jnp.zeros((2, 3)))
    seen = []
    for _ in range(2):
        jax.vmap(lambda r: seen.append(_compat.unbatched(r)) or 0)(ref)
    assert seen[0] is ref and seen[1] is ref, "JAX's batch tracers changed"


def test_is_escaped_ref_error_tells_a_ref_from_an_array():
    kept = []
    jax.jit(lambda x: kept.append((jax.new_ref(x), x)) or x)(jnp.ones(2))
    ref, array = kept[0]
    errors = []
    for value in (ref, array):
        try:
            value[...] if value is ref else value + 1
        except jax.errors.UnexpectedTracerError as e:
            errors.append(_compat.is_escaped_ref_error(e))
    assert errors == [True, False], "JAX's escaped-tracer message changed"


def test_ref_is_consumed_reads_a_deleted_buffer():
    r = jax.new_ref(jnp.ones(3))
    assert not _compat.ref_is_consumed(r)
    buf = r._refs._buf  # the layout `_compat.ref_is_consumed` reads
    buf.delete()
    assert _compat.ref_is_consumed(r)
    assert not _compat.ref_is_consumed(jnp.ones(3))


def test_equinox_runtime_error_is_recognised():
    @jax.jit
    def f(x):
        return eqx.error_if(x, x > 0, "positive!")

    with pytest.raises(Exception) as info:  # noqa: B017 -- whatever JAX raises
        jax.block_until_ready(f(jnp.ones(())))
    err = _compat.equinox_runtime_error(info.value)
    assert isinstance(err, eqx.EquinoxRuntimeError) and "positive!" in str(err)
    assert _compat.equinox_runtime_error(ValueError("unrelated")) is None


_CALLBACK_SCRIPT = """
import equinox as eqx, jax, jax.numpy as jnp, optax, sys
import eqx_state as es

try:  # a bare jax.jit: JAX logs the failed callback (with Equinox's banner)
    jax.block_until_ready(jax.jit(lambda x: eqx.error_if(x, x > 0, "positive!"))(
        jnp.ones(2)))
except Exception:
    pass
sys.stderr.write("-- step --\\n")
sys.stderr.flush()
model = eqx.nn.Linear(2, 2, key=jax.random.key(0))
step = es.make_step(
    lambda m, x: jnp.sum(m(eqx.error_if(x, x > 0, "positive!")) ** 2), optax.sgd(0.1)
)
try:
    step(model, step.init(model), jnp.ones(2))
except eqx.EquinoxRuntimeError as e:
    print("raised:", str(e).strip())
"""


def test_a_fired_error_if_is_logged_on_jaxs_callback_logger_outside_our_calls_only(
    tmp_path,
):
    """JAX logs a failed `pure_callback` (a fired `eqx.error_if`) on
    `_compat.CALLBACK_LOGGER` with `CALLBACK_FAILED`, from the calling thread: under
    a bare `jax.jit` it is still logged (Equinox's banner, meant for that case),
    while a step, which raises Equinox's error itself, logs nothing (the banner
    told the user to wrap the step in `eqx.filter_jit`). A fresh process: a program
    loaded from the tests' compilation cache runs its callback without that log."""
    import subprocess
    import sys

    script = tmp_path / "callback.py"
    script.write_text(_CALLBACK_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "raised: positive!", out.stdout
    bare, _, in_step = out.stderr.partition("-- step --")
    assert _compat.CALLBACK_FAILED in bare, "JAX's log moved: update _compat.py"
    assert "equinox.filter_jit" in bare  # Equinox's banner, under a bare jax.jit
    assert _compat.CALLBACK_FAILED not in in_step, in_step[-2000:]
    assert "equinox.filter_jit" not in in_step


def test_ref_buffer_is_the_array_jax_passes_and_replaces():
    r = jax.new_ref(jnp.zeros(3))
    assert _compat.is_concrete_ref(r)
    assert not _compat.is_concrete_ref(jnp.zeros(3))
    snapshot = r[...]  # a copy: stays valid when the buffer is donated
    buf = _compat.ref_buffer(r)
    assert isinstance(buf, jax.Array) and buf.tolist() == [0.0] * 3
    # what a ref-mode step does: the ref's array into a donating call, the output
    # put back into the same ref; the ref then reads it, eagerly and under jit
    new = jax.jit(lambda a: a + 1.0, donate_argnums=0)(buf)
    _compat.set_ref_buffer(r, new)
    assert r[...].tolist() == [1.0] * 3
    assert jax.jit(lambda ref: ref[...] * 2)(r).tolist() == [2.0] * 3
    assert snapshot.tolist() == [0.0] * 3
    # and JAX's own write-back of a jitted ref argument goes through the same array
    jax.jit(lambda ref: ref.__setitem__(Ellipsis, ref[...] + 1.0))(r)
    assert _compat.ref_buffer(r).tolist() == [2.0] * 3
    # a copy of the ref (`Ref` objects sharing its `ArrayRefImpl`) sees the new
    # array: what `set_ref_buffer` relies on
    twin = copy.copy(r)
    new = jax.jit(lambda a: a * 3.0, donate_argnums=0)(_compat.ref_buffer(r))
    _compat.set_ref_buffers([r], [new])
    assert twin[...].tolist() == [6.0] * 3
    assert _compat.ref_buffers([r, twin]) == [new, new]
    # so a copy is the same state (`ref_identity`, what the shared-ref check
    # compares), and another ref of the same value is not
    assert twin is not r and _compat.ref_identity(twin) == _compat.ref_identity(r)
    assert _compat.ref_identity(jax.new_ref(new)) != _compat.ref_identity(r)


def test_ref_value_copy_reads_as_jax_reads():
    """`ref_value_copy` reads a ref's declared type (`jax.typeof(ref).inner_aval`)
    and copies its array: the value, type and placement of JAX's eager read
    (strong for a strongly declared ref, whatever its array holds), without
    committing the ref's array (JAX's read does)."""
    r = jax.new_ref(jnp.zeros((), jnp.int32))
    assert _compat.declared_weak(r) is False
    twin = jax.new_ref(jnp.zeros((), jnp.int32))
    _compat.set_ref_buffer(r, jnp.asarray(7))  # a weakly typed array
    twin[...] = 7
    assert _compat.ref_buffer(r).weak_type
    got = _compat.ref_value_copy(r)
    assert got is not None and jax.typeof(got) == jax.typeof(twin[...])
    assert got.tolist() == 7 and not got.weak_type
    fresh = jax.new_ref(jnp.arange(3.0))
    copy = _compat.ref_value_copy(fresh)
    assert copy is not None and copy.tolist() == [0.0, 1.0, 2.0]
    assert not _compat.ref_buffer(fresh).committed and not copy.committed
    assert copy is not _compat.ref_buffer(fresh)
    # a strong array cannot be made weak with public JAX: None, read the ref then
    assert _compat.array_copy(jnp.zeros(2), weak=True) is None
    assert _compat.declared_weak(jax.new_ref(jnp.asarray(1.0)))
    # a PRNG key array (an RngState cell's) is copied as it is
    key = jax.new_ref(jax.random.key(3))
    got = _compat.ref_value_copy(key)
    assert got is not None and jax.typeof(got) == jax.typeof(key[...])
    assert (jax.random.key_data(got) == jax.random.key_data(key[...])).all()


def test_committed_flag_is_the_public_one():
    """`any_committed` reads JAX's private `_committed` (the property's field)."""
    fresh = jnp.zeros(3)
    placed = jax.device_put(jnp.zeros(3), jax.devices()[0])
    assert fresh.committed is False and placed.committed is True
    assert not _compat.any_committed([fresh, fresh])
    assert _compat.any_committed([fresh, placed])
    # JAX counts a ref as committed: a call taking one commits its outputs
    r = jax.new_ref(jnp.zeros(3))
    assert not _compat.ref_buffer(r).committed
    assert jax.jit(lambda ref, x: x + ref[...])(r, fresh).committed


def test_deleted_array_error_is_recognised():
    x = jnp.ones(3)
    x.delete()
    with pytest.raises(Exception) as info:  # noqa: B017 -- whatever JAX raises
        jax.jit(lambda a: a + 1)(x)
    assert _compat.is_deleted_array_error(info.value)
    assert not _compat.is_deleted_array_error(ValueError("unrelated"))


def test_under_trace_tells_an_outer_transformation_from_eager_code():
    assert _compat._trace_ctx is not None, "trace_ctx moved: update _compat.py"
    assert not _compat.under_trace()
    seen = []

    def probe(x):
        seen.append(_compat.under_trace())
        return x

    jax.jit(probe)(1.0)
    jax.vmap(probe)(jnp.ones(2))
    jax.grad(probe)(1.0)
    jax.lax.fori_loop(0, 2, lambda i, c: probe(c), 0.0)
    assert seen == [True] * 4
    assert not _compat.under_trace()


def test_jit_body_is_the_function_filter_jit_wraps():
    def f(x):
        return x + 1

    assert _compat.jit_body(eqx.filter_jit(f)) is f
    assert _compat.jit_body(f) is f
    wrapped = jax.jit(f)
    assert _compat.jit_body(wrapped) is wrapped

    class Trainer:
        @eqx.filter_jit
        def loss(self, x):
            return x * 2

    bound = _compat.jit_body(Trainer().loss)  # Equinox binds it in an eqx.Partial
    assert isinstance(bound, eqx.Partial) and bound.func is Trainer.loss.__wrapped__
    assert bound(3) == 6
    # nested, and given some of its arguments
    assert _compat.jit_body(eqx.filter_jit(eqx.filter_jit(f))) is f
    part = _compat.jit_body(functools.partial(eqx.filter_jit(f), 2))
    assert isinstance(part, functools.partial) and part.func is f and part() == 3


def test_is_ref_in_filtered_transform_recognises_jaxs_errors():
    seen = []

    @jax.jit
    def run(x):
        ref = jax.new_ref(x)
        try:  # a user's array method on a raw ref: not Equinox's
            ref.mean()  # pyright: ignore
        except AttributeError as e:
            assert not _compat.is_ref_in_filtered_transform(e)
        else:
            raise AssertionError("a ref has no `mean`")
        for transform in (eqx.filter_jit, eqx.filter_closure_convert):
            try:
                if transform is eqx.filter_jit:
                    eqx.filter_jit(lambda r: r[...])(ref)
                else:
                    eqx.filter_closure_convert(lambda r: r[...], ref)(ref)
            except Exception as e:  # noqa: BLE001 -- whatever JAX raises
                seen.append(e)
        return x

    run(jnp.ones(3))
    assert len(seen) == 2
    assert all(_compat.is_ref_in_filtered_transform(e) for e in seen)
    assert not _compat.is_ref_in_filtered_transform(
        ValueError("Non-hashable static arguments are not supported: a list")
    )
    assert not _compat.is_ref_in_filtered_transform(AttributeError("no attribute"))


def _aligned(n):
    """A float32 NumPy array whose buffer is page aligned (JAX shares such buffers)."""
    buf = np.empty(n * 4 + 4096, np.uint8)
    off = (-buf.ctypes.data) % 4096
    out = buf[off : off + n * 4].view(np.float32)
    out[...] = 1.0
    return out


def test_numpy_inputs_are_not_shared_with_jax_arrays():
    """jax-ml/jax#37830: `device_put` onto a device (with `may_alias=False` too)
    may make a NumPy array's buffer the JAX array's own, so the caller's later
    change reaches it. `private_numpy_copy` is what the library gives JAX instead
    (`es.global_batch`, `es.from_orbax`, every runner): never shared, in native
    byte order, a masked array kept masked."""
    x = _aligned(1024)
    copy = _compat.private_numpy_copy(x)
    assert not np.shares_memory(copy, x) and np.array_equal(copy, x)
    big = np.arange(3, dtype=">f4")
    assert _compat.private_numpy_copy(big).dtype.isnative
    masked = np.ma.masked_array([1.0, 2.0], mask=[0, 1])
    assert isinstance(_compat.private_numpy_copy(masked), np.ma.MaskedArray)
    # the library's own NumPy-to-JAX paths
    mesh = jax.make_mesh((1,), ("data",))
    g = es.global_batch(x.reshape(64, 16), mesh)
    bn = es.nn.BatchNorm(1024)
    saved = jax.tree.map(np.asarray, es.to_orbax(bn))
    saved = eqx.tree_at(lambda m: m.running_mean.value, saved, x)
    restored = es.from_orbax(saved, bn)
    x[...] = 0.0  # the caller refills its buffer
    assert float(jnp.sum(g)) == 1024.0
    assert float(jnp.sum(restored.running_mean[...])) == 1024.0


def test_trace_of_names_the_innermost_trace():
    """`KVCache.append` tells a second append under one `jit` or `vmap` trace by
    `trace_of` (JAX's `._trace`): if JAX renames it, this fails, not the check."""
    seen = []

    def f(x):
        y = x * 2
        seen.append((_compat.trace_of(x), _compat.trace_of(y)))
        return y

    jax.jit(f)(1.0)
    jax.vmap(f)(jnp.ones(2))
    for a, b in seen:
        assert a is not None and a is b
    assert seen[0][0] is not seen[1][0]
    assert _compat.trace_of(jnp.ones(2)) is None and _compat.trace_of(1.0) is None


def test_is_registered_node_type_reads_jaxs_registry():
    """A named tuple JAX unflattens with its built-in rule is not a registered
    node type; one registered with an unflatten of its own, an Equinox module
    and JAX's own containers are (what `_rebuild` relies on)."""
    from typing import NamedTuple

    class Plain(NamedTuple):
        x: object

    class Own(NamedTuple):
        x: object

    jax.tree_util.register_pytree_node(
        Own, lambda o: ((o.x,), None), lambda _, ch: Own._make(ch)
    )

    class M(eqx.Module):
        w: object

    assert _compat.is_registered_node_type(Plain) is False
    assert _compat.is_registered_node_type(Own) is True
    assert _compat.is_registered_node_type(M) is True
    assert _compat.is_registered_node_type(tuple) is True
