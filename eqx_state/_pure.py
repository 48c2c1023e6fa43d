"""The pure functions that `make_step` and `make_apply` compile.

Read `train_step` top to bottom: it is the whole training step. Everything about how
it reaches XLA (what is traced, donated, cached) is in `_dispatch.py` and changes no
result: `eqx.filter_jit(train_step)` computes the same thing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import reprlib
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._buffer import (
    _is_param,
    _is_ref,
    cells_of,
    is_state,
    named_cells,
    unbatched_message,
)
from ._compat import Tracer, is_ref_in_filtered_transform, is_unmapped_ref_write
from ._errors import (
    FILTERED_TRANSFORM_MESSAGE,
    NeedsFirstCall,
    StateTypeError,
    StateValueError,
    StateWriteError,
    StepError,
)
from ._modes import (
    argument_name,
    check_tree_live,
    model_path,
    refreeze,
    refuse_shared_refs,
    thaw,
    without_witnesses,
)


def train_step(
    carry: tuple[Any, Any],
    args: tuple,
    kwargs: dict,
    *,
    loss_fn: Callable[..., Any],
    optimizer: Any,
    has_aux: bool,
    trainable: Any = None,
    microbatches: int | None = None,
) -> tuple[tuple[Any, Any], tuple[jax.Array, Any]]:
    """One training step: `(model, opt_state), (loss, aux)`."""
    model, opt_state = carry
    mask = trainable_mask(model, trainable)
    thawed, made, paths = thaw(model)  # value-mode cells -> refs created here
    diff, rest = eqx.partition(thawed, mask, is_leaf=is_state)

    def loss(diff, *args, **kwargs):
        out = loss_fn(eqx.combine(diff, rest, is_leaf=is_state), *args, **kwargs)
        return _loss_and_aux(out, has_aux)

    _check_opt_state(optimizer, opt_state, diff)
    grad_fn = jax.value_and_grad(loss, has_aux=True)
    with named_cells(paths), _cond_note():  # errors about a cell name its path
        if microbatches is None:
            (value, aux), grads = grad_fn(diff, *args, **kwargs)
        else:
            (value, aux), grads = _accumulate(grad_fn, diff, args, kwargs, microbatches)
    refuse_cells_out(aux, thawed, "make_step(..., has_aux=True): `aux`")
    if takes_extra_args(optimizer):
        # optax's extra arguments: an optimizer that needs the loss (e.g.
        # `optax.contrib.reduce_on_plateau`) takes it as `value`
        try:
            updates, opt_state = optimizer.update(grads, opt_state, diff, value=value)
        except TypeError as e:
            _refuse_extra_args(e)
            raise
    else:
        updates, opt_state = optimizer.update(grads, opt_state, diff)
    diff = optax.apply_updates(diff, updates)
    model = refreeze(eqx.combine(diff, rest, is_leaf=is_state), made)
    return (model, opt_state), (value, aux)


def _refuse_extra_args(e: TypeError) -> None:
    """optax's refusal of an `update` that needs more extra arguments than the loss
    (`value=`), e.g. the `grad=` and `value_fn=` of `optax.lbfgs()`'s zoom line
    search, which evaluates the loss again: a `StepError` that names the fix."""
    text = str(e)
    if "required keyword-only argument" in text and (
        "'value_fn'" in text or "'grad'" in text
    ):
        raise StepError(
            f"The optimizer's update needs arguments that a step does not pass "
            f"({text.split(': ', 1)[-1]}): `make_step` gives optax's extra arguments "
            "the loss only (`value=`). A line search that evaluates the loss again "
            "(`optax.lbfgs()`'s default, `optax.scale_by_zoom_linesearch`) needs "
            "`value_fn=`: use `optax.lbfgs(linesearch=None)`, or write the loop "
            "yourself with `optax.value_and_grad_from_state`, as optax's L-BFGS "
            "example does."
        ) from e


def takes_extra_args(optimizer: Any) -> bool:
    """Whether `optimizer.update` takes optax's extra arguments (`value=`): a
    `GradientTransformationExtraArgs`, or an `optax.MultiSteps` (its `update`
    forwards them to the optimizer it wraps, also as the plain
    `GradientTransformation` that `MultiSteps.gradient_transformation()` makes)."""
    if isinstance(optimizer, (optax.GradientTransformationExtraArgs, optax.MultiSteps)):
        return True
    return isinstance(getattr(optimizer.update, "__self__", None), optax.MultiSteps)


def apply_call(fn: Callable[..., Any], model: Any, args: tuple, kwargs: dict) -> Any:
    """Run `fn(model, *args, **kwargs)` with writable cells: returns `(out, model)`."""
    # before `fn` writes anything: a ref-mode model consumed by a step still holds
    # live refs (the new model's), beside parameters that were donated
    check_tree_live(model)
    _check_refs_once(model, args, kwargs)
    thawed, made, paths = thaw(model)
    with named_cells(paths), _cond_note():
        out = fn(thawed, *args, **kwargs)
    refuse_cells_out(out, thawed, "`apply(fn, model, ...)`: `fn`'s output")
    return out, refreeze(thawed, made)


def _check_refs_once(model: Any, args: tuple, kwargs: dict) -> None:
    """A ref at two places of the call, refused as the compiled runners refuse it
    (`refuse_shared_refs`): eager, one ref at two places would be one state, while
    the same call compiled (`make_apply`, or `eqx.filter_jit` around `es.apply`)
    cannot take it twice. So every runner gives one answer."""
    tree = ((model,), args, kwargs)
    leaves = jax.tree_util.tree_leaves(tree)
    refs = [i for i, x in enumerate(leaves) if _is_ref(x)]
    if len(refs) > 1:
        n_model = len(jax.tree_util.tree_leaves(model))
        refuse_shared_refs(tree, leaves, refs, n_model, n_model)


def refuse_cells_out(out: Any, thawed: Any, what: str) -> None:
    """Refuse an output that holds one of the model's state cells: a ref made for
    this call would leave it as a dead trace value, and a ref-mode cell is refused
    alike (eager `es.apply` would return it live, a compiled call runs it as a
    value-mode cell), so every runner and both modes give one answer. One check
    for every runner."""
    ours = [c.value for c in cells_of(thawed)]
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if _is_ref(leaf) and any(leaf is r for r in ours):
            raise StepError(
                f"{what} holds a state cell (at `{jax.tree_util.keystr(path)}` of "
                "it): cells live in the model, which the call returns. Return "
                "values (`cell[...]`, e.g. `m.bn.running_mean[...]`), not cells or "
                "modules that hold them."
            )


@contextlib.contextmanager
def _cond_note() -> Iterator[None]:
    """Around the user's code in a step or an apply: JAX's bare refusals of state
    writes, with the fix. JAX refuses a `lax.cond` (or `switch`) whose branch
    writes state in two cases, with a bare `NotImplementedError`: under `vmap` with
    a batched predicate, and under differentiation inside a loop (`scan`,
    `fori_loop`); the fix is added to it (it is kept as it is, so nothing is
    hidden). A write into a cell that a `vmap` does not map is refused at the write
    (`_buffer._write`), except inside a `jax.checkpoint` or `lax.scan` under the
    `vmap`: their batching rule meets it afterwards, with a bare `Exception`, which
    becomes the write's own error. One of Equinox's filtered transformations given
    the model (its cells are refs of the trace, which Equinox hashes as static
    leaves) fails with JAX's bare error, which becomes a `StepError` with the fix."""
    try:
        yield
    except NotImplementedError as e:
        e.add_note(
            "eqx_state: if a branch of a `lax.cond` / `lax.switch` writes state "
            "(calls a layer that updates a cell), JAX cannot run it in two cases: "
            "under `vmap` with a predicate that differs between examples or "
            "ensemble members, and inside a `lax.scan` / `fori_loop` body of a "
            "differentiated loss (a step's `loss_fn`). Compute both values and "
            "write once, unconditionally: `cell[...] = jnp.where(pred, new, "
            "cell[...])` (or `lax.select`); or call the layer outside the `cond` "
            "(e.g. `y = layer(x)` before it, then `jnp.where(pred, y, x)`), or "
            "outside the loop."
        )
        raise
    except Exception as e:
        if is_unmapped_ref_write(e):
            raise StateWriteError(unbatched_message("state cell", e)) from e
        if is_ref_in_filtered_transform(e):
            raise StepError(FILTERED_TRANSFORM_MESSAGE) from e
        raise


