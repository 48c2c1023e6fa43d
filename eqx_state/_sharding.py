"""Layouts on a device mesh: where each array of a model and of its optimizer state
lives (`place`, the layout of `make_step(..., mesh=..., layout=...)`), and the
process-local -> global batch of a multi-process run (`global_batch`,
`process_slice`).

A *layout* says how each array of a model is split over the mesh: a rule
`(path, x) -> PartitionSpec | None`, or a sequence of `(regex, PartitionSpec)` pairs
(the first pattern found in the path wins). Everything it does not name is
replicated. It is applied to

* parameters, by their dotted path (`blocks.0.linear.weight`);
* state cells, by the cell's path (`blocks.0.bn.running_mean`): a cell is replicated
  unless the layout names it (name a per-channel statistic with its channel's
  parameters to shard it with them);
* the optimizer state, which is not matched against the layout: every leaf that is a
  copy of a parameter (Adam's `mu` and `nu`, a momentum; its path ends with the
  parameter's path and it has the parameter's shape) is laid out like that
  parameter, and the rest (step counts, scalars) is replicated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._buffer import _is_ref, is_state
from ._compat import Tracer, private_numpy_copy
from ._errors import (
    StateError,
    StateTypeError,
    StateValueError,
    StepError,
    check_int,
)
from ._modes import path_str


Rule = Callable[[str, jax.ShapeDtypeStruct], PartitionSpec | None]
# A `Rule`, a sequence of `(regex, PartitionSpec | None)` pairs, or None. Annotated
# `Any` so that a malformed layout reaches `layout_rule`, whose error shows the form.
Layout = Any


def _is_arraylike(x: Any) -> bool:
    return isinstance(
        x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct
    ) or _is_ref(x)


def layout_rule(layout: Layout) -> Rule:
    """The layout as a function `(path, x) -> PartitionSpec | None`."""
    if layout is None:
        return lambda path, x: None
    if callable(layout):
        return layout  # pyright: ignore[reportReturnType]
    if isinstance(layout, str | bytes) or not isinstance(layout, Sequence):
        raise StateTypeError(
            "`layout` must be a function `(path, x) -> PartitionSpec | None` or a "
            "sequence of `(regex, PartitionSpec)` pairs, got "
            f"{type(layout).__name__}."
        )
    pairs = []
    for item in layout:
        if not (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and (item[1] is None or isinstance(item[1], PartitionSpec))
        ):
            raise StateTypeError(
                "Each entry of a `layout` sequence is a pair `(regex, PartitionSpec)`, "
                f"e.g. `(r'mlp\\.0\\.weight$', P('model', None))`; got {item!r}."
            )
        pairs.append((re.compile(item[0]), item[1]))

    def rule(path: str, x: jax.ShapeDtypeStruct) -> PartitionSpec | None:
        for pattern, spec in pairs:
            if pattern.search(path):
                return spec
        return None

    return rule


def _entry_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _checked(where: str, shape: tuple[int, ...], spec: Any, mesh: Any) -> PartitionSpec:
    """`spec` after checking that it fits an array of `shape` on `mesh`."""
    if spec is None:
        return PartitionSpec()
    if not isinstance(spec, PartitionSpec):
        raise StateTypeError(
            f"The layout gave {spec!r} for `{where}`; a layout returns a "
            "`jax.sharding.PartitionSpec` (or None: replicated)."
        )
    sizes = dict(mesh.shape)
    fix = (
        "Change the layout for this path (a `PartitionSpec` with at most one entry "
        "per dimension, naming mesh axes whose sizes divide the dimension), or "
        "return None to replicate it."
    )
    if len(spec) > len(shape):
        raise StepError(
            f"The layout puts `{where}` (shape {shape}) on {spec}: more entries than "
            f"the array has dimensions. {fix}"
        )
    used: set[str] = set()
    for dim, (n, entry) in enumerate(zip(shape, spec)):
        axes = _entry_axes(entry)
        for a in axes:
            if a not in sizes:
                raise StepError(
                    f"The layout puts `{where}` on {spec}, but the mesh has no axis "
                    f"{a!r} (its axes: {dict(sizes)}). {fix}"
                )
            if a in used:
                raise StepError(
                    f"The layout puts `{where}` on {spec}: mesh axis {a!r} is used "
                    f"twice. {fix}"
                )
            used.add(a)
        parts = math.prod(sizes[a] for a in axes)
        if n % parts:
            raise StepError(
                f"The layout splits dimension {dim} of `{where}` (shape {shape}) over "
                f"{'x'.join(axes)} ({parts} devices), which does not divide {n}. {fix}"
            )
    return spec


def _shape_dtype(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(np.shape(x)), x.dtype)


def _model_specs(model: Any, mesh: Any, layout: Layout) -> tuple[list, dict]:
    """One `PartitionSpec` (or None for a leaf that is not an array) per leaf of
    `model`, in flattening order; and the parameters' specs by key path (for the
    optimizer state)."""
    rule = layout_rule(layout)
    specs: list[PartitionSpec | None] = []
    by_path: dict[tuple, tuple[tuple[int, ...], PartitionSpec]] = {}
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_state)[0]
    for path, node in flat:
        where = path_str(path) or "<root>"
        if is_state(node):
            leaves = jax.tree_util.tree_leaves(node)
            value = node.value
            if _is_arraylike(value):
                sds = _shape_dtype(value)
                spec = _checked(where, sds.shape, rule(where, sds), mesh)
            else:  # pragma: no cover - a cell always holds an array or a ref
                spec = None
            # the value, and (ref mode) its shape witness, laid out alike
            specs.extend(spec if _is_arraylike(x) else None for x in leaves)
        elif _is_arraylike(node):
            sds = _shape_dtype(node)
            spec = _checked(where, sds.shape, rule(where, sds), mesh)
            specs.append(spec)
            if path:
                by_path[tuple(path)] = (sds.shape, spec)
        else:
            specs.append(None)
    return specs, by_path


def _follow_params(tree: Any, by_path: dict) -> list:
    """One spec per leaf of an optimizer state: a parameter's spec for a leaf that
    copies it (its path ends with the parameter's path, and it has its shape),
    replicated for other arrays, None for the rest."""
    lengths = sorted({len(p) for p in by_path}, reverse=True)
    specs: list[PartitionSpec | None] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not _is_arraylike(leaf):
            specs.append(None)
            continue
        spec = PartitionSpec()
        path = tuple(path)
        shape = tuple(np.shape(leaf))
        for n in lengths:
            if n <= len(path):
                hit = by_path.get(path[len(path) - n :])
                if hit is not None and hit[0] == shape:
                    spec = hit[1]
                    break
        specs.append(spec)
    return specs


def carry_shardings(
    model: Any, opt_state: Any, mesh: Any, layout: Layout
) -> tuple[list, list]:
    """The `NamedSharding` of every leaf of `model` and of `opt_state` (None for a
    leaf that is not an array), in flattening order."""
    specs, by_path = _model_specs(model, mesh, layout)
    opt_specs = _follow_params(opt_state, by_path)

    def named(s: PartitionSpec | None) -> NamedSharding | None:
        return None if s is None else NamedSharding(mesh, s)

    return [named(s) for s in specs], [named(s) for s in opt_specs]


def _put(path: str, x: Any, sharding: NamedSharding | None) -> Any:
    if sharding is None:
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type
        )
    if _is_ref(x):
        if not x.sharding.is_equivalent_to(sharding, len(x.shape)):
            raise StateError(ref_placement_message(path, x.sharding, sharding))
        return x
    if isinstance(x, Tracer) or not isinstance(x, jax.Array):
        return x  # NumPy leaves stay host values (a step puts them on each call)
    return jax.device_put(x, sharding)


def ref_placement_message(path: str, have: Any, want: Any) -> str:
    return (
        f"The ref-mode state cell `{path}` lives on {have}, but the step takes it "
        f"as {want}. JAX cannot move a ref, so a ref-mode model is made where the "
        "step wants it: place the value-mode model first, then make the refs: "
        "`es.to_refs(es.place(model, mesh, layout))` (or "
        "`es.to_refs(model, sharding=NamedSharding(mesh, PartitionSpec()))` for a "
        "replicated model), from a value-mode model (e.g. `es.freeze(model)`)."
    )


def _placed(tree: Any, shardings: list) -> Any:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = [
        _put(path_str(p).removesuffix(".value"), x, s)
        for (p, x), s in zip(flat, shardings)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def check_mesh(where: str, mesh: Any) -> None:
    """The one check of a `mesh=` argument: a `jax.sharding.Mesh` (JAX's own
    errors for anything else name no argument)."""
    if not isinstance(mesh, Mesh):
        raise StateTypeError(
            f"{where}: mesh must be a jax.sharding.Mesh (e.g. "
            f"`jax.make_mesh((n,), ('data',))`), got {type(mesh).__name__}."
        )


def place(model: Any, mesh: Mesh, layout: Layout = None) -> Any:
    """Lay `model` out on `mesh`: every array is put where `layout` says (replicated
    where it says nothing), as a step with the same mesh and layout takes it.

    Works on concrete models (the arrays are `jax.device_put`; in a multi-process
    run every process passes the same values, e.g. a model built from the same key)
    and on abstract ones (`jax.ShapeDtypeStruct` leaves, from
    `eqx.filter_eval_shape`: they get the sharding, nothing is allocated — the
    target of a sharded checkpoint restore). A ref-mode cell cannot be moved: it is
    checked to be where the layout wants it (make ref-mode models with
    `es.to_refs(es.place(model, mesh, layout))`). NumPy leaves are left as they are.

    **Arguments:**

    - `model`: any pytree (a model, in either mode).
    - `mesh`: a `jax.sharding.Mesh`.
    - `layout`: how each array is split: a function `(path, x) -> PartitionSpec |
        None` (`path` the dotted name, `blocks.0.linear.weight`; a state cell's
        path is the cell's, `bn.running_mean`; `x` a `jax.ShapeDtypeStruct`), or a
        sequence of `(regex, PartitionSpec)` pairs searched in the path in order
        (the first match wins). None (everywhere, or for one path): replicated.

    **Returns:**

    `model` with every array laid out on the mesh.

    **Example:**

    ```python
    import equinox as eqx, jax
    from jax.sharding import PartitionSpec as P
    import eqx_state as es

    mesh = jax.make_mesh((1,), ("model",))
    lin = eqx.nn.Linear(4, 8, key=jax.random.key(0))
    lin = es.place(lin, mesh, [(r"weight$", P("model", None)), (r"bias$", P("model"))])
    assert lin.weight.sharding.spec == P("model", None)
    ```
    """
    check_mesh("eqx_state.place", mesh)
    specs, _ = _model_specs(model, mesh, layout)
    return _placed(
        model, [None if s is None else NamedSharding(mesh, s) for s in specs]
    )


class Placement:
    """Where a step's arrays go on its mesh, handed to the compiled call as data:
    the model by `layout` (replicated by default), the optimizer state like its
    parameters, an array argument sharded over `data_axis` on its batch axis
    (`batch_axis`: 0 for a step, 1 for its scan, whose arguments are `[K, batch,
    ...]`), or replicated when it has none."""

    def __init__(self, mesh: Any, layout: Layout, data_axis: str, batch_axis: int):
        self.mesh = mesh
        self.layout = layout
        self.data_axis = data_axis
        self.batch_axis = batch_axis

    def carry(self, carry: tuple) -> list[Any]:
        """One sharding (or None: not an array) per leaf of `(model, opt_state)`."""
        model, opt_state = carry
        model_sh, opt_sh = carry_shardings(model, opt_state, self.mesh, self.layout)
        return [*model_sh, *opt_sh]

    def arg(self, x: Any) -> Any:
        """Where an array argument goes."""
        if np.ndim(x) > self.batch_axis:
            spec = (None,) * self.batch_axis + (self.data_axis,)
            return NamedSharding(self.mesh, PartitionSpec(*spec))
        return NamedSharding(self.mesh, PartitionSpec())


def place_carry(model: Any, opt_state: Any, mesh: Any, layout: Layout) -> tuple:
    """`(model, opt_state)` placed as a step with this mesh and layout takes them."""
    model_sh, opt_sh = carry_shardings(model, opt_state, mesh, layout)
    return _placed(model, model_sh), _placed(opt_state, opt_sh)


def constrain(x: Any, sharding: NamedSharding) -> Any:
    """Inside a trace: `x` laid out as `sharding` (`jax.sharding.reshard` over the
    mesh's Explicit axes, `with_sharding_constraint` over its Auto ones)."""
    mesh = sharding.mesh
    explicit = set(getattr(mesh, "explicit_axes", ()))
    if not explicit:
        return jax.lax.with_sharding_constraint(x, sharding)
    spec = sharding.spec
    auto = [_entry_axes(e) for e in spec]
    if not any(a not in explicit for axes in auto for a in axes) and len(
        explicit
    ) == len(mesh.axis_names):
        return jax.sharding.reshard(x, sharding)

    def keep(pred: Callable[[str], bool]) -> PartitionSpec:
        out = []
        for axes in auto:
            kept = tuple(a for a in axes if pred(a))
            out.append(kept[0] if len(kept) == 1 else (kept or None))
        return PartitionSpec(*out)

    x = jax.sharding.reshard(x, NamedSharding(mesh, keep(lambda a: a in explicit)))
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, keep(lambda a: a not in explicit))
    )


def explain_sharding_error(e: Exception, mesh: Any) -> None:
    """Add a note to JAX's error about an ambiguous sharded operation (a matmul
    whose contraction is split) under a mesh with Explicit axes."""
    if type(e).__name__ != "ShardingTypeError" or not getattr(
        mesh, "explicit_axes", ()
    ):
        return
    names = tuple(mesh.axis_names)
    e.add_note(
        f"eqx_state: the step's mesh has Explicit axes {tuple(mesh.explicit_axes)}, "
        "with which JAX asks the model's code to say how each sharded operation is "
        "split (`out_sharding=`). A layout that splits parameters (tensor parallel, "
        "fully sharded) over a model written without that runs on Auto axes, where "
        "XLA places the communication: `jax.make_mesh(shape, "
        f"{names}, axis_types=(jax.sharding.AxisType.Auto,) * {len(names)})`."
    )


def spans_processes(mesh: Any) -> bool:
    """Whether `mesh` has devices of other processes (a multi-process run)."""
    here = jax.process_index()
    return any(d.process_index != here for d in mesh.devices.flat)


def global_batch(
    batch: Any, mesh: Mesh, *, data_axis: str = "data", batch_axis: int = 0
) -> Any:
    """Build the global batch of a multi-process step from this process's part of it.

    In a multi-process run (`jax.distributed.initialize`) every process loads only
    its own rows of the global batch ([`eqx_state.process_slice`][] says which);
    this turns them into global `jax.Array`s sharded over `data_axis`
    (`jax.make_array_from_process_local_data`), which is what a step with
    `mesh=mesh` takes. In one process it is a `jax.device_put` of the whole batch.
    Arrays with no batch axis (fewer than `batch_axis + 1` dimensions) are taken
    as the same value in every process and replicated.

    **Arguments:**

    - `batch`: a pytree of this process's arrays (NumPy or JAX), each with the
        batch on axis `batch_axis`.
    - `mesh`: the step's mesh (all processes' devices).
    - `data_axis`: the mesh axis that shards the batch.
    - `batch_axis`: 0 for a step's arguments, 1 for [`Step.scan`][eqx_state._step.Step.scan]'s
        (`[K, batch, ...]`).

    **Returns:**

    The same pytree of global arrays, whose leading (batch) dimension is the sum
    over processes.

    **Example:**

    ```python
    import jax, numpy as np
    import eqx_state as es

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rows = es.process_slice(8, mesh)  # this process's rows of a batch of 8
    x = np.arange(16.0).reshape(8, 2)[rows]
    x = es.global_batch(x, mesh)
    assert x.shape == (8, 2)
    ```
    """
    check_mesh("eqx_state.global_batch", mesh)
    if data_axis not in mesh.axis_names:
        raise StateValueError(
            f"global_batch: the mesh has axes {mesh.axis_names}, not {data_axis!r}. "
            "Pass `data_axis=` naming the axis that shards the batch."
        )
    spec = PartitionSpec(*(None,) * batch_axis, data_axis)
    sharded, replicated = (
        NamedSharding(mesh, spec),
        NamedSharding(mesh, PartitionSpec()),
    )

    def one(x: Any) -> Any:
        if not isinstance(x, jax.Array | np.ndarray | np.generic):
            return x
        if isinstance(x, np.ndarray):  # the caller may refill its buffer
            x = private_numpy_copy(x)
        elif not isinstance(x, jax.Array):
            x = np.asarray(x)
        sharding = sharded if np.ndim(x) > batch_axis else replicated
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree.map(one, batch)


def _bounds(index: slice, size: int) -> tuple[int, int]:
    return index.start or 0, size if index.stop is None else index.stop


def process_slice(batch_size: int, mesh: Mesh, *, data_axis: str = "data") -> slice:
    """The rows of a global batch of `batch_size` that this process feeds to
    [`eqx_state.global_batch`][]: those held by its devices on `mesh` when the batch
    is sharded over `data_axis`.

    **Arguments:**

    - `batch_size`: the global batch size (divisible by the size of `data_axis`).
    - `mesh`: the step's mesh.
    - `data_axis`: the mesh axis that shards the batch.

    **Returns:**

    A `slice` of the global batch: `slice(0, batch_size)` in one process; with two
    processes that split the data axis in halves, `slice(0, B/2)` in process 0 and
    `slice(B/2, B)` in process 1.
    """
    check_mesh("eqx_state.process_slice", mesh)
    batch_size = check_int("process_slice", "batch_size", batch_size, 1)
    if data_axis not in mesh.axis_names:
        raise StateValueError(
            f"process_slice: the mesh has axes {mesh.axis_names}, not {data_axis!r}."
        )
    n = dict(mesh.shape)[data_axis]
    if batch_size % n:
        raise StateValueError(
            f"process_slice: the batch size {batch_size} does not divide over the "
            f"{n} shards of mesh axis {data_axis!r}."
        )
    sharding = NamedSharding(mesh, PartitionSpec(data_axis))
    rows = sorted(
        {
            _bounds(idx[0], batch_size)  # pyright: ignore[reportOptionalSubscript]
            for idx in sharding.addressable_devices_indices_map((batch_size,)).values()
        }
    )
    start, stop = rows[0][0], rows[-1][1]
    if any(a[1] != b[0] for a, b in zip(rows, rows[1:])):
        raise StateValueError(
            f"process_slice: this process's devices hold rows {rows} of the batch, "
            "not one contiguous block; build the global batch with "
            "`jax.make_array_from_callback` instead."
        )
    return slice(start, stop)
