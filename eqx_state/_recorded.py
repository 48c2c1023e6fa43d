"""`recorded`: everything the recorders of a model hold, as one flat mapping from
their paths in the model to values."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._compat import Tracer

# one naming rule for every persistence path: PyTorch's, as `es.state_dict`
from ._state_dict import _put
from ._torch_names import _join, torch_path_name
from .nn._record import Recorder


def _is_recorder(x: Any) -> bool:
    return isinstance(x, Recorder)


def _child(node: Any, key: Any) -> Any:
    """The child of the pytree node `node` under the key-path entry `key` (one
    level of `jax.tree_util.tree_flatten_with_path`, so any pytree works)."""
    children = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )[0]
    for (k,), child in children:
        if k == key:
            return child
    raise KeyError(key)  # pragma: no cover - `key` comes from flattening `node`


def _names(model: Any, path: tuple) -> tuple[list[str], list[bool]]:
    """The recorder at `path` in `model`, named as `es.state_dict` names it
    (`torch_path_name`, the one naming rule): one name per key of the path (`""`
    for a key that PyTorch does not name: `eqx.nn.Sequential`'s `layers`,
    `es.nn.Batched`'s `layer`), and, per key, whether the node the key leads out
    of is an `eqx.Module`."""
    names, modules = [], []
    node, before, final = model, "", torch_path_name(model, path)
    for k, key in enumerate(path):
        here = torch_path_name(model, path[: k + 1])
        if here != before and (final == here or final.startswith(here + ".")):
            names.append(here[len(before) :].lstrip("."))
            before = here
        else:  # a key the final name does not show
            names.append("")
        modules.append(isinstance(node, eqx.Module))
        node = _child(node, key)
    return names, modules


def _dotted(*parts: str) -> str:
    name = ""
    for part in parts:
        name = _join(name, part)
    return name


def recorded(model: Any) -> dict[str, Array]:
    """Everything recorded in `model`, as one flat mapping from names to values,
    ready to log: every [`eqx_state.nn.Record`][] statistic under
    `"<path of the recorder>.<statistic>"` (`"blocks.3.act.std"`) and every
    [`eqx_state.nn.Capture`][] under its path.

    Paths are named as [`eqx_state.state_dict`][] names the model (PyTorch's
    names): fields by name, list/tuple items by index, dict items by key, and an
    `eqx.nn.Sequential` as `torch.nn.Sequential` (`"features.2.std"`, not
    `"features.layers.2.std"`; an `es.nn.Batched` wrapper is the layer it maps).

    A stacked recorder (layers stacked for scan-over-layers, an ensemble made with
    `eqx.filter_vmap`) reports one entry per layer. The names come from the
    model's structure, never from array shapes: the recorder's stacking axes are
    those of its cells beyond their declared shapes, and the index goes right
    after the path of the module that holds the recorder (the block that
    `eqx.filter_vmap` stacked) — or of the outermost module on its path that holds
    another recorder stacked alike, when every recorder inside that module is
    stacked alike. A stack of blocks at `blocks`, each with a recorder field
    `act`, reports `"blocks.0.act.std"`, `"blocks.1.act.std"`, ..., the names a
    Python list of the same blocks gives; a list of two such stacks,
    `"0.1.act.std"` for layer 1 of stack 0. A recorder held by no module (a
    stacked recorder at the root, or in a list or dict) is the stack itself: the
    index goes after its own path (`"members.0.max"`). (A stacked block whose
    only recorder sits in a submodule is indexed after that submodule,
    `"blocks.mlp.0.act.std"`: a recorder field of the block itself gives the
    list's names to both.)

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
    print(sorted(es.recorded(model)))  # ['2.dead_fraction', '2.std']
    model = es.reset(model, es.RecordState)  # start the recordings over
    ```
    """
    nodes = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_recorder)[0]

    def fresh(v: Any) -> Any:
        # a copy: a statistic may be a cell's own array (a maximum, a capture),
        # which the next donating step would delete after it was handed out
        return v if isinstance(v, Tracer) else jnp.array(v, copy=True)

    recorders = [(tuple(p), r) for p, r in nodes if _is_recorder(r)]
    roots = _stack_roots(model, recorders)
    out: dict[str, Array] = {}
    for (path, node), root in zip(recorders, roots):
        values = node.read()
        names, _ = _names(model, path)
        lead = node._stack_shape()
        if not lead:
            for name, v in values.items():
                _put(out, _dotted(*names, name), fresh(v))
            continue
        outer, inner = _dotted(*names[:root]), _dotted(*names[root:])
        for index in _indices(lead):
            at = ".".join(map(str, index))
            for name, v in values.items():
                _put(out, _dotted(outer, at, inner, name), v[index])
    return out


def _stack_roots(model: Any, recorders: list[tuple[tuple, Any]]) -> list[int]:
    """For each recorder, how many keys of its path lead to the stack its extra
    axes index (where its index goes in its name). From the structure alone:

    - a stacked recorder's stacking axes are its cells' axes beyond their declared
      shapes (the recorder's own static configuration);
    - its stack is the module that holds it (the block `eqx.filter_vmap` stacked),
      or, if another stacked recorder with the same stacking axes is held by a
      module further out on its path, the outermost such module (a block holding
      the recorder in a submodule is one stack, named as one), provided that every
      recorder inside that module is stacked alike;
    - a recorder held by no such module (at the root, in a list or dict) is the
      stack itself: the index follows its own path."""
    info = []
    for path, node in recorders:
        _, modules = _names(model, path)
        owner = max((i for i, m in enumerate(modules) if m), default=None)
        info.append((path, node._stack_shape(), owner))

    def uniform(prefix: tuple, lead: tuple) -> bool:
        return all(
            other_lead == lead
            for other, other_lead, _ in info
            if other[: len(prefix)] == prefix
        )

    candidates = {
        (path[:owner], lead)
        for path, lead, owner in info
        if lead and owner is not None and uniform(path[:owner], lead)
    }
    roots = []
    for path, lead, _ in info:
        found = [len(p) for p, ld in candidates if ld == lead and path[: len(p)] == p]
        roots.append(min(found, default=len(path)))
    return roots


def _indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [i + (j,) for i in out for j in range(n)]
    return out