class _Unselected:
    pass


def trainable_mask(model: Any, trainable: Any) -> Any:
    """A tree of bools over `model` with cells as leaves: which leaves are trained.

    A leaf is trained when it is a parameter ([`eqx_state.params`][]) and
    `trainable` selects it. `trainable` is `None` (every parameter), a predicate
    called on each parameter (`param -> bool`), or an Equinox filter spec: a prefix
    of the model's tree of bools and callables (as for `eqx.filter`)."""
    # Cells are never trained; compare the filter with the model without the cells'
    # shape witnesses, so that a spec made from either mode fits either mode.
    model = without_witnesses(model)
    nodes, treedef = jax.tree_util.tree_flatten(model, is_leaf=is_state)
    if trainable is None:
        flags = None
    elif _is_predicate(trainable):
        return jax.tree_util.tree_unflatten(
            treedef,
            [
                not is_state(n) and _is_param(n) and _selects(trainable, n)
                for n in nodes
            ],
        )
    else:
        marker = _Unselected()
        spec = without_witnesses(trainable)  # a no-op on a callable
        try:
            selected = eqx.filter(model, spec, replace=marker)
        except ValueError as e:  # Equinox's refusal of a malformed filter spec
            raise StateValueError(
                "`trainable` must be None, a predicate `param -> bool`, or an "
                "Equinox filter spec (a prefix of the model's tree of bools and "
                f"callables, as for `eqx.filter`), got {type(trainable).__name__} "
                f"({e})."
            ) from e
        flags = iter(x is not marker for x in jax.tree_util.tree_leaves(selected))
    mask = []
    for node in nodes:
        if is_state(node):
            if flags is not None:
                for _ in jax.tree_util.tree_leaves(node):
                    next(flags)
            mask.append(False)
        else:
            chosen = True if flags is None else next(flags)
            mask.append(chosen and _is_param(node))
    return jax.tree_util.tree_unflatten(treedef, mask)


