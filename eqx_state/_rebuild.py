"""Rebuilding a loop's carry from its leaves with one generated function.

A step returns its new carry as leaves, and `treedef.unflatten(leaves)` rebuilds the
model and optimizer state from them: JAX calls the registered unflatten of every
node, for an Equinox module a Python function (`object.__new__`, then one
`object.__setattr__` per field) reached through a `functools.partial`. On a small
model that is a third of what the library adds to a step (57 us of a ~300 us step
at the small MLP, 24 nodes).

`rebuilder(treedef)` returns a function that builds, from the leaves, objects equal
to `treedef.unflatten`'s in every observable way: each node of the same type, made
fresh, with the same `__dict__` (same keys, same order, the same leaf objects and
the very static values this `treedef` holds), in straight-line code. It is derived
from `treedef.unflatten` itself: the structure is unflattened twice with marker
leaves, and the two results are walked side by side. A value that is the same
object in both is the structure's own (a static field, `None`); one that differs
was built by the unflatten and is rebuilt the same way. Only nodes whose unflatten
is known exactly are handled:

* a tuple, and a named tuple JAX unflattens with its built-in rule
  (`cls(*children)`: one not registered as a node type of its own) built by the
  `__new__` `collections.namedtuple` generates, without an `__init__` of its own or
  an instance `__dict__`;
* an Equinox module (Equinox registers its own generated unflatten, which cannot be
  replaced: `object.__new__(cls)`, then each field with `object.__setattr__`) with
  no `__slots__` of its own, whose `__dict__` is read as stored
  (`_reads_dict_as_stored`), and with no data descriptor in its class under a
  field's name (which `object.__setattr__` would call, and a `__dict__` write
  would not): the new object's `__dict__` is filled in the same order;
* a marker, standing for the leaf at its position, each exactly once.

The node types are checked before anything is unflattened, so the probes run no
user code. For anything else (a list, a dict, another custom node, a leaf the
unflatten changed) `rebuilder` gives `None` and the caller uses
`treedef.unflatten`; it never raises. The generated function is checked against
`treedef.unflatten` on a third set of markers before it is returned (`_alike`),
and its code is shared by every structure that generates the same source (each
bound to its own static values).

`rebuilder(treedef, kept)` generates `build(L, C)` instead, which takes the modules
all of whose leaves are at the positions `kept` from `C`, the carry the previous
call returned (see `rebuilder`)."""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import equinox as eqx

from ._compat import is_registered_node_type


_new = object.__new__
_get = object.__getattribute__
# compiled code by source: the structures of one model (each new `treedef` of a
# loop) share it; bounded, cleared when full
_CODE: dict[str, types.CodeType] = {}
_CODE_LIMIT = 64
# whether a module class is rebuilt here (`_known_node_type`)
_KNOWN: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


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


def _known_node_type(cls: type) -> bool:
    """Whether nodes of type `cls` are rebuilt exactly here (see the module
    docstring); found once per module class (a named tuple is asked each time:
    it may be registered as a node type of its own later)."""
    known = _KNOWN.get(cls)
    if known is None:
        if not issubclass(cls, eqx.Module):
            return _named_tuple(cls)
        known = _KNOWN[cls] = _plain_module(cls)
    return known


def _plain_module(cls: type) -> bool:
    """An Equinox module whose instances are rebuilt exactly by filling a new
    instance's `__dict__`: Equinox's unflatten, with no user code on the way."""
    if not (
        issubclass(cls, eqx.Module)
        and cls.__dictoffset__ != 0  # type: ignore[attr-defined]
        and _reads_dict_as_stored(cls)
    ):
        return False
    names = [f.name for f in dataclasses.fields(cls)]  # pyright: ignore[reportArgumentType]
    for c in cls.__mro__:
        if not set(c.__dict__.get("__slots__", ())) <= {"__weakref__", "__dict__"}:
            return False
        for name in names:  # a data descriptor: `object.__setattr__` calls it
            if hasattr(type(c.__dict__.get(name)), "__set__"):
                return False
    return True


def _named_tuple(cls: type) -> bool:
    """A named tuple that JAX unflattens with its built-in rule (not registered as
    a node type of its own), built by the `__new__` `collections.namedtuple`
    generates (the items in order: no user code), with no `__init__` of its own
    and no instance `__dict__`."""
    if not (
        issubclass(cls, tuple)
        and hasattr(cls, "_fields")
        and cls.__dictoffset__ == 0  # type: ignore[attr-defined]
        and is_registered_node_type(cls) is False
    ):
        return False
    generated = getattr(cls.__new__, "__globals__", {}).get("_tuple_new")
    return generated is tuple.__new__ and cls.__init__ is tuple.__init__


