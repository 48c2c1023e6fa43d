"""The two storage modes: `to_refs` / `freeze` between calls, and `thaw` / `refreeze`
inside a step or apply.

Every cell is its own state: the functions here work position by position and never
ask whether two positions hold the same array. A ref, unlike an array, is a mutable
object, so one ref at two positions would make them one state; no function here
creates that, and the entry points refuse a model that has it (`check_no_shared_refs`).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._buffer import (
    REF_KIND,
    Buffer,
    _is_ref,
    _LayerBase,
    cells_of,
    check_live,
    describe,
    is_state,
    new_cell_ref,
    origin_path,
    remember_path,
)
from ._compat import (
    REF_TYPES,
    Tracer,
    is_concrete_ref,
    placed_as,
    ref_buffer,
    ref_identity,
    ref_is_consumed,
    ref_value_copy,
    under_trace,
)
from ._errors import StateError, StateTypeError


def key_name(k: Any) -> str:
    """One entry of a JAX key path as a name: a field, an index or a dict key."""
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.DictKey | jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return str(k)  # pragma: no cover - custom key types


def path_str(path: tuple) -> str:
    """A key path as a dotted name, PyTorch style: `blocks.0.bn.running_mean`: the
    names of state-dict entries and of sharding rules (`_torch_names.torch_path_name`
    adds PyTorch's names for converted layers on top of it). Messages name a place
    in a model with `model_path`."""
    return ".".join(map(key_name, path))


def model_path(path: tuple, root: str = "model") -> str:
    """The one way messages name a place in a model: as Python reaches it from
    `root`, `model.blocks[0].bn.running_mean`, `model.d['head 1']` (unambiguous
    for dict keys holding dots or spaces, and pasteable). Every runner names a
    model's leaves so (`call_path_name` adds `opt_state`, `args[i]`)."""
    return root + jax.tree_util.keystr(path)


# -- a layer's cell fields hold cells ---------------------------------------------

_CELL_FIELDS: dict[type, tuple[tuple[str, type, bool], ...]] = {}


def _cell_class(hint: Any) -> type | None:
    """The cell or library-layer class a field's annotation declares
    (`BatchStat`, `BatchStat | None`, `Rng | None`), or None."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = typing.get_args(hint) if union else (hint,)
    classes = [
        c
        for c in options
        if isinstance(c, type) and issubclass(c, (Buffer, _LayerBase))
    ]
    if len(classes) == 1 and all(c is type(None) or c in classes for c in options):
        return classes[0]
    return None


def _cell_fields(cls: type) -> tuple[tuple[str, type, bool], ...]:
    """The fields of a library layer declared to hold a state cell or a library
    layer (`running_mean: BatchStat | None`, `rng: Rng | None`), or a tuple of
    them (`hidden: tuple[AverageState, ...]`): `(name, class, is a tuple)`,
    computed once per class from the annotations."""
    got = _CELL_FIELDS.get(cls)
    if got is not None:
        return got
    out = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.metadata.get("static", False):
            continue
        owner = next(
            (c for c in cls.__mro__ if f.name in c.__dict__.get("__annotations__", {})),
            None,
        )
        hint: Any = f.type
        if isinstance(hint, str) and owner is not None:
            try:
                hint = eval(hint, dict(vars(sys.modules[owner.__module__])))  # noqa: S307
            except Exception:  # a name only a type checker sees: not checked
                continue
        args = typing.get_args(hint)
        if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
            kind, items = _cell_class(args[0]), True
        else:
            kind, items = _cell_class(hint), False
        if kind is not None:
            out.append((f.name, kind, items))
    got = _CELL_FIELDS[cls] = tuple(out)
    return got


def _not_a_cell_message(
    where: str, access: str, var: str, kind: type, value: Any
) -> str:
    """`where`: the field's place (`model_path`'s form,
    `model.seq.layers[1].running_mean`); `access`: how Python reaches it from `var`
    (`.seq.layers[1].running_mean`)."""
    if issubclass(kind, Buffer):
        what = "a state cell"
        fix = (
            " To set a cell's value, replace the value inside the cell, "
            f"`eqx.tree_at(lambda {var}: {var}{access}.value, {var}, array)` (same "
            "shape and dtype), or in ref mode write it, "
            f"`{var}{access}[...] = array`."
        )
    else:
        what, fix = "a layer", f" Put back a `{kind.__name__}`."
    if isinstance(value, jax.Array | np.ndarray):
        held = f"an array of shape {tuple(value.shape)}"
    else:
        held = f"a {type(value).__name__}"
    return (
        f"`{where}` holds {held}, but its layer keeps {what} there (a "
        f"`{kind.__name__}`): the cell itself was replaced (`eqx.tree_at(lambda "
        f"{var}: {var}{access}, {var}, ...)`), and the layer could neither read nor "
        "write its state." + fix
    )


# what a cell field holds when a cell was replaced by its value
_PLAIN = (jax.Array, np.ndarray, np.generic, int, float, complex)
_CHECKED: set[Any] = set()  # the structures found fine (see `check_cell_fields`)


def check_cell_fields(model: Any, root: str = "model") -> None:
    """Refuse a library layer of `model` whose cell field (a field declared to
    hold a state cell or a layer, or a tuple of them) holds a plain array or
    number instead: put there with `eqx.tree_at` (as one sets a PyTorch buffer),
    it would fail in the layer with an error of JAX's or Python's. Whether a field
    holds a cell or a leaf is part of the model's structure, so a structure found
    fine is not walked again (an eager `es.apply` reads only its structure)."""
    treedef = jax.tree_util.tree_structure(model)
    try:
        if treedef in _CHECKED:
            return
    except (TypeError, ValueError):  # a static field that is not hashable, or
        # whose `==` is no bool (a NumPy array): walk each time (the call names
        # the field: `_dispatch._static_fields_message`)
        treedef = None
    var = "model" if root == "model" else "layer"

    def check(where: str, access: str, kind: type, value: Any) -> None:
        if isinstance(value, _PLAIN):  # (a wrapper, e.g. `eqx.nn.Shared`'s node,
            # or a cell of another kind, is the layer's business)
            raise StateTypeError(_not_a_cell_message(where, access, var, kind, value))

    def visit(tree: Any, access0: str) -> None:
        for path, node in jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, _LayerBase)
        )[0]:
            if not isinstance(node, _LayerBase):
                continue
            access = access0 + jax.tree_util.keystr(path)
            for name, kind, items in _cell_fields(type(node)):
                value = node.__dict__.get(name)
                if not items:
                    check(f"{root}{access}.{name}", f"{access}.{name}", kind, value)
                elif isinstance(value, tuple):
                    for k, item in enumerate(value):
                        here = f"{access}.{name}[{k}]"
                        check(f"{root}{here}", here, kind, item)
            for name, value in node.__dict__.items():
                if not isinstance(value, Buffer) and any(
                    isinstance(x, _LayerBase)
                    for x in jax.tree_util.tree_leaves(
                        value, is_leaf=lambda x: isinstance(x, _LayerBase)
                    )
                ):
                    visit(value, f"{access}.{name}")

    visit(model, "")
    if len(_CHECKED) > 1000:  # a bound (structures are small, but a process may
        _CHECKED.clear()  # build many models)
    if treedef is not None:
        _CHECKED.add(treedef)


def check_tree_live(tree: Any) -> None:
    """`check_live` on every leaf of a model: a `StaleModelError` that names the
    first leaf a donating call consumed (its path in the model). For the calls
    that would otherwise hand back, or write into, a model that fails at its
    first read of a parameter: `es.apply`, `es.reset`, `es.inference_mode`,
    `es.to_refs`, `es.freeze`."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        check_live(leaf, "model", f"`{model_path(path)}`")