def _selects(trainable: Callable[[Any], Any], param: Any) -> bool:
    """`trainable(param)` as a Python bool. The predicate decides the same thing at
    `step.init` (concrete arrays) and inside the step (traced ones) only when it
    depends on a parameter's place, shape or dtype: one that computes with the
    values (`lambda p: p > 0`) is refused here, in both places."""
    advice = (
        "`trainable` must depend only on a parameter's shape or dtype, e.g. "
        "`lambda p: p.ndim > 1`, not on its values (inside the step they are "
        "traced); to select by place, pass an Equinox filter spec (a tree of bools "
        "over the model, as for `eqx.filter`)."
    )
    try:
        chosen = trainable(param)
    except (
        jax.errors.ConcretizationTypeError,
        jax.errors.TracerArrayConversionError,
    ) as e:
        raise StateTypeError(f"{advice} It read a value ({e}).") from e
    if isinstance(chosen, Tracer) or (
        isinstance(chosen, jax.Array | np.ndarray) and chosen.ndim
    ):  # a concrete 0-d array of a shape test (`np.asarray(p.ndim > 1)`) is a bool
        raise StateTypeError(
            f"{advice} It returned an array (shape {tuple(chosen.shape)}, dtype "
            f"{chosen.dtype}) for a parameter of shape {tuple(jnp.shape(param))}."
        )
    return bool(chosen)


def _check_opt_state(optimizer: Any, opt_state: Any, diff: Any) -> None:
    """At trace time: the optimizer state must be the one for these parameters."""
    # (`filter_eval_shape`: an optimizer may keep Python values in its state, a
    # string or a flag, which `jax.eval_shape` cannot return)
    made = eqx.filter_eval_shape(optimizer.init, diff)
    want = jax.tree_util.tree_structure(made)
    got = jax.tree_util.tree_structure(opt_state)
    if want != got:
        raise StepError(
            "The optimizer state does not match the parameters this step trains: it "
            "was made for another model, another optimizer, or another `trainable` "
            f"selection ({_first_difference(made, opt_state)}). Make it with this "
            "step's `step.init(model)` (an array added to the model since it was "
            "made is a parameter: a value meant to stay fixed belongs in a state "
            "cell, `es.Buffer`, or a static field). If `step.init(model)` made it "
            "for this very model, the `trainable` predicate selects differently "
            "at `init` (concrete arrays) and inside the step (traced ones): it "
            "must depend only on a leaf's place, shape or dtype, not on its values "
            "or `id()`."
        )
    # the same structure with arrays of other shapes (a model of another size
    # whose sizes are not static fields): optax's update fails on a bare
    # broadcasting error
    leaves = jax.tree_util.tree_leaves(opt_state)
    for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(made)[0], leaves):
        if not isinstance(w, jax.ShapeDtypeStruct):
            continue  # a Python value: compared as a static leaf, by the trace key
        if tuple(jnp.shape(g)) != tuple(w.shape):
            raise StepError(
                "The optimizer state does not match the parameters this step "
                f"trains: its leaf `{model_path(path, 'opt_state')}` has shape "
                f"{tuple(jnp.shape(g))}, where `step.init(model)` makes "
                f"{tuple(w.shape)}: it was made for a model of other sizes. Make it "
                "with this step's `step.init(model)`."
            )


