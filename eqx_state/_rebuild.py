"""Rebuilding a carry from its leaves with one generated function per structure.

A step returns its new carry as leaves, and `treedef.unflatten(leaves)` rebuilds the
model and optimizer state from them: JAX calls the registered unflatten of every
node, for an Equinox module a Python function (`object.__new__`, then one
`object.__setattr__` per field) reached through a `functools.partial`. On a small
model that is a third of what the library adds to a step (stop 50: 58 us of a
~300 us step at the small MLP, 24 nodes).

`rebuilder(treedef)` returns a function that builds, from the leaves, objects equal
to `treedef.unflatten`'s in every observable way: each node of the same type, made
fresh, with the same `__dict__` (same keys, same order, the same leaf objects and
the very static values the structure holds), in straight-line code generated once
per structure. It is derived from `treedef.unflatten` itself, not from knowledge of
how Equinox lays out its modules: the structure is unflattened twice with marker
leaves, and the two results are walked side by side. A value that is the same
object in both is part of the structure (a static field, `None`); one that differs
was built by the unflatten and is rebuilt the same way. Only nodes whose rebuilding
is exactly known are handled:

* a tuple, a list or a dict (a new one of the items, in the same order: JAX's
  dict keeps its keys sorted), and a named tuple without an instance `__dict__`
  (`cls(*items)`, as JAX unflattens one);
* an `eqx.Module` with no `__slots__` of its own, whose `__dict__` is read as stored
  (`_reads_dict_as_stored`): `object.__new__(cls)` and its `__dict__`
  filled in the same order (what Equinox's unflatten does);
* a marker, standing for the leaf at its position, each exactly once.

Anything else (a list, a dict, another custom node, a leaf the unflatten changed)
gives `None`, and the caller uses `treedef.unflatten`. Before it is used, the
generated function is checked against `treedef.unflatten` on a third set of markers
(`_alike`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx


_new = object.__new__
_get = object.__getattribute__


class _Marker:
    """Stands for the leaf at position `i` in a probe of a structure."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


class _NotPlain(Exception):
    """A node this module does not rebuild (the caller falls back to unflatten)."""


def _reads_dict_as_stored(cls: type) -> bool:
    """Whether `obj.__dict__` of a `cls` instance is its stored dict: no class of
    its method resolution order defines a `__getattribute__` other than Equinox's,
    `object`'s or the library's own (`_buffer._LayerBase`, which returns the
    stored dict)."""
    from ._buffer import _LayerBase

    known = (
        eqx.Module.__getattribute__,
        object.__getattribute__,
        _LayerBase.__getattribute__,
    )
    return all(
        c.__dict__.get("__getattribute__", known[0]) in known for c in cls.__mro__
    )


def _plain_module(cls: type) -> bool:
    return (
        issubclass(cls, eqx.Module)
        and cls.__dictoffset__ != 0  # type: ignore[attr-defined]
        and all(
            set(c.__dict__.get("__slots__", ())) <= {"__weakref__", "__dict__"}
            for c in cls.__mro__
        )
        and _reads_dict_as_stored(cls)
    )


def _named_tuple(cls: type) -> bool:
    return (
        issubclass(cls, tuple) and hasattr(cls, "_fields") and cls.__dictoffset__ == 0  # type: ignore[attr-defined]
    )


class _Writer:
    """Generates the body of `build(L)` for a pair of probes."""

    def __init__(self, n: int):
        self.n = n
        self.lines: list[str] = []
        self.consts: dict[str, Any] = {}
        self.seen: set[int] = set()

    def const(self, x: Any) -> str:
        name = f"K{len(self.consts)}"
        self.consts[name] = x
        return name

    def expr(self, u: Any, v: Any) -> str:
        """Code for the object `u` (first probe; `v` the same in the second)."""
        tu = type(u)
        if tu is _Marker:
            if type(v) is not _Marker or v.i != u.i or u.i in self.seen:
                raise _NotPlain
            self.seen.add(u.i)
            return f"L[{u.i}]"
        if u is v:  # held by the structure itself (a static value, None)
            return self.const(u)
        if type(v) is not tu:
            raise _NotPlain
        if tu is tuple or tu is list or _named_tuple(tu):
            if len(u) != len(v):
                raise _NotPlain
            items = "".join(f"{self.expr(a, b)}, " for a, b in zip(u, v))
            if tu is tuple:
                return f"({items})"
            if tu is list:
                return f"[{items}]"
            return f"{self.const(tu)}({items})"
        if tu is dict:
            if list(u) != list(v) or not all(map(operator.is_, u, v)):
                raise _NotPlain
            items = "".join(f"{self.const(k)}: {self.expr(u[k], v[k])}, " for k in u)
            return f"{{{items}}}"
        if _plain_module(tu):
            du, dv = _get(u, "__dict__"), _get(v, "__dict__")
            if list(du) != list(dv):
                raise _NotPlain
            values = [self.expr(du[k], dv[k]) for k in du]
            var = f"o{len(self.lines)}"
            self.lines.append(f"{var} = new({self.const(tu)})")
            if du:
                self.lines.append(f"d = get({var}, '__dict__')")
                self.lines.extend(f"d[{k!r}] = {x}" for k, x in zip(du, values))
            return var
        raise _NotPlain


def rebuilder(treedef: Any) -> Callable[[Sequence[Any]], Any] | None:
    """A function equivalent to `treedef.unflatten` (see the module docstring), or
    `None` where the structure has a node it does not rebuild."""
    n = treedef.num_leaves
    try:
        first = treedef.unflatten([_Marker(i) for i in range(n)])
        second = treedef.unflatten([_Marker(i) for i in range(n)])
        writer = _Writer(n)
        root = writer.expr(first, second)
    except _NotPlain:
        return None
    except Exception:  # an unflatten that refuses markers: not a plain node
        return None
    if len(writer.seen) != n:
        return None
    source = "def build(L):\n" + "".join(
        f"    {line}\n" for line in (*writer.lines, f"return {root}")
    )
    namespace: dict[str, Any] = {"new": _new, "get": _get, **writer.consts}
    try:  # (a structure nested past what Python compiles: unflatten it)
        exec(compile(source, f"<eqx_state rebuild of {n} leaves>", "exec"), namespace)
    except (SyntaxError, RecursionError, MemoryError):  # pragma: no cover
        return None
    build = namespace["build"]
    markers = [_Marker(i) for i in range(n)]
    if not _alike(build(markers), treedef.unflatten(markers)):  # pragma: no cover
        return None  # a guard: the walk above already holds every node to this
    return build


def _alike(x: Any, y: Any) -> bool:
    """Whether `x` and `y` are built alike: the same leaves and static values (the
    same objects), the same node types and `__dict__` keys in the same order, and
    no object shared between them other than those."""
    if type(x) is _Marker or x is y:
        return x is y
    if type(x) is not type(y):
        return False
    if isinstance(x, (tuple, list)):
        return len(x) == len(y) and all(map(_alike, x, y))
    if type(x) is dict:
        return (
            list(x) == list(y)
            and all(map(operator.is_, x, y))
            and all(_alike(x[k], y[k]) for k in x)
        )
    if not _plain_module(type(x)):
        return False
    dx, dy = _get(x, "__dict__"), _get(y, "__dict__")
    return list(dx) == list(dy) and all(_alike(dx[k], dy[k]) for k in dx)