def every_node_type(treedef: Any, accept: Callable[[type], bool]) -> bool:
    """Whether `accept(t)` holds for the type `t` of every node of `treedef`
    (tuples and `None` always do). A walk with a stack: a deeply nested model is
    not a Python recursion."""
    todo = [treedef]
    while todo:
        node = todo.pop()
        data = node.node_data()
        if data is None:  # a leaf
            continue
        kind = data[0]
        if not (kind is tuple or kind is type(None) or accept(kind)):
            return False
        todo.extend(node.children())
    return True


class _Writer:
    """Generates the body of `build(L)` (`build(L, C)` with `kept`) for a pair of
    probes."""

    def __init__(self, kept: frozenset[int] | None = None):
        self.lines: list[str] = []
        self.consts: list[Any] = []
        self.seen: set[int] = set()
        self.kept = kept
        self.codes: dict[tuple, str] = {("C",): "C"}  # a path in `C` -> its code

    def code(self, path: tuple) -> str:
        """Code for the node at `path` of the old carry `C`: `("C",)`, or
        `(parent, j)` for item `j` of a tuple, `(parent, (j,))` of a named tuple
        (read with `tuple.__getitem__`: not a `__getitem__` of its own), or
        `(parent, name)` for a module's field (its `__dict__` fetched once into a
        local, by the first node reused below it)."""
        code = self.codes.get(path)
        if code is None:
            parent, key = path
            if type(key) is int:  # an item of a plain tuple
                code = f"{self.code(parent)}[{key}]"
            elif type(key) is tuple:  # of a named tuple: not its own `__getitem__`
                code = f"item({self.code(parent)}, {key[0]})"
            else:
                d = self.codes.get((parent, None))
                if d is None:
                    d = self.codes[(parent, None)] = f"c{len(self.codes)}"
                    self.lines.append(f"{d} = get({self.code(parent)}, '__dict__')")
                code = f"{d}[{key!r}]"
            self.codes[path] = code
        return code

    def const(self, x: Any) -> str:
        self.consts.append(x)
        return f"K{len(self.consts) - 1}"

    def expr(self, u: Any, v: Any, path: tuple | None = None) -> str:
        """Code for the object `u` (first probe; `v` the same in the second);
        `path`: where the same node is in the old carry (with `kept`)."""
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
        if tu is tuple or (_known_node_type(tu) and not issubclass(tu, eqx.Module)):
            if len(u) != len(v):
                raise _NotPlain

            def at(j: int) -> tuple | None:
                """Where item `j` is in the old carry (see `code`)."""
                if path is None:
                    return None
                return (path, j) if tu is tuple else (path, (j,))

            items = "".join(
                f"{self.expr(a, b, at(j))}, " for j, (a, b) in enumerate(zip(u, v))
            )
            return f"({items})" if tu is tuple else f"{self.const(tu)}({items})"
        if issubclass(tu, eqx.Module) and _known_node_type(tu):
            du, dv = _get(u, "__dict__"), _get(v, "__dict__")
            if list(du) != list(dv):
                raise _NotPlain
            if path is not None:
                below = _markers(u)
                if self.kept is not None and below is not None and below <= self.kept:
                    # Every leaf below is the old carry's own: the old node is
                    # what this code would build (see `rebuilder`)
                    if below & self.seen:
                        raise _NotPlain
                    self.seen |= below
                    return self.code(path)
            values = [
                self.expr(du[k], dv[k], None if path is None else (path, k)) for k in du
            ]
            var = f"o{len(self.lines)}"
            self.lines.append(f"{var} = new({self.const(tu)})")
            if du:
                self.lines.append(f"d = get({var}, '__dict__')")
                self.lines.extend(f"d[{k!r}] = {x}" for k, x in zip(du, values))
            return var
        raise _NotPlain


def _markers(x: Any) -> set[int] | None:
    """The positions of the markers in the probe node `x` (tuples and modules
    walked; any other value holds none), or None if a module in it is not of a
    reusable type (`_reusable`)."""
    out: set[int] = set()
    todo = [x]
    while todo:
        y = todo.pop()
        if type(y) is _Marker:
            out.add(y.i)
        elif isinstance(y, tuple):
            todo.extend(y)
        elif isinstance(y, eqx.Module):
            if not _reusable(type(y)):
                return None
            todo.extend(_get(y, "__dict__").values())
    return out


_REUSABLE: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _reusable(cls: type) -> bool:
    """Whether a module of type `cls` may be kept from the old carry: no class of
    its method resolution order has a `functools.cached_property`, which writes
    into the instance's `__dict__` when first read (Equinox allows it; a module
    refuses every other attribute assignment). A kept module would carry that
    value, computed from the old carry, into the new one (a fresh module reads it
    again), and a `__dict__` with more keys than fields flattens differently."""
    ok = _REUSABLE.get(cls)
    if ok is None:
        ok = _REUSABLE[cls] = not any(
            isinstance(v, functools.cached_property)
            for c in cls.__mro__
            for v in c.__dict__.values()
        )
    return ok