def _first_difference(made: Any, got: Any) -> str:
    """Where the optimizer state `got` first differs in structure from `made`, the
    state for the parameters this step trains, by path."""
    entries = [
        [
            (jax.tree_util.keystr(path), x is None)
            for path, x in jax.tree_util.tree_flatten_with_path(
                tree, is_leaf=lambda x: x is None
            )[0]
        ]
        for tree in (made, got)
    ]
    for (a, a_none), (b, b_none) in zip(*entries):
        if a == b and a_none != b_none:
            return f"at `opt_state{a}` it holds " + (
                "nothing, where the state for what this step trains holds a leaf"
                if b_none
                else "a leaf, where the state for what this step trains holds nothing"
            )
        if a != b:
            return (
                f"the first difference: `opt_state{b}`, where the state for what "
                f"this step trains has `opt_state{a}`"
            )
    a, b = ([path for path, _ in e] for e in entries)
    if len(a) > len(b):
        return f"it lacks `opt_state{a[len(b)]}`, which the state for what this step trains has"
    if len(b) > len(a):
        return f"it has `opt_state{b[len(a)]}`, which the state for what this step trains has not"
    return _first_node_difference(made, got, "")


def _first_node_difference(made: Any, got: Any, path: str) -> str:
    """Where two trees with their leaves at the same paths first differ: a node of
    another type, or a node whose static data differ (an Equinox layer's sizes are
    static fields: a state made for a layer of other sizes)."""
    where = f"`opt_state{path}`"
    if type(made) is not type(got):
        a, b = type(made), type(got)
        if a.__name__ == b.__name__:  # two classes of one name: say whose
            a_name, b_name = (f"{t.__module__}.{t.__qualname__}" for t in (a, b))
        else:
            a_name, b_name = a.__name__, b.__name__
        return (
            f"at {where} it holds {_a(b_name)}, where the state for what this step "
            f"trains holds {_a(a_name)}"
        )
    if isinstance(made, dict) and isinstance(got, dict) and made.keys() != got.keys():
        return (
            f"at {where} it has the keys {sorted(map(str, got))}, where the state "
            f"for what this step trains has {sorted(map(str, made))}"
        )
    m_children = jax.tree_util.tree_flatten_with_path(
        made, is_leaf=lambda x: x is not made
    )[0]
    g_children = jax.tree_util.tree_leaves(got, is_leaf=lambda x: x is not got)
    if len(m_children) != len(g_children):
        return (
            f"at {where} it holds {_a(type(got).__name__)} of {len(g_children)} "
            f"items, where the state for what this step trains holds "
            f"{len(m_children)}"
        )
    m_td = jax.tree_util.tree_structure(made, is_leaf=lambda x: x is not made)
    g_td = jax.tree_util.tree_structure(got, is_leaf=lambda x: x is not got)
    if m_td != g_td:  # this node's own data differ (not its children's)
        fields = []
        if isinstance(made, eqx.Module):
            for f in dataclasses.fields(made):
                if f.metadata.get("static", False):
                    a, b = getattr(made, f.name, None), getattr(got, f.name, None)
                    if _differ(a, b):
                        fields.append(
                            f"`{f.name}` {reprlib.repr(b)} where it is "
                            f"{reprlib.repr(a)}"
                        )
        what = (
            "static fields differ: " + ", ".join(fields)
            if fields
            else "own data differ"
        )
        return f"at {where} the {type(made).__name__}'s {what}"
    for (key, a), b in zip(m_children, g_children):
        if jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b):
            return _first_node_difference(a, b, path + jax.tree_util.keystr(key))
    return "its leaves are at the same paths, in nodes of other types"


