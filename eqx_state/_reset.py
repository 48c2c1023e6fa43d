"""`reset`: set chosen state cells of a model back to their initial value."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp

from ._buffer import Buffer, MetricState, is_state
from ._compat import placed_as, placement_source
from ._errors import StateTypeError, StateValueError
from ._modes import check_tree_live, model_path


_T = TypeVar("_T")
Which = type | tuple[type, ...] | Callable[[Any], bool]


def _selector(which: Which) -> Callable[[Buffer], bool]:
    kinds = which if isinstance(which, tuple) else (which,)
    if all(isinstance(k, type) for k in kinds):
        bad = [k for k in kinds if not issubclass(k, Buffer)]  # pyright: ignore
        if bad or not kinds:
            raise StateTypeError(
                f"reset: `which` must be a cell kind (a subclass of eqx_state.Buffer, "
                "e.g. eqx_state.BatchStat), a tuple of kinds, or a predicate on "
                f"cells; got {which!r}."
            )
        return lambda cell: isinstance(cell, kinds)  # pyright: ignore
    if isinstance(which, tuple) or not callable(which):
        raise StateTypeError(
            "reset: `which` must be a cell kind (a subclass of eqx_state.Buffer), a "
            f"tuple of kinds, or a predicate on cells; got {which!r}."
        )
    return lambda cell: bool(which(cell))


def reset(model: _T, which: Which = MetricState) -> _T:
    """Set the state cells of `model` selected by `which` back to their initial
    value, `cell.init` (a Python scalar fill, broadcast to the cell's shape and cast
    to its dtype). By default every metric starts over ([`eqx_state.MetricState`][]
    cells: sums and counts 0, minima +inf, ...); other state and parameters are left
    alone.

    * Ref mode ([`eqx_state.to_refs`][]), or inside a step / `es.apply` (where the
      cells hold refs): the cells are written in place and the same model is
      returned, so `model = reset(model)` works in both modes.
    * Value mode: returns a new model with fresh arrays in the selected cells
      (eagerly, or under `jit`); `model` itself is unchanged.

    Every position is reset on its own: two cells holding one array are two
    values. Selecting a cell that has no initial value (`init=None`) raises a
    `ValueError` naming the cell's path; a model consumed by a donating step
    raises [`eqx_state.StaleModelError`][] (reset the model the step returned).

    **Arguments:**

    - `model`: any pytree holding state cells (a model, a metric, a collection).
    - `which`: the cells to reset: a kind (`eqx_state.BatchStat`), a tuple of kinds,
        or a predicate `cell -> bool`. Default: [`eqx_state.MetricState`][].

    **Returns:**

    The model with the selected cells at their initial values.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    mean = es.to_refs(es.metrics.Mean())
    mean.update(jnp.array([1.0, 2.0]))
    mean = es.reset(mean)
    mean.update(jnp.array([5.0]))
    assert float(mean.compute()) == 5.0
    ```
    """
    select = _selector(which)
    # A consumed model (its buffers donated to a step) would come back looking
    # reset and fail at its first read of anything else.
    check_tree_live(model)
    replaced = []

    def selected(x: Any) -> bool:
        return isinstance(x, Buffer) and x.value is not None and select(x)

    # Every selected cell is checked before any is written: a ref-mode cell is
    # reset in place, and a refusal must leave the model as it was.
    for path, x in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_state)[0]:
        if selected(x) and x.init is None:
            raise StateValueError(
                f"reset: the {type(x).__name__} cell at `{model_path(path)}` "
                "has no initial value to go back to (its `init` is None). Narrow "
                "`which` to the kinds you mean (e.g. `which=eqx_state.MetricState`), "
                "or give the cell one when it is built, `Buffer(value, init=0.0)`."
            )

    def one(path: Any, x: Any) -> Any:
        if not selected(x):
            return x
        # The fill is laid out as the cell's array (or its ref's) is (replicated
        # over a mesh that may span processes: a single-device array there could
        # not be saved by Orbax nor taken by a step), and committed only if it
        # was (`placed_as`; for a ref, JAX's write of a fill from elsewhere would
        # commit its array). A tracer's or a traced ref's is staged.
        src = placement_source(x.value)
        if src is None:
            fill = jnp.full(x.shape, x.init, x.dtype)
        else:
            with placed_as(src) as device:
                fill = jnp.full(x.shape, x.init, x.dtype, device=device)
        if isinstance(x.value, jax.Array):  # value mode: a fresh array
            replaced.append(path)
            return eqx.tree_at(lambda b: b.value, x, fill)
        x[...] = fill  # a ref (ref mode, or inside a step): written in place
        return x

    new = jax.tree_util.tree_map_with_path(one, model, is_leaf=is_state)
    return new if replaced else model  # all written in place: the same model