def rebuilder(
    treedef: Any, kept: frozenset[int] | None = None
) -> Callable[..., Any] | None:
    """A function equivalent to `treedef.unflatten` (see the module docstring), or
    `None` where the structure has a node it does not rebuild. Never raises.

    With `kept` (leaf positions), the function is `build(L, C)`: `C` is an
    object of this structure (the carry the previous call returned) whose leaf at
    each position in `kept` is `L`'s. A module node all of whose leaves are at
    positions in `kept` (a ref-mode cell: its ref and shape witness; a module with
    no leaves) is then `C`'s node at the same place, not a new one. That is
    exactly what a new one would be: `C`'s node was built from this `treedef`
    (the same static values) and the same leaf objects, into a `__dict__` of the
    same keys in the same order, and it cannot have changed since: a module
    refuses attribute assignment, and a module type with a
    `functools.cached_property` (which writes into the instance's `__dict__`, as
    Equinox allows) is never kept, nor a module holding one (`_reusable`). Only
    its identity differs: the new carry shares that node with `C`, as it already
    shares its leaves (a ref-mode cell's ref). This saves building such nodes
    and freeing the old ones, per call (a ref-mode model's cells)."""
    try:
        return _rebuilder(treedef, kept)
    except Exception:  # a node that refuses markers, a structure too deep...
        return None


def _rebuilder(treedef: Any, kept: frozenset[int] | None) -> Callable[..., Any] | None:
    # the node types first, before any unflatten runs: a probe would run user
    # code (e.g. a named tuple's own `__new__`) on markers
    if not every_node_type(treedef, _known_node_type):
        return None
    n = treedef.num_leaves
    first = treedef.unflatten([_Marker(i) for i in range(n)])
    second = treedef.unflatten([_Marker(i) for i in range(n)])
    writer = _Writer(kept)
    try:
        root = writer.expr(first, second, None if kept is None else ("C",))
    except _NotPlain:
        return None
    if len(writer.seen) != n:
        return None
    source = f"def build(L{'' if kept is None else ', C'}):\n" + "".join(
        f"    {line}\n" for line in (*writer.lines, f"return {root}")
    )
    code = _CODE.get(source)
    if code is None:
        if len(_CODE) >= _CODE_LIMIT:
            _CODE.clear()
        code = _CODE[source] = compile(source, f"<rebuild of {n} leaves>", "exec")
    namespace: dict[str, Any] = {"new": _new, "get": _get, "item": tuple.__getitem__}
    namespace.update((f"K{j}", x) for j, x in enumerate(writer.consts))
    exec(code, namespace)
    build = namespace.pop("build")  # (not kept in its own globals: no cycle)
    markers = [_Marker(i) for i in range(n)]
    if kept is None:
        if not _alike(build(markers), treedef.unflatten(markers)):  # pragma: no cover
            return None  # a guard: the node types checked above are built this way
        return build
    old = treedef.unflatten(markers)
    if not _alike_reusing(build(markers, old), treedef.unflatten(markers), old, kept):
        return None  # pragma: no cover - a guard, as above
    return build


def _alike_reusing(x: Any, y: Any, old: Any, kept: frozenset[int]) -> bool:
    """`_alike(x, y)`, where a module node of `x` may also be the very node of
    `old` at its place, when all its leaves are at positions in `kept`."""
    if isinstance(x, eqx.Module) and x is old:
        below = _markers(x)
        return below is not None and below <= kept and _alike(x, y)
    if type(x) is _Marker or x is y or type(x) is not type(y):
        return _alike(x, y)
    if isinstance(x, tuple):
        return len(x) == len(y) == len(old) and all(
            map(lambda a, b, c: _alike_reusing(a, b, c, kept), x, y, old)
        )
    if not isinstance(x, eqx.Module):
        return False
    dx, dy, do = _get(x, "__dict__"), _get(y, "__dict__"), _get(old, "__dict__")
    return list(dx) == list(dy) == list(do) and all(
        _alike_reusing(dx[k], dy[k], do[k], kept) for k in dx
    )


def _alike(x: Any, y: Any) -> bool:
    """Whether `x` and `y` are built alike: the same leaves and static values (the
    same objects), the same node types and `__dict__` keys in the same order, and
    no object shared between them other than those."""
    if type(x) is _Marker or x is y:
        return x is y
    if type(x) is not type(y):
        return False
    if isinstance(x, tuple):
        return len(x) == len(y) and all(map(_alike, x, y))
    if not isinstance(x, eqx.Module):
        return False
    dx, dy = _get(x, "__dict__"), _get(y, "__dict__")
    return list(dx) == list(dy) and all(_alike(dx[k], dy[k]) for k in dx)