def _a(name: str) -> str:
    """`name` with its indefinite article."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _differ(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except Exception:  # an object that cannot say (a NumPy array)
        return a is not b


def _is_predicate(x: Any) -> bool:
    """A plain callable (a function, a lambda), as opposed to a pytree spec (an
    `eqx.Module` of bools is callable too when the module has `__call__`)."""
    return callable(x) and not isinstance(x, eqx.Module | list | tuple | dict)


def _loss_and_aux(out: Any, has_aux: bool) -> tuple[jax.Array, Any]:
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            got = (
                f"an array of shape {jnp.shape(out)}"
                if isinstance(out, jax.Array | np.ndarray | np.generic)
                else f"a {type(out).__name__}"
                + (f" of {len(out)}" if isinstance(out, tuple | list) else "")
            )
            raise StepError(
                "make_step(..., has_aux=True) expects `loss_fn` to return a pair "
                f"`(loss, aux)`, got {got}. Return `loss, aux`, or build the step "
                "without `has_aux=True`."
            )
        value, aux = out
    else:
        value, aux = out, None
    if not isinstance(value, jax.Array | np.ndarray | np.generic | float | int):
        # a tuple, list or dict: `jnp.shape` would try to convert it to one array
        raise StepError(
            "`loss_fn` must return a scalar loss"
            + (" as the first element of `(loss, aux)`" if has_aux else "")
            + f", got a {type(value).__name__}"
            + (
                f" of {len(value)}. If it returns `(loss, aux)`, pass "
                "`has_aux=True` to `make_step`."
                if isinstance(value, tuple | list) and not has_aux
                else "."
            )
        )
    if jnp.shape(value) != ():
        raise StepError(
            "`loss_fn` must return a scalar loss"
            + (" (as the first element of `(loss, aux)`)" if has_aux else "")
            + f", got shape {jnp.shape(value)}. Reduce it (e.g. `jnp.mean`), or pass "
            "`has_aux=True` if it returns `(loss, aux)`."
        )
    dtype = jnp.result_type(value)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise StepError(
            f"`loss_fn` must return a real floating-point loss, got dtype {dtype}: "
            "gradients are taken of it. Compute it in floating point (e.g. "
            "`jnp.mean(errors.astype(jnp.float32))`)"
            + (", or return it as `aux`" if not has_aux else "")
            + "."
        )
    # an array, as every runner returns it (a Python float loss was returned as
    # it was by a step, and `step.scan` gave one float for its K losses)
    return jnp.asarray(value), aux


def _accumulate(grad_fn, diff, args, kwargs, k: int):
    """Gradients averaged over `k` slices of the batch, accumulated in the carry of a
    `lax.scan` (in place); state writes land once per slice."""
    batch, static = eqx.partition((args, kwargs), eqx.is_array)
    n = leading_axis(
        batch,
        f"make_step(..., microbatches={k}) splits every array argument into {k} "
        "slices along its leading axis (the batch)",
        "Pass an array that is not a batch (class weights, a mask over features) "
        "through a closure (`functools.partial(loss_fn, weights=w)`) or as a field "
        "of the model, where it is not split.",
    )
    if n % k:
        raise StepError(
            f"make_step(..., microbatches={k}): the batch of {n} examples does not "
            f"split into {k} equal microbatches. Use a batch of a multiple of {k}."
        )

    def split(x):
        shape = (k, x.shape[0] // k, *x.shape[1:])
        sharding = jax.typeof(x).sharding
        spec = getattr(sharding, "spec", ())
        if any(s is not None for s in spec):
            # sharded in its type (an explicit mesh): each slice is laid out over
            # the devices as the batch was
            entry = spec[0] if spec else None
            names = (
                ()
                if entry is None
                else (entry if isinstance(entry, tuple) else (entry,))
            )
            devices = math.prod(sharding.mesh.shape[a] for a in names)
            if shape[1] % devices:
                raise StepError(
                    f"make_step(..., microbatches={k}) on a mesh: each microbatch "
                    f"of {shape[1]} examples (a batch of {x.shape[0]} in {k}) is "
                    f"split over the mesh axes {names} of {devices} devices, which "
                    f"needs a multiple of {devices}. Use a batch of a multiple of "
                    f"{k * devices} examples, fewer microbatches, or a mesh with "
                    "Auto axes (`axis_types=(jax.sharding.AxisType.Auto,)`), where "
                    "XLA lays out uneven slices."
                )
            spec = (None, *spec, *(None,) * (x.ndim - len(spec)))
            out = jax.sharding.NamedSharding(sharding.mesh, jax.P(*spec))
            return jax.lax.reshape(x, shape, out_sharding=out)
        return x.reshape(shape)

    slices = jax.tree.map(split, batch)
    zeros = jax.tree.map(jnp.zeros_like, diff)

    aux_static: list[Any] = []

    def body(acc, piece):
        args, kwargs = eqx.combine(piece, static)
        (value, aux), g = grad_fn(diff, *args, **kwargs)
        # Python values of `aux` come back as they are, as from `step.scan` (a
        # scan's outputs are arrays: they would become `k` stacked copies)
        aux, out_static = eqx.partition(aux, eqx.is_array)
        aux_static.append(out_static)
        return jax.tree.map(jnp.add, acc, g), (value, aux)

    grads, (values, aux) = jax.lax.scan(body, zeros, slices)
    grads = jax.tree.map(lambda g: g / k, grads)
    return (jnp.mean(values), eqx.combine(aux, aux_static[-1])), grads


def run_scan(scan: Any, one: Any, carry: tuple, args: tuple, kwargs: dict) -> Any:
    """`K` calls of `one` (a compiled call) as one call of `scan` (the same calls in
    a `lax.scan`): `(carry, outs)` with `outs` stacked. Where the scan cannot carry
    the input types (`NeedsFirstCall`), the first call runs on its own and the other
    `K - 1` in the scan; if their types still change (or the scan refuses what the
    first call returned), one by one: always the same `K` calls, and no call's
    result is lost to a refusal (a `StepError`) after it ran. An error of another
    kind after the first call ran (JAX's, for a carry whose shapes change from
    call to call) reaches the user with the first call's result lost."""
    try:
        return scan.call(carry, args, kwargs)
    except NeedsFirstCall:
        pass
    batch, static = eqx.partition((args, kwargs), eqx.is_array)
    k = jax.tree.leaves(batch)[0].shape[0]

    def sliced(index: Any) -> Any:
        return eqx.combine(jax.tree.map(lambda x: x[index], batch), static)

    carry, out = one.call(carry, *sliced(0))
    outs = [out]
    if k > 1:
        try:
            carry, rest = scan.call(carry, *sliced(slice(1, None)))
        except StepError:  # raised while tracing (`NeedsFirstCall` or a check of
            # the carry the first call returned): nothing of it ran, and the first
            # call's result must not be lost; K separate calls take these types
            for i in range(1, k):
                carry, out = one.call(carry, *sliced(i))
                outs.append(out)
        else:
            arrays, out_static = eqx.partition(rest, eqx.is_array)
            first, _ = eqx.partition(outs[0], eqx.is_array)
            stacked = jax.tree.map(
                lambda a, b: jnp.concatenate([a[None], b]), first, arrays
            )
            return carry, eqx.combine(stacked, out_static)
    arrays = [eqx.partition(o, eqx.is_array)[0] for o in outs]
    out_static = eqx.partition(outs[-1], eqx.is_array)[1]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *arrays)
    return carry, eqx.combine(stacked, out_static)


