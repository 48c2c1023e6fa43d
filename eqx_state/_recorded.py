"""`recorded`: everything the recorders of a model hold, as one flat mapping from
their paths in the model to values."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._buffer import is_array
from ._compat import Tracer
from ._modes import path_str
from .nn._record import Recorder


def _is_recorder(x: Any) -> bool:
    return isinstance(x, Recorder)


def _stack_root(leaves: list[tuple[tuple, Any]], path: tuple, lead: tuple) -> int:
    """How many keys of `path` lead to the outermost module whose arrays all have
    the leading axes `lead`: the stack (of layers, of ensemble members) that the
    recorder's extra axes index. Its index goes right after that module's path, so
    that `blocks.3.act.std` names the same layer whether the blocks are a Python
    list or a stack scanned over."""
    k = len(lead)
    for i in range(len(path) + 1):
        prefix = path[:i]
        inside = [x for p, x in leaves if p[:i] == prefix and is_array(x)]
        if inside and all(tuple(x.shape[:k]) == lead for x in inside):
            return i
    return len(path)  # pragma: no cover - the recorder's own cells always fit


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def recorded(model: Any) -> dict[str, Array]:
    """Everything recorded in `model`, as one flat mapping from names to values,
    ready to log: every [`eqx_state.nn.Record`][] statistic under
    `"<path of the recorder>.<statistic>"` (`"blocks.3.act.std"`) and every
    [`eqx_state.nn.Capture`][] under its path.

    A stacked recorder (layers stacked for scan-over-layers, an ensemble made with
    `eqx.filter_vmap`) reports one entry per layer: its index goes after the path
    of the outermost module whose arrays are all stacked, so a stack of blocks at
    `blocks` reports `"blocks.0.act.std"`, `"blocks.1.act.std"`, ..., the names a
    Python list of the same blocks gives.

    A read: it writes nothing and works eagerly, under `jit` and in both modes
    (e.g. in the `aux` of a loss function, to return the recordings of a step from
    inside it). Recorders in inference mode report what they hold (nothing was
    added while they were off).

    **Arguments:**

    - `model`: any pytree holding recorders (a model, or a recorder).

    **Returns:**

    A `dict` from names to JAX arrays (scalars for the built-in statistics), in the
    order of the model's tree. They are arrays of their own, never a cell's: a
    later step, which donates the model's cells, leaves them valid. Convert for a
    logger with `{k: float(v) for k, v in es.recorded(model).items()}` (scalars)
    or `jax.device_get`.

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    import eqx_state as es

    model = eqx.nn.Sequential([
        es.nn.Batched(eqx.nn.Linear(3, 4, key=jax.random.key(0))),
        eqx.nn.Lambda(jax.nn.relu),
        es.nn.Record("std", "dead_fraction"),
    ])
    y, model = es.apply(lambda m, x: m(x), model, jnp.ones((8, 3)))
    print(sorted(es.recorded(model)))  # ['layers.2.dead_fraction', 'layers.2.std']
    model = es.reset(model, es.RecordState)  # start the recordings over
    ```
    """
    nodes = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_recorder)[0]

    def fresh(v: Any) -> Any:
        # a copy: a statistic may be a cell's own array (a maximum, a capture),
        # which the next donating step would delete after it was handed out
        return v if isinstance(v, Tracer) else jnp.array(v, copy=True)

    leaves: list[tuple[tuple, Any]] | None = None
    out: dict[str, Array] = {}
    for path, node in nodes:
        if not _is_recorder(node):
            continue
        values = node.read()
        lead = node._stack_shape()
        if not lead:
            for name, v in values.items():
                out[_join(path_str(path), name)] = fresh(v)
            continue
        if leaves is None:
            leaves = jax.tree_util.tree_flatten_with_path(model)[0]
        root = _stack_root(leaves, tuple(path), lead)
        outer, inner = path_str(path[:root]), path_str(path[root:])
        for index in _indices(lead):
            at = ".".join(map(str, index))
            for name, v in values.items():
                out[_join(outer, at, inner, name)] = v[index]
    return out


def _indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [i + (j,) for i in out for j in range(n)]
    return out