def argument_name(path: tuple) -> str:
    """A leaf of a call's `(args, kwargs)` named as the user passed it:
    `args[2]`, `kwargs['weights']`, with the rest of its key path."""
    head = "args" if path[0].idx == 0 else "kwargs"
    return head + jax.tree_util.keystr(tuple(path[1:]))


_ARGS = (jax.tree_util.SequenceKey(0), jax.tree_util.SequenceKey(1))


def call_path_name(tree: tuple, path: tuple) -> str:
    """A key path into a call's `(carry, args, kwargs)`, named as the user wrote it:
    `model...` and `opt_state...` for a step's carry (`model...` alone for an
    apply's), `args[i]...` / `kwargs[...]` for the arguments."""
    roots = ["model", "opt_state"] if len(tree[0]) == 2 else ["model"]
    if path[0].idx == 0:  # the carry
        head = roots[path[1].idx] if path[1].idx < len(roots) else "carry"
        return f"`{model_path(tuple(path[2:]), head)}`"
    # the arguments: `(args, kwargs)` is the rest of the tree
    return f"`{argument_name((_ARGS[path[0].idx - 1], *path[1:]))}`"


def call_leaf_names(tree: tuple, positions: Sequence[int]) -> list[str]:
    """`call_path_name` of the leaves of `(carry, args, kwargs)` at `positions`."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [call_path_name(tree, flat[j][0]) for j in positions]


def named_call_leaves(tree: tuple, positions: Sequence[int], shown: int = 3) -> str:
    """The one way messages list leaves of a call: by path (a cell by its own path,
    without `.value`), the first `shown` of them and how many more."""
    names = call_leaf_names(tree, positions[:shown])
    names = [n.replace(".value`", "`") for n in names]
    more = f" and {len(positions) - shown} more" if len(positions) > shown else ""
    return f"{', '.join(names)}{more}"


def _rebuild(buf: Buffer, **fields: Any) -> Buffer:
    """`buf` with some fields replaced, without running `__init__` (as unflattening
    does), so that any `Buffer` subclass works."""
    new = object.__new__(type(buf))
    for f in dataclasses.fields(buf):
        object.__setattr__(new, f.name, fields.get(f.name, getattr(buf, f.name)))
    return new


_WITNESS_DTYPE = jnp.float32


def _witness(v: Any) -> jax.Array:
    """A zero-size float32 array of shape `(*v.shape, 0)`, laid out like `v` where
    it is sharded with a `NamedSharding` (so that a sharded ensemble's witnesses
    are mapped with it). Floating, so that every array filter of Equinox
    (`eqx.is_array`, `eqx.is_inexact_array`, `eqx.is_array_like`) slices it."""
    shape = (*v.shape, 0)
    if isinstance(v, Tracer):
        sharding = getattr(jax.typeof(v), "sharding", None)
        if any(s is not None for s in getattr(sharding, "spec", ())):
            return jax.lax.full(shape, 0.0, _WITNESS_DTYPE, sharding=sharding)
        return _constant_witness(shape)
    if is_concrete_ref(v) and not ref_is_consumed(v):  # where the ref's array is
        v = ref_buffer(v)  # (JAX counts every ref as committed)
    if isinstance(v, jax.Array) and not v.committed:  # where `v` is (`placed_as`)
        with placed_as(v):
            w = jnp.zeros(shape, _WITNESS_DTYPE)
    else:
        w = jnp.zeros(shape, _WITNESS_DTYPE)
    sharding = getattr(v, "sharding", None)
    if getattr(v, "committed", False) and isinstance(
        sharding, jax.sharding.NamedSharding | jax.sharding.SingleDeviceSharding
    ):
        # committed where the cell is, as the cell's ref is: a compiled call takes
        # the witness as it is (an uncommitted one would be moved at every call);
        # an uncommitted cell (a fresh model's) gets an uncommitted one
        w = jax.device_put(w, sharding)
    return w


_CONSTANT_WITNESSES: dict[tuple[int, ...], jax.Array] = {}


def _constant_witness(shape: tuple[int, ...]) -> jax.Array:
    """A concrete zero-size witness of `shape`, made once per shape. Inside a trace
    (every step's and apply's `thaw`, one per cell) a staged `jnp.zeros` is an
    operation of the program (dead, but traced, discharged and lowered); a concrete
    constant is not, unless a transformation uses it. It holds no data, so one
    array serves every cell of that shape."""
    if not all(type(d) is int for d in shape):  # a symbolic dimension (`jax.export`)
        return jnp.zeros(shape, _WITNESS_DTYPE)
    w = _CONSTANT_WITNESSES.get(shape)
    if w is None:
        if len(_CONSTANT_WITNESSES) > 1000:  # a bound (shapes are few)
            _CONSTANT_WITNESSES.clear()
        # made eagerly: allowed under a user's `jax.transfer_guard("disallow")`
        # (the staged `jnp.zeros` it stands for transfers nothing)
        with jax.ensure_compile_time_eval(), jax.transfer_guard("allow"):
            w = _CONSTANT_WITNESSES[shape] = jnp.zeros(shape, _WITNESS_DTYPE)
    return w


def _map_cells_with_path(fn: Any, tree: Any, model: bool = False) -> Any:
    """`fn(path, cell)` for every cell of `tree`: the one walk over a model's cells
    (`to_refs`, `freeze`, `thaw` — every step and apply —, the checkpoints'
    witnesses). For a `model` (not a filter spec, whose cells hold bools), a cell
    whose value is not an array is refused, naming it."""

    def one(path: tuple, x: Any) -> Any:
        if not is_state(x):
            return x
        where = model_path(path)
        if model and not isinstance(x.value, _CELL_VALUES) and x.value is not None:
            raise StateTypeError(_not_an_array_message(where, x))
        return fn(where, x)

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_state)


# What a cell's value may be: an array (JAX or NumPy, or a tracer of one), a ref,
# an abstract array (`eqx.filter_eval_shape`); `None` where a filter took it out.
_CELL_VALUES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, *REF_TYPES)


def _not_an_array_message(where: str, buf: Buffer) -> str:
    v = buf.value
    return (
        f"The {type(buf).__name__} cell `{where}` holds {type(v).__name__} {v!r:.40} "
        "as its value, where a cell holds an array (a ref in ref mode): its layer "
        "would fail reading it. Put an array of the cell's dtype there, e.g. "
        f"`eqx.tree_at(lambda m: m{where.removeprefix('model')}.value, model, "
        "jnp.asarray(value, dtype))`, or replace the whole cell."
    )


def without_witnesses(tree: Any) -> Any:
    """`tree` with the shape witnesses of its ref-mode cells removed: the structure
    of the tree in value mode, for code that stores cells (checkpoints)."""

    def one(path: str, buf: Buffer) -> Buffer:
        return buf if buf.witness is None else _rebuild(buf, witness=None)

    return _map_cells_with_path(one, tree)


def with_witnesses(tree: Any) -> Any:
    """`tree` with a shape witness in every cell that holds a ref (the inverse of
    `without_witnesses`, for cells rebuilt around new refs)."""

    def one(path: str, buf: Buffer) -> Buffer:
        v = buf.value
        if not _is_ref(v) or buf.witness is not None:
            return buf
        return _rebuild(buf, witness=_witness(v))

    return _map_cells_with_path(one, tree)


def check_no_shared_refs(tree: Any) -> None:
    """Refuse a tree in which one ref sits at two positions (see the module
    docstring): `refuse_shared_refs` on the tree alone."""
    cell_refs = {
        id(x.value)  # identity of a ref
        for x in jax.tree_util.tree_leaves(tree, is_leaf=is_state)
        if is_state(x) and _is_ref(x.value)
    }
    if not cell_refs:
        return
    leaves = jax.tree_util.tree_leaves(tree)
    # the cells' refs (a bare ref outside a cell is not state of the model)
    refs = [i for i, x in enumerate(leaves) if _is_ref(x) and id(x) in cell_refs]
    if len(refs) > 1:
        wrapped = ((tree,), (), {})
        refuse_shared_refs(wrapped, leaves, refs, len(leaves), len(leaves))


def refuse_shared_refs(
    tree: tuple, leaves: list, refs: Sequence[int], n_model: int, n_carry: int
) -> None:
    """The one check that a ref sits at one place of a call's `(carry, args,
    kwargs)` (`tree`, whose leaves are `leaves`; `refs`: the positions of the refs
    among them; the model's leaves come first, `n_model` of them, then the rest of
    the carry, up to `n_carry`). Every runner runs it (the compiled ones, `es.apply`,
    and `es.freeze` / `es.to_refs` / the checkpoints on a model alone): one ref at
    two places of the model (two cells), in the model and an argument (a cell's ref
    passed again), or in two arguments, named by their paths. Refs are mutable
    objects: their identity is what makes two places one state, so that is what is
    compared here (`_compat.ref_identity`: a `copy.copy` of a ref is the same
    state)."""
    seen: dict[int, int] = {}
    for i in sorted(refs):
        j = seen.setdefault(ref_identity(leaves[i]), i)
        if j != i:
            first, here = named_call_leaves(tree, [j]), named_call_leaves(tree, [i])
            where = "model" if i < n_model else "carry" if j < n_carry else "args"
            raise StateError(shared_ref_message(first, here, where))


def shared_ref_message(first: str, here: str, where: str = "model") -> str:
    """The one message for one ref at two places (`first`, `here`: their paths):
    both in the model (`where="model"`), in the model (or optimizer state) and an
    argument (`"carry"`), or in two arguments (`"args"`)."""
    if where == "args":
        return (
            f"The same ref is passed at two places: {first} and {here}. A call "
            "takes each ref once (a compiled call cannot take a mutable array "
            "twice, and every runner refuses it alike): pass it once and use it at "
            "both places inside the function."
        )
    if where == "carry":
        return (
            f"The same ref is passed at two places: {first} and {here}. A ref-mode "
            "model's cells are read and written through the model; a call cannot "
            "also take one of them as an argument. Pass its value (`cell[...]`), or "
            "read it from the model inside the function."
        )
    return (
        f"The same ref is at two places of the model: {first} and {here}. A ref is "
        "a mutable object, so eager calls would treat the two places as one state, "
        "while a value-mode copy of the model (es.freeze) has two independent ones. "
        "State is shared only when the model declares it: wrap the layers in "
        "`eqx.nn.Shared` (Equinox's way of tying parts of a pytree), or give each "
        "place its own cell (`es.to_refs` on the whole model gives every place its "
        "own ref)."
    )


def to_refs(model: Any, *, sharding: Any = None) -> Any:
    """Ref mode: every state cell of `model` holds a persistent `jax.Ref`, updated in
    place by every call, eager or jitted. Cells that already hold refs are kept.
    Every position gets its own ref, even where two positions hold the same array
    (arrays are values; share state with `eqx.nn.Shared`).

    A ref stays on the devices it was created on (JAX cannot move a ref), so a
    ref-mode model for a data-parallel step (`make_step(..., mesh=mesh)`) is made on
    the mesh: `es.to_refs(model, sharding=NamedSharding(mesh, PartitionSpec()))`.

    **Arguments:**

    - `model`: a model in value mode (or partly in ref mode).
    - `sharding`: where to place the new refs (a `jax.sharding.Sharding`); by
        default where each cell's array is.

    **Returns:**

    The same model with refs in its cells. Parameters are unchanged; the model
    passed in stays valid (the refs start from copies of its arrays).

    **Example:**

    ```python
    import eqx_state as es

    counter = es.to_refs(es.nn.Counter())
    counter.increment()
    counter.increment()
    assert int(counter.value) == 2
    ```
    """

    return refs_in(model, sharding=sharding)


def refs_in(model: Any, *, sharding: Any = None, like: Any = None) -> Any:
    """`es.to_refs`. With `like`, a ref-mode tree of `model`'s structure that
    `model` was loaded into (the state-dict loader), each new ref is named by the
    path recorded for the ref at its place in `like` (`_buffer.origin_path`), and a
    kept ref keeps its name: a load names cells as the model it replaces did."""
    # a consumed model (donated to a step) would come back holding dead parameters
    # beside live refs (in ref mode, the refs of the model the step returned)
    check_tree_live(model)
    olds = None if like is None else iter(cells_of(like))
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        raise StateTypeError(
            "es.to_refs: sharding must be a `jax.sharding.Sharding` (e.g. "
            "`NamedSharding(mesh, PartitionSpec())`) or None, got "
            f"{type(sharding).__name__} {sharding!r:.40}."
        )

    def one(path: str, buf: Buffer) -> Buffer:
        v = buf.value
        # how errors name the cell outside a step (a cell converted alone has no
        # path to name: `model` is itself)
        if olds is None:
            where = path if path != "model" else None
        else:
            was = next(olds).value
            where = origin_path(was) if _is_ref(was) else None
        if _is_ref(v):
            if olds is None:
                remember_path(v, where)  # kept: now at this path
            return buf
        if (
            sharding is not None
            and isinstance(v, jax.Array)
            and not isinstance(v, Tracer)
        ):
            v = jax.device_put(v, sharding)
        ref = new_cell_ref(v, kind=REF_KIND, path=where)
        return _rebuild(buf, value=ref, witness=_witness(v))

    return _map_cells_with_path(one, model, model=True)


def freeze(model: Any) -> Any:
    """Value mode: every state cell of `model` holds an immutable array with the
    current value of its ref. Outside a trace this is a snapshot of the state: the
    ref-mode model stays usable and later writes to it do not change the returned
    model. Its parameters are the model's own arrays (not copied), which a donating
    step consumes: to keep a snapshot across a step (a best-so-far model), copy
    them, `jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else
    x, es.freeze(model))`, or build the step with `donate=False`.

    **Arguments:**

    - `model`: a model in ref mode (value-mode cells pass through).

    **Returns:**

    The model in value mode.
    """
    check_no_shared_refs(model)
    check_tree_live(model)  # as `to_refs`

    def one(path: str, buf: Buffer) -> Buffer:
        if not _is_ref(buf.value):
            return buf
        return _rebuild(buf, value=buf[...], witness=None)

    return _map_cells_with_path(one, model, model=True)


def thaw(model: Any) -> tuple[Any, list[Buffer | Made], dict[int, str]]:
    """Inside a step or apply: give every value-mode cell a ref created here (in the
    trace, or eagerly under a plain `es.apply`). Returns the thawed model; for each
    cell in flattening order, a `Made` (its ref was made here; it keeps the witness
    the cell came with) or the cell as it was given (a ref-mode cell, handed back
    unchanged by `refreeze`); and the path of every cell by its ref (see
    `named_cells`).

    A compiled call runs a concrete ref-mode cell as a value-mode one: its ref's
    array (and its witness) go in, the new array comes out and is put back into the
    same ref (`_dispatch`); such a cell comes here with an array and a witness, and
    leaves with the new array and the same witness, so its structure is kept."""
    check_cell_fields(model)
    check_no_shared_refs(model)
    record: list[Buffer | Made] = []
    paths: dict[int, str] = {}

    def one(path: str, buf: Buffer) -> Buffer:
        check_live(buf.value, describe(buf))
        v = buf.value
        where = f"`{path}`"
        if _is_ref(v):
            record.append(buf)
            paths[id(v)] = f"{where} (ref mode)"
            return buf
        record.append(Made(buf.witness))
        ref = jax.new_ref(v, kind=REF_KIND)
        # refs are mutable objects: identity names them; a cell that comes with a
        # witness is a ref-mode cell run as a value-mode one (see above)
        mode = "value" if buf.witness is None else "ref"
        paths[id(ref)] = f"{where} ({mode} mode)"
        return _rebuild(buf, value=ref, witness=_witness(v))

    thawed = _map_cells_with_path(one, model, model=True)
    return thawed, record, paths


def _frozen(ref: Any, eager: bool) -> Any:
    """`jax.freeze(ref)`; outside a trace (an eager `es.apply`) a copy of the ref's
    array, committed only if the array is (JAX's eager freeze commits it, and a
    step on the result would compile twice more: see `_compat.placed_as`). Under
    a trace (also an eager `eqx.filter_vmap` around `es.apply`) JAX's freeze."""
    if eager and is_concrete_ref(ref):
        copy = ref_value_copy(ref)
        if copy is not None:
            return copy
    return jax.freeze(ref)


class Made:
    """A cell whose ref `thaw` made; `witness` is what the cell came with (None in
    value mode)."""

    __slots__ = ("witness",)

    def __init__(self, witness: Any):
        self.witness = witness


def refreeze(thawed: Any, record: list[Buffer | Made]) -> Any:
    """Undo `thaw`: freeze exactly the refs it made, giving back value-mode cells,
    and give back ref-mode cells as they came."""
    it = iter(record)
    eager = not under_trace()

    def one(path: str, buf: Buffer) -> Buffer:
        original = next(it)
        if isinstance(original, Made):
            return _rebuild(
                buf, value=_frozen(buf.value, eager), witness=original.witness
            )
        return original

    out = _map_cells_with_path(one, thawed)
    end = object()
    assert next(it, end) is end, "thaw/refreeze: the model changed its cells"
    return out