def scan_calls(
    call: Callable[[tuple, tuple, dict], tuple[tuple, Any]],
    carry: tuple,
    args: tuple,
    kwargs: dict,
    unroll: int | bool = 1,
) -> tuple[tuple, Any]:
    """`K` calls `call(carry, args_i, kwargs_i) -> (carry, out)` in one `lax.scan`,
    where `args_i` holds slice `i` of every array argument's leading axis (of length
    `K`) and the other arguments as they are. Returns the last carry and the outputs
    stacked along a new leading axis.

    The carry's arrays are the scan's carry (updated in place); its refs (ref mode)
    and Python values are closed over, so ref-mode cells are written in place at
    every iteration."""
    arrays, static = eqx.partition(carry, eqx.is_array)
    batch, static_args = eqx.partition((args, kwargs), eqx.is_array)
    length = leading_axis(
        batch,
        "`scan` runs one call per slice of its array arguments' leading axis (K)",
        "Pass values that are the same for every call through a closure or as "
        "Python values, or repeat them K times.",
    )
    out_static: list[Any] = []

    def body(arrays: Any, piece: Any) -> tuple[Any, Any]:
        a, k = eqx.combine(piece, static_args)
        new, out = call(eqx.combine(arrays, static), a, k)
        out_arrays, static_out = eqx.partition(out, eqx.is_array)
        out_static.append(static_out)
        if length == 0:
            # no call runs (K = 0 calls change nothing): the carry comes back as
            # it is, whatever one call would make of its types
            return arrays, out_arrays
        new_arrays, new_static = eqx.partition(new, eqx.is_array)
        if jax.tree.structure(new_arrays) != jax.tree.structure(arrays):
            if jax.tree.structure(new) == jax.tree.structure(carry):
                # a Python number of the carry comes back as an array (a float
                # hyperparameter of `optax.inject_hyperparams`): the first call
                # runs on its own, the others in the scan (see `NeedsFirstCall`)
                raise NeedsFirstCall()
            raise StepError(
                "A call inside `scan` changed the structure of the model or the "
                "optimizer state; `scan` carries them from one call to the next."
            )
        for path, (n, o) in _paired(new_arrays, arrays):
            tn, to = jax.typeof(n), jax.typeof(o)
            # K separate calls compute the next call with the new type (a
            # bfloat16 moment that an optimizer's float32 hyperparameter promotes;
            # a weak type that takes the other operand's dtype); a scan's carry
            # keeps one type: the first call runs on its own (see `NeedsFirstCall`)
            if tn.dtype != to.dtype:
                raise NeedsFirstCall(
                    f"{path} comes back {tn.dtype} from a call that got it {to.dtype}"
                )
            if tn.weak_type != to.weak_type:
                raise NeedsFirstCall(
                    f"{path} comes back {'weakly' if tn.weak_type else 'strongly'} "
                    f"typed from a call that got it "
                    f"{'weakly' if to.weak_type else 'strongly'} typed"
                )
        changed = _changed_python_value(new_static, static)
        if changed is not None:
            # a call changes a Python value of the carry (an optimizer's Python
            # counter or phase): a scan carries arrays only, and K separate calls
            # compute each call with the value the previous one returned
            raise NeedsFirstCall(f"{changed} changes from one call to the next")
        return new_arrays, out_arrays

    arrays, outs = jax.lax.scan(body, arrays, batch, unroll=unroll)
    return eqx.combine(arrays, static), eqx.combine(outs, out_static[-1])


def _changed_python_value(new: Any, old: Any) -> str | None:
    """The path of the first Python value (a non-array leaf) of the carry that a
    call changed, or `None`. Equal means the same type and `==` (`1` and `1.0`, or
    `True` and `1`, compile differently); an object that cannot say counts as
    changed."""
    for path, (n, o) in _paired(new, old):
        if n is o:
            continue
        try:
            same = type(n) is type(o) and bool(n == o)
        except Exception:
            same = False
        if not same:
            return path
    return None


def leading_axis(batch: tuple, what: str, fix: str) -> int:
    """The one length of the leading axis of every array in `batch` (an `(args,
    kwargs)` tree of arrays), or a `StepError` that names the arguments that differ.
    One check for every runner that splits its arguments (scan, microbatches)."""
    groups: dict[Any, list[str]] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        n = jnp.shape(x)[0] if jnp.ndim(x) else None
        name = argument_name(path)
        groups.setdefault(n, []).append(f"`{name}` {tuple(jnp.shape(x))}")
    if len(groups) == 1 and None not in groups:
        return next(iter(groups))
    if not groups:
        got = "no array argument"
    else:
        got = "; ".join(
            f"{'no leading axis' if n is None else f'leading axis {n}'}: "
            + ", ".join(names)
            for n, names in groups.items()
        )
    raise StepError(
        f"{what}: every array argument needs that axis, of one length. Got {got} "
        f"(`args` counts the arguments after the model). {fix}"
    )


def _paired(a: Any, b: Any) -> list[tuple[str, tuple[Any, Any]]]:
    la = jax.tree_util.tree_flatten_with_path(a)[0]
    lb = jax.tree.leaves(b)
    return [(jax.tree_util.keystr(p), (x, y)) for (p, x), y in zip(la, lb)]
