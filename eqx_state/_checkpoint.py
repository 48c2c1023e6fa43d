"""`es.save` / `es.load`: single-file checkpoints of any mix of parameters, state cells
(either mode), optimizer state, PRNG keys and metrics. A plain, code-free format:
loading never unpickles or evaluates anything, and every byte is checksummed.

Layout of a file (all integers little-endian):

    b"EQXSTATE" | u32 version | u64 header length | JSON header | payload | SHA-256

The SHA-256 covers everything before it (magic, version, header and payload). The
header lists one entry per saved leaf, in payload order; each leaf's bytes follow the
previous one's, so offsets are implied and cannot disagree with the data.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import math
import numbers
import os
import re
import secrets
import stat
import struct
from collections.abc import Callable
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np

from ._buffer import check_live, is_state, new_cell_ref
from ._compat import (
    Tracer,
    is_concrete_ref,
    placed_as,
    put_as,
    ref_is_consumed,
    ref_value_copy,
    under_trace,
)
from ._errors import StaleModelError, StateError, StateValueError, stale_message
from ._modes import check_no_shared_refs


try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


_MAGIC = b"EQXSTATE"
_VERSION = 2
_PREFIX = struct.Struct("<IQ")
_FIXED = len(_MAGIC) + _PREFIX.size
_DIGEST = 32  # bytes of SHA-256
_MAX_NDIM = 64
_TMP_SUFFIX = ".eqxs-tmp"

_DTYPE_NAMES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "int2",
    "int4",
    "uint2",
    "uint4",
    "float4_e2m1fn",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)


def _known_dtypes() -> dict[str, np.dtype]:
    out = {}
    for name in _DTYPE_NAMES:
        try:
            dtype = np.dtype(jnp.dtype(name))
        except TypeError:  # pragma: no cover - depends on the ml_dtypes version
            continue
        if dtype.name == name:
            out[name] = dtype
    return out


_DTYPES = _known_dtypes()
# Python scalars are stored as 0-d arrays of the matching 64-bit dtype.
_PYTHON_TYPES: dict[str, tuple[type, str]] = {
    "bool": (bool, "bool"),
    "int": (int, "int64"),
    "float": (float, "float64"),
    "complex": (complex, "complex128"),
}
_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
_KINDS = ("jax", "numpy", "numpy_scalar", "python")
_REQUIRED = {
    "jax": {"path", "kind", "dtype", "shape", "weak_type", "ref"},
    "numpy": {"path", "kind", "dtype", "shape"},
    "numpy_scalar": {"path", "kind", "dtype", "shape"},
    "python": {"path", "kind", "dtype", "shape", "python_type"},
}
_OPTIONAL = {
    "jax": {"key_impl"},
    "numpy": set(),
    "numpy_scalar": set(),
    "python": set(),
}


class CheckpointError(StateError):
    """A checkpoint that cannot be saved or loaded: a missing, truncated, corrupt or
    malformed file; a target that is not a file (a missing folder, `None`, a file
    object not open for writing); a tree, shape, dtype or array kind that differs
    from the model it is loaded into; a leaf that no checkpoint could restore (a
    string or object array, a value inside a `jit` trace); or a ref-mode model that
    holds one ref at two places (refused by `es.save`, `es.to_orbax` and
    `es.state_dict`; `es.serialise_filter_spec` sees one leaf at a time and cannot
    tell, see the Equinox page of the docs)."""


# --------------------------------------------------------------------------------------
# Leaves: what is saved, and facts about it shared with the Equinox and Orbax helpers.


def shown_path(where: str) -> str:
    """A leaf's path (`jax.tree_util.keystr`) as messages show it: the empty path
    of a tree that is one leaf is "the root"."""
    return where or "the root (the tree is one leaf)"


def _is_python_scalar(x: Any) -> bool:
    return type(x) in (bool, int, float, complex)


def _python_type(x: Any) -> type | None:
    """The Python number type (`bool`, `int`, `float`, `complex`) a leaf is saved
    as: its own type, or the one a subclass derives from (an `enum.IntEnum` is an
    `int`: saved as its value, restored as `like`'s type by `_python_leaf`); None
    for anything else. NumPy scalars are NumPy data (`np.float64` is a `float`)."""
    if isinstance(x, np.generic):
        return None
    for base in (bool, int, float, complex):
        if isinstance(x, base):
            return base
    return None


def _python_leaf(value: Any, like: Any, where: str, source: str) -> Any:
    """The one rule by which every load path (`es.load`, `es.from_orbax`) gives back
    a saved Python number `value` (a plain `bool`/`int`/`float`/`complex`): as the
    type of `like`'s leaf, a subclass (an `enum.IntEnum`) rebuilt from the value.
    A value that type refuses (no member of the enum) raises `CheckpointError`."""
    cls = type(like)
    base = _python_type(like)
    if base is None or cls is base:
        return (base or type(value))(value)
    try:
        return cls(value)
    except (ValueError, TypeError) as e:
        raise CheckpointError(
            f"At {where} {source} holds the {type(value).__name__} {value!r}, which "
            f"`like`'s type {cls.__qualname__} cannot hold ({e}). Build `like` the "
            "way the saved tree was built."
        ) from e


def _is_key_dtype(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _check_refs_unshared(tree: Any, caller: str, record: str) -> None:
    """The one rule on a whole tree that every persistence path applies before it
    reads a leaf (`es.save`, `es.to_orbax`, `es.state_dict`): no ref at two places.
    `record` names what the path writes ("a checkpoint", "a state dict")."""
    try:
        check_no_shared_refs(tree)
    except StateError as e:
        raise CheckpointError(
            f"`{caller}` refuses a tree that holds one ref at two places: {record} "
            "names each place, so it would hold that one state twice and load it "
            f"back as two independent ones. {e}"
        ) from e


def _check_live(x: Any, where: str) -> None:
    check_live(x, where.removeprefix("The "))


def _read_ref(ref: Any, where: str) -> jax.Array:
    """A snapshot (a copy) of the value of a ref-mode cell. Inside a traced
    function (a concrete ref closed over by a `jax.jit`) the value is a tracer,
    which the caller refuses; it is read, not frozen (`jax.freeze` would invalidate
    the ref for the rest of the trace)."""
    if not isinstance(ref, Tracer) and ref_is_consumed(ref):  # donated away
        raise StaleModelError(stale_message(where.removeprefix("The ")))
    if under_trace():
        return ref[...]
    # outside a trace: a copy, the ref stays valid (and its array uncommitted,
    # `_compat.ref_value_copy`)
    copy = ref_value_copy(ref) if is_concrete_ref(ref) else None
    return jax.freeze(ref) if copy is None else copy


def refuse_tracer(caller: str, leaf: str, verb: str = "save") -> NoReturn:
    """The one refusal of a value that is a tracer (a save inside `jax.jit`), for
    every persistence path, `es.state_dict` (`verb="export"`) and
    `es.load_state_dict` (`verb="load"`: its checks read the values)."""
    if verb == "load":
        fix = (
            "Load outside transformed code (the checks of a load read the values) "
            "and pass the loaded model in."
        )
    else:
        fix = (
            "Save outside transformed code, on the values the transformed function "
            "returns (a ref-mode model: after the call, which wrote its refs)."
        )
    raise CheckpointError(
        f"Cannot {verb} the {leaf}: it is a tracer (`{caller}` was called "
        "inside `jax.jit`, `grad`, `vmap` or `eval_shape`, where the model's arrays, "
        f"and the values of ref-mode cells closed over, are tracers). {fix}"
    )


@functools.cache
def _key_impl_of_dtype(dtype: Any) -> str:
    """The name of the PRNG implementation of a typed-key dtype (`key<fry>` ->
    `threefry2x32`), using public JAX only."""
    for name in _KEY_IMPLS:
        if jax.eval_shape(lambda n=name: jax.random.key(0, impl=n)).dtype == dtype:
            return name
    raise CheckpointError(
        f"Typed PRNG keys of dtype {dtype} use an implementation that eqx_state "
        f"cannot name (it knows {', '.join(_KEY_IMPLS)}). Save `jax.random.key_data` "
        "of the key instead."
    )


@functools.cache
def _weak_fill(dtype: Any) -> Any:
    """A Python scalar whose weakly typed JAX array has dtype `dtype`, or None."""
    fill = {"b": False, "i": 0, "u": 0, "f": 0.0, "c": 0j}.get(np.dtype(dtype).kind)
    if fill is None:
        return None
    template = jax.eval_shape(lambda: jax.lax.full((), fill))
    if template.dtype != dtype or not template.weak_type:
        return None
    return fill


def _make_weak(x: jax.Array) -> jax.Array:
    """`x` as a weakly typed array (what `jnp.asarray(1.0)` gives), public JAX only: a
    weakly typed fill updated with the values keeps its weak type."""
    fill = _weak_fill(x.dtype)
    if fill is None:
        raise CheckpointError(
            f"JAX cannot rebuild a weakly typed {x.dtype} array with public functions."
        )
    where = contextlib.nullcontext() if isinstance(x, Tracer) else placed_as(x)
    with where as device:  # computed where `x` is, committed as it is
        # over a mesh of explicit axes, laid out as `x` (JAX needs it said there,
        # and refuses it over automatic axes)
        explicit = isinstance(device, jax.sharding.NamedSharding) and all(
            t == jax.sharding.AxisType.Explicit for t in device.mesh.axis_types
        )
        out = device if explicit else None
        return jax.lax.full(x.shape, fill).at[...].set(x, out_sharding=out)


def _numpy_leaf(value: np.ndarray, like: Any) -> np.ndarray | np.generic:
    """The one rule by which every load path (`es.load`, `es.from_orbax`) gives back
    a NumPy leaf: as the type of the `like` leaf, a NumPy array where it holds an
    array and a NumPy scalar where it holds a scalar (at shape `()` the two hold
    the same data, so either loads into either); where `like` is abstract (a
    `jax.ShapeDtypeStruct`, which cannot tell them apart), a 0-d value comes back
    as a NumPy scalar (a data position, a step count) and any other as an array.
    `value` is a NumPy array that the caller owns."""
    if isinstance(like, np.ndarray) or value.ndim:
        return value
    return value[()]


def _numpy_kinds_agree(saved: str, like: str, shapes: set[tuple[int, ...]]) -> bool:
    """A NumPy scalar and a 0-d NumPy array are the same data (see `_numpy_leaf`)."""
    return shapes == {()} and {saved, like} == {"numpy", "numpy_scalar"}


# --------------------------------------------------------------------------------------
# Saving.


def _is_saved(x: Any) -> bool:
    """Whether a leaf of `like` is a position that a checkpoint fills (what
    `saved_value` writes a value for)."""
    return isinstance(x, (jax.Array, jax.Ref, np.ndarray, np.generic)) or (
        _python_type(x) is not None
    )


_ARRAY_PROTOCOLS = (
    "__array__",
    "__array_interface__",
    "__cuda_array_interface__",
    "__dlpack__",
    "__jax_array__",
)


def _refuse_other_data(x: Any, caller: str, leaf: str) -> None:
    """Refuse a leaf that holds data no persistence path writes, which would
    otherwise be skipped like a function and come back as `like`'s value: an array
    of another library (a `torch.Tensor`) and a number that is not a Python
    `bool`/`int`/`float`/`complex` (a `Fraction`, a `Decimal`)."""
    cls = type(x)
    what = f"{cls.__module__}.{cls.__qualname__}"
    if any(hasattr(cls, name) for name in _ARRAY_PROTOCOLS):
        if cls.__module__.split(".")[0] == "torch":
            fix = (
                "Convert it to a JAX array before saving, "
                "`jnp.asarray(t.detach().cpu().numpy())` (or keep it NumPy, "
                "`t.detach().cpu().numpy()`)"
            )
        else:
            fix = (
                "Convert it to a JAX or NumPy array before saving "
                "(`jnp.asarray(np.asarray(x))`, `np.asarray(x)`)"
            )
        raise CheckpointError(
            f"Cannot save the {leaf}: it is a {what}, an array of another library, "
            f"which `{caller}` does not write (it would come back as `like`'s "
            f"value). {fix}, or keep it out of the saved tree (e.g. as a static "
            "field, `eqx.field(static=True)`)."
        )
    if isinstance(x, numbers.Number):
        raise CheckpointError(
            f"Cannot save the {leaf}: it is a number of type {what} ({x!r}), which "
            f"`{caller}` does not write: a checkpoint stores Python bool, int, float "
            "and complex leaves, JAX and NumPy arrays (it would come back as "
            "`like`'s value). Convert it to one of those (`float(x)` rounds; a "
            "`Fraction`'s `numerator` and `denominator` as two int leaves keep it "
            "exact), or keep it out of the saved tree (e.g. as a static field, "
            "`eqx.field(static=True)`)."
        )


def _little(arr: np.ndarray) -> np.ndarray:
    """The array in the file's byte order (little-endian), contiguous."""
    return np.asarray(arr, dtype=arr.dtype.newbyteorder("<"), order="C")


def _check_dtype(leaf: str, dtype: np.dtype) -> None:
    """The one rule on array dtypes of every persistence path (`saved_value`), for
    the `leaf` (`"leaf at ['x']"`)."""
    if dtype.name in _DTYPES:
        return
    if dtype.kind in "fc":  # NumPy's longdouble / clongdouble: wider than any above
        wide, std = ("longdouble", "float64")
        if dtype.kind == "c":
            wide, std = ("clongdouble", "complex128")
        raise CheckpointError(
            f"Cannot save the {leaf}: it is an array of dtype {dtype}, "
            f"NumPy's extended precision (`np.{wide}`), which JAX has no dtype for "
            "and whose bytes differ between machines (x87 80-bit padded to 96 or 128 "
            "bits, or IEEE quadruple), so no checkpoint can restore it exactly. "
            f"Convert it with `x.astype(np.{std})` (rounding to {std}), or keep it "
            "out of the saved tree (e.g. as a static field, `eqx.field(static=True)`)."
        )
    raise CheckpointError(
        f"Cannot save the {leaf}: it is an array of dtype {dtype} "
        f"({dtype.kind!r} kind), which no persistence path of eqx_state saves "
        "(strings, objects, records and dates are not numbers: `es.load` and "
        "Orbax cannot restore them as arrays, and every path keeps one rule). Keep "
        "such values "
        "out of the saved tree (e.g. as a static field, `eqx.field(static=True)`), "
        "or convert them to a numeric array."
    )


def saved_value(x: Any, caller: str, leaf: str, cell: str | None = None) -> Any:
    """The one rule of every persistence path (`es.save`, `es.to_orbax`,
    `es.serialise_filter_spec`) for one leaf `x`: the value to write (a ref-mode
    cell's is a snapshot of its array; a subclass of a Python number, such as an
    `enum.IntEnum`, is its plain value), or None for a leaf that is not state (a
    function, a string: written by no path). Refused, naming `caller` and the
    leaf: a tracer, an abstract array (`jax.ShapeDtypeStruct`), an array a
    donating step consumed, a NumPy masked array, a NumPy dtype no checkpoint
    restores (`_check_dtype`), a Python int beyond 64 bits, and data of other
    kinds that would otherwise be skipped (`_refuse_other_data`). `leaf` is
    `"leaf at ['x']"` and, for a ref, `cell` (`"ref-mode cell at ['x']"`; `leaf`
    if None)."""
    if isinstance(x, Tracer):
        refuse_tracer(caller, leaf)
    if isinstance(x, jax.ShapeDtypeStruct):
        raise CheckpointError(
            f"Cannot save the {leaf}: it is an abstract array (a "
            f"`jax.ShapeDtypeStruct` of {np.dtype(x.dtype).name}{list(x.shape)}, e.g. "
            "from `eqx.filter_eval_shape`), which holds no values, so the "
            f"checkpoint would lack it. Give `{caller}` a concrete tree: build the "
            "model, or fill the abstract one first (`es.load(path, like=abstract)`)."
        )
    if isinstance(x, jax.Ref):
        value = _read_ref(x, cell or leaf)
        if isinstance(value, Tracer):  # a concrete ref closed over by a trace
            refuse_tracer(caller, cell or leaf)
        return value
    if isinstance(x, jax.Array):
        _check_live(x, leaf)
        return x
    if isinstance(x, np.ma.MaskedArray):
        raise CheckpointError(
            f"Cannot save the {leaf}: it is a NumPy masked array, whose mask no "
            "checkpoint stores (it would come back as a plain array, its masked "
            "entries unmasked). Save its data and mask as two arrays, `x.data` and "
            "`np.ma.getmaskarray(x)`, and rebuild it after loading with "
            "`np.ma.masked_array(data, mask=mask)`."
        )
    if isinstance(x, np.ndarray | np.generic):
        _check_dtype(leaf, np.asarray(x).dtype)
        return x
    base = _python_type(x)
    if base is not None:
        value = x if type(x) is base else base(x)
        if base is int and not -(2**63) <= value < 2**64:
            raise CheckpointError(
                f"Cannot save the {leaf}: the Python int {value} does not fit in 64 "
                "bits (a checkpoint holds ints from -2**63 to 2**64 - 1). Store its "
                "bytes as a NumPy array of a fixed length, which is saved: "
                "`np.frombuffer(x.to_bytes(16, 'little', signed=True), np.uint8)` "
                "(16 bytes hold 128 bits), and rebuild it after loading with "
                "`int.from_bytes(a.tobytes(), 'little', signed=True)`."
            )
        return value
    _refuse_other_data(x, caller, leaf)
    return None


def _encode(name: str, leaf: Any) -> tuple[dict[str, Any], np.ndarray] | None:
    """The header entry and the host array of one leaf, or None for a leaf that is
    not saved (`saved_value`'s rule)."""
    entry: dict[str, Any] = {"kind": "jax", "ref": isinstance(leaf, jax.Ref)}
    leaf = saved_value(leaf, "es.save", f"leaf at {name}", f"ref-mode cell at {name}")
    if leaf is None:
        return None
    if _is_python_scalar(leaf):
        type_name = type(leaf).__name__
        dtype = _PYTHON_TYPES[type_name][1]
        if type_name == "int" and leaf >= 2**63:  # up to 2**64 - 1 (`saved_value`)
            dtype = "uint64"
        entry = {"kind": "python", "python_type": type_name}
        return entry, np.asarray(leaf, dtype=dtype)
    if isinstance(leaf, np.generic):
        return {"kind": "numpy_scalar"}, _little(np.asarray(leaf))
    if isinstance(leaf, np.ndarray):
        return {"kind": "numpy"}, _little(leaf)
    if not leaf.is_fully_addressable:
        raise CheckpointError(
            f"Cannot save the leaf at {name}: it is sharded over devices of several "
            "processes, which a single-file checkpoint cannot gather. Use Orbax "
            "(`es.to_orbax`, see the checkpointing guide), which writes each "
            "process's shards."
        )
    if _is_key_dtype(leaf.dtype):
        entry["key_impl"] = _key_impl_of_dtype(leaf.dtype)
        leaf = jax.random.key_data(leaf)
    weak = bool(getattr(leaf, "weak_type", False))
    arr = _little(np.asarray(leaf))
    _check_dtype(f"leaf at {name}", arr.dtype)
    if weak and _weak_fill(arr.dtype) is None:
        raise CheckpointError(
            f"Cannot save the leaf at {name}: it is a weakly typed {arr.dtype} array, "
            "which public JAX cannot rebuild. Give it a definite dtype with "
            "`jnp.asarray(x, dtype=x.dtype)` first."
        )
    entry["weak_type"] = weak
    return entry, arr


def _witness_paths(tree: Any) -> set[str]:
    """The paths of ref-mode cells' shape witnesses (`Buffer.witness`): derived from
    the cell, so neither saved nor loaded (a checkpoint of a ref-mode model loads
    into a value-mode one and back)."""
    out = set()
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)[0]:
        if is_state(node) and node.witness is not None:
            key = (*path, jax.tree_util.GetAttrKey("witness"))
            out.add(jax.tree_util.keystr(key))
    return out


def _encode_tree(tree: Any) -> list[Any]:
    """The file as a list of byte buffers (prefix and header, then each leaf's bytes
    without a copy), to be written in order and followed by their SHA-256."""
    _check_refs_unshared(tree, "es.save", "a checkpoint")
    entries = []
    chunks = []
    seen: set[str] = set()
    witnesses = _witness_paths(tree)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path)
        if name in witnesses:
            continue
        encoded = _encode(shown_path(name), leaf)  # every leaf meets the rule
        if encoded is None:  # not state: a function, a string
            continue
        if name in seen:
            raise CheckpointError(
                f"Two leaves of the tree have the same path {name}; a checkpoint "
                "names each leaf by its path. Give the pytree nodes distinct keys."
            )
        seen.add(name)
        entry, arr = encoded
        entries.append(
            {"path": name, "dtype": arr.dtype.name, "shape": list(arr.shape), **entry}
        )
        chunks.append(arr.reshape(-1).view(np.uint8))
    header = json.dumps(
        {"entries": entries}, sort_keys=True, separators=(",", ":")
    ).encode()
    return [_MAGIC + _PREFIX.pack(_VERSION, len(header)) + header, *chunks]


def _write_parts(write: Any, parts: list[Any]) -> None:
    digest = hashlib.sha256()
    for part in parts:
        part = memoryview(part).cast("B")
        digest.update(part)
        write(part)
    write(digest.digest())


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _checked_path(path: str) -> str:
    """The file that a save to `path` replaces (a symlink is written through, to
    its target), after the checks that need no writing."""
    target = os.path.realpath(path)
    if os.path.isdir(target):
        raise CheckpointError(
            f"Cannot save to {path!r}: it is a directory. Give a file name."
        )
    if os.path.exists(target) and not os.path.isfile(target):
        # a save replaces the file: a device or a FIFO would be replaced by one
        raise CheckpointError(
            f"Cannot save to {path!r}: it is not a regular file (a device, a FIFO or "
            "a socket), which a save would replace. To write into it, pass a file "
            f"object: `with open({path!r}, 'wb') as f: es.save(f, tree)`."
        )
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise CheckpointError(
            f"Cannot save to {path!r}: the folder {folder!r} does not exist. Create "
            f"it first (`os.makedirs({folder!r}, exist_ok=True)`), or give a path "
            "in an existing folder."
        )
    return target


def _temp_stem(base: str) -> str:
    """The start of the temporary files' names of a save to the file `base`:
    `.BASE.`, with BASE shortened so that the whole name (`_temp_stem(base)`, 12 hex
    digits, `_TMP_SUFFIX`) fits the 255 bytes a file name may have."""
    room = 255 - len(f"..{'0' * 12}{_TMP_SUFFIX}")
    while len(os.fsencode(base)) > room:
        base = base[:-1]
    return f".{base}."


def _open_temp(path: str, folder: str, stem: str) -> tuple[str, int]:
    """Create and lock a new temporary file for a save: its name and descriptor."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):  # another save's cleanup won the race: try a new name
        tmp = os.path.join(folder, f"{stem}{secrets.token_hex(6)}{_TMP_SUFFIX}")
        try:
            fd = os.open(tmp, flags, 0o666)  # the process umask applies, as for `open`
        except OSError as e:  # no permission, a read-only file system, ...
            raise CheckpointError(
                f"Cannot save to {path!r}: no file can be created in {folder!r} "
                f"({e.strerror or e}). Save into a folder you can write to."
            ) from e
        if fcntl is None:  # pragma: no cover - Windows
            return tmp, fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held while writing: never cleaned then
            # Another save's `_remove_stale_temps` may have locked and deleted the
            # file between `os.open` and `flock`: then start again with a new one.
            try:
                same = os.path.samestat(os.stat(tmp), os.fstat(fd))
            except FileNotFoundError:
                same = False
        except BaseException as e:  # no locks on this file system, an interrupt
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if isinstance(e, OSError):
                raise CheckpointError(
                    f"Cannot save to {path!r}: its temporary file in {folder!r} "
                    f"cannot be locked ({e.strerror or e}). Save to a local file "
                    "system, or to a file object (`with open(path, 'wb') as f: "
                    "es.save(f, tree)`)."
                ) from e
            raise
        if same:
            return tmp, fd
        os.close(fd)
    _remove_stale_temps(folder, stem)  # ours, unlocked now (a live save's are locked)
    raise CheckpointError(
        f"Cannot save to {path!r}: each temporary file made in {folder!r} was gone "
        "by the time it was locked (100 tries): the file system does not keep a "
        "file's identity, or other saves keep deleting it. Save to a file object "
        "(`with open(path, 'wb') as f: es.save(f, tree)`)."
    )


def _write_path(path: str, target: str, parts: list[Any]) -> None:
    folder, base = os.path.split(target)
    stem = _temp_stem(base)
    _remove_stale_temps(folder, stem)
    tmp, fd = _open_temp(path, folder, stem)
    try:
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            mode = None
        if mode is not None and hasattr(os, "fchmod"):
            os.fchmod(fd, mode)  # an overwritten checkpoint keeps its mode
        _write_parts(lambda data: _write_all(fd, data), parts)
        os.fsync(fd)
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):  # a full disk, a quota, ...
            raise CheckpointError(
                f"Cannot save to {path!r}: writing failed ({e.strerror or e}). "
                "The previous checkpoint there, if any, is intact."
            ) from e
        raise
    finally:
        os.close(fd)


def _remove_stale_temps(folder: str, stem: str) -> None:
    """Delete the temporary files (`stem` + 12 hex digits + `_TMP_SUFFIX`) that
    killed saves of the same target left behind. A save holds a lock on its
    temporary file until it ends, so a file that can be locked belongs to no live
    save (`_open_temp` checks that its file was not deleted before it locked it)."""
    if fcntl is None:  # pragma: no cover - Windows
        return
    pattern = re.compile(re.escape(stem) + r"[0-9a-f]{12}" + re.escape(_TMP_SUFFIX))
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not pattern.fullmatch(name):
            continue
        stale = os.path.join(folder, name)
        try:
            fd = os.open(stale, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a save in progress
            continue
        try:
            os.unlink(stale)
        except OSError:
            pass
        finally:
            os.close(fd)


def save(path_or_file: str | os.PathLike[str] | io.IOBase, tree: Any) -> None:
    """Save every array and scalar of `tree` (parameters, state cells in value or ref
    mode, optimizer state, PRNG keys, metrics) to one file.

    What is saved, per leaf: JAX arrays (with dtype, shape and weak type; typed PRNG
    keys with their implementation; ref-mode cells by their current value), NumPy
    arrays and NumPy scalars (kept NumPy, 64-bit dtypes included), and Python `bool`,
    `int`, `float` and `complex` leaves (as Equinox does, so e.g. non-static flags
    come back as saved; a subclass such as an `enum.IntEnum` is saved as its value
    and comes back as `like`'s type). Other Python values (activation functions,
    strings, static fields) are not saved: they come from `like` at load time.

    `save` refuses, with a [`eqx_state.CheckpointError`][] naming the leaf, anything
    [`eqx_state.load`][] could not restore exactly: string, object or record arrays,
    NumPy's extended-precision `longdouble`, NumPy masked arrays, tracers (a call
    inside `jit`), abstract arrays (`jax.ShapeDtypeStruct`), arrays of other
    libraries (a `torch.Tensor`), numbers of other types (`Fraction`, `Decimal`),
    Python ints beyond 64 bits (-2**63 to 2**64 - 1 are saved), arrays sharded over
    several processes (use Orbax for those); and a ref-mode model that holds one ref at two places (it would load
    back as two states; declare sharing with `eqx.nn.Shared`). A model consumed by
    a donating step raises [`eqx_state.StaleModelError`][]. A target that is not a
    writable file (a missing folder, `None`, a file object opened for reading)
    raises `CheckpointError` naming it, before any array is read; so does a path
    that is not a regular file (a device, a FIFO), which a save would replace.

    Writing to a path is atomic: the bytes go to a temporary file next to the target
    (`.NAME.XXXXXXXXXXXX.eqxs-tmp`), which then replaces it, so a crash mid-save never
    leaves a corrupt checkpoint and the previous one stays intact. A temporary file left
    by a killed save is deleted by the next save of the same target. A new file gets
    the permissions `open` would give (the umask applies); an overwritten file keeps
    its permissions; a symbolic link is written through (the link stays, its target is
    replaced).

    **Arguments:**

    - `path_or_file`: the file to write, or a binary file object (`io.BytesIO`, a
        file opened with `"wb"`), written from its current position.
    - `tree`: any pytree, e.g. `(model, opt_state)`.

    **Example:**

    ```python
    import io
    import eqx_state as es

    bn = es.nn.BatchNorm(3)
    es.save("/tmp/bn.eqxs", bn)
    bn2 = es.load("/tmp/bn.eqxs", like=bn)

    buffer = io.BytesIO()
    es.save(buffer, bn)
    buffer.seek(0)
    bn3 = es.load(buffer, like=bn)
    ```
    """
    write = _writer(path_or_file)
    write(_encode_tree(tree))


def _file_name(f: Any) -> str:
    """A file object's name for messages: its path, or what it is where it has
    none (a file made by `os.fdopen` is named by its descriptor, an int)."""
    name = getattr(f, "name", None)
    if name is None:
        name = "<file object>"
    elif isinstance(name, int) and not isinstance(name, bool):
        name = f"<file object on file descriptor {name}>"
    return repr(name)


def _not_a_target(caller: str, target: Any, mode: str) -> CheckpointError:
    """The error for a `path_or_file` that is neither a path nor a file object."""
    fix = ""
    if isinstance(target, bytes | bytearray | memoryview):
        got = f"{len(target)} bytes"
        fix = " Give a path as a `str` or `pathlib.Path`"
        if caller == "es.load":
            fix += (
                ", and a checkpoint held in memory as a file object: "
                "`es.load(io.BytesIO(data), like=...)`"
            )
        fix += "."
    else:
        got = "None" if target is None else f"an object of type {type(target).__name__}"
    return CheckpointError(
        f"`{caller}` needs a path (a `str` or `os.PathLike`) or a binary file object "
        f"(`open(path, {mode!r})`, `io.BytesIO()`), but was given {got}.{fix}"
    )


def _writer(target: Any) -> Callable[[list[Any]], None]:
    """What writes a checkpoint's parts to `target`, after the checks that need
    no writing (so that a bad target fails before any array is read)."""
    if isinstance(target, str | os.PathLike):
        path = os.fsdecode(target)
        real = _checked_path(path)
        return lambda parts: _write_path(path, real, parts)
    if isinstance(target, io.TextIOBase):
        raise CheckpointError(
            "`es.save` needs a binary file: open it with mode 'wb', not 'w'."
        )
    write = getattr(target, "write", None)
    if not callable(write):
        raise _not_a_target("es.save", target, "wb")
    name = _file_name(target)
    writable = getattr(target, "writable", None)
    try:
        can_write = not callable(writable) or writable()
    except ValueError as e:  # a closed file
        raise CheckpointError(
            f"Cannot save to the file object {name}: {e}. Pass an open file."
        ) from e
    if not can_write:
        raise CheckpointError(
            f"Cannot save to the file object {name}: it is not open for writing. "
            "Open it with mode 'wb' (or 'ab', 'r+b')."
        )

    def to_file(parts: list[Any]) -> None:
        try:
            _write_parts(write, parts)
        except (OSError, ValueError) as e:  # a full disk, a closed file, ...
            raise CheckpointError(
                f"Cannot save to the file object {name}: writing failed ({e})."
            ) from e

    return to_file


# --------------------------------------------------------------------------------------
# Loading: read, verify the checksum, validate the header, match `like`, then build.


class _Entry:
    __slots__ = (
        "path",
        "kind",
        "dtype",
        "shape",
        "weak",
        "key_impl",
        "pytype",
        "start",
    )

    def __init__(self, raw: dict[str, Any], start: int):
        self.path: str = raw["path"]
        self.kind: str = raw["kind"]
        self.dtype: np.dtype = _DTYPES[raw["dtype"]]
        self.shape: tuple[int, ...] = tuple(raw["shape"])
        self.weak: bool = raw.get("weak_type", False)
        self.key_impl: str | None = raw.get("key_impl")
        self.pytype: type | None = (
            _PYTHON_TYPES[raw["python_type"]][0] if self.kind == "python" else None
        )
        self.start = start

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        if self.key_impl is not None:
            return f"a typed PRNG key array ({self.key_impl}) of data {self.dtype.name}{self.shape}"
        return f"{self.dtype.name}{self.shape}"


_CHUNK = 1 << 24  # bytes per read of a stream: a lying length allocates no more


def _read_stream(f: Any, name: str, buf: bytearray, n: int | None) -> int:
    """Append `n` bytes of the stream `f` to `buf` (fewer at its end), or all the
    rest if `n` is None, read in chunks; returns how many were read."""
    got = 0
    while n is None or got < n:
        part = f.read(_CHUNK if n is None else min(n - got, _CHUNK))
        if not isinstance(part, (bytes, bytearray, memoryview)):
            raise CheckpointError(
                f"The file object {name} returned {type(part).__name__}, not bytes: "
                "open checkpoints in binary mode ('rb')."
            )
        if not part:
            break
        buf += part
        got += len(part)
    return got


def _data_bytes(header: bytes) -> int | None:
    """The number of payload bytes a header lists, or None if it is not a valid
    header (which `_parse` then reports, after the checksum)."""
    try:
        obj = json.loads(header.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("entries"), list):
        return None
    if any(_validate_entry(i, raw) for i, raw in enumerate(obj["entries"])):
        return None
    return sum(_Entry(raw, 0).nbytes for raw in obj["entries"])


def _read_one(f: Any, name: str) -> tuple[bytearray, bytes]:
    """Exactly one checkpoint from the stream `f`, leaving it positioned after it (as
    `np.load` and `eqx.tree_deserialise_leaves` read a stream item by item): the
    prefix gives the header's length, the header the payload's. Where the prefix or
    header is not valid, the rest of the stream is read so that `_parse` reports it
    as it does for a file; bytes that do not start with the magic are not a
    checkpoint, and nothing after them is read (a large file of another format, or
    an endless stream, is refused at once). A seekable stream must continue with
    nothing or with another checkpoint: other bytes after one are reported as
    corruption (by `_check_tail`, after the checksum). Returns the checkpoint's bytes
    and the (up to `_FIXED`) bytes that follow it in a seekable stream."""
    buf = bytearray()
    if _read_stream(f, name, buf, _FIXED) < _FIXED or not buf.startswith(_MAGIC):
        return buf, b""  # not a checkpoint (`_parse`): the rest is not read
    version, header_len = _PREFIX.unpack_from(buf, len(_MAGIC))
    if version != _VERSION:
        _read_stream(f, name, buf, None)
        return buf, b""
    got = _read_stream(f, name, buf, header_len)
    data = _data_bytes(bytes(buf[_FIXED:])) if got == header_len else None
    if data is None:
        _read_stream(f, name, buf, None)
        return buf, b""
    _read_stream(f, name, buf, data + _DIGEST)
    tail = bytearray()
    seekable = getattr(f, "seekable", None)
    if callable(seekable) and seekable():
        after = f.tell()
        _read_stream(f, name, tail, _FIXED)
        f.seek(after)
    return buf, bytes(tail)


def _check_tail(name: str, tail: bytes) -> None:
    """What follows a checkpoint in a seekable stream must be nothing or the start
    of another checkpoint: the magic bytes (or their beginning, when the stream
    ends inside them) and a plausible format version. Whatever follows that start
    is checked when the next checkpoint is loaded, so an intact checkpoint followed
    by a torn append (a writer killed mid-save) still loads, and the torn one is
    reported when it is read."""
    n = len(_MAGIC)
    if len(tail) < n:
        starts = _MAGIC.startswith(tail)
    elif len(tail) < n + 4:  # the version field is cut
        starts = tail.startswith(_MAGIC)
    else:
        version = int.from_bytes(tail[n : n + 4], "little")
        starts = tail.startswith(_MAGIC) and 1 <= version < 2**16
    if not starts:
        raise CheckpointError(
            f"{name} is corrupt: the checkpoint is followed by "
            f"{'bytes that start' if len(tail) > 1 else 'a byte that starts'} no "
            "other eqx_state checkpoint (a stream may hold several checkpoints, one after "
            "the other, and nothing else)."
        )


def _read_blob(path_or_file: Any) -> tuple[str, bytearray, bytes]:
    """The name, the bytes of one checkpoint and, for a seekable stream, the bytes
    that follow it (for `_check_tail`)."""
    if hasattr(path_or_file, "read"):
        name = _file_name(path_or_file)
        if isinstance(path_or_file, io.TextIOBase):
            raise CheckpointError(
                f"The file object {name} is in text mode: open checkpoints in binary "
                "mode ('rb')."
            )
        try:  # (a closed file raises here: the read below says so)
            readable = path_or_file.readable()
        except (AttributeError, OSError, ValueError):
            readable = True
        if not readable:
            raise CheckpointError(
                f"The file object {name} is not open for reading: open checkpoints "
                "to load with mode 'rb'."
            )
        try:
            return name, *_read_one(path_or_file, name)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"Cannot read the checkpoint {name}: {e}") from e
    if not isinstance(path_or_file, str | os.PathLike):
        raise _not_a_target("es.load", path_or_file, "rb")
    path = os.fsdecode(path_or_file)
    name = repr(path)
    if not os.path.exists(path):
        raise CheckpointError(f"No checkpoint at {name}.")
    try:
        with open(path, "rb") as f:
            return name, *_read_one(f, name)
    except OSError as e:  # a directory, no permission, ...
        raise CheckpointError(
            f"Cannot read the checkpoint {name}: {e.strerror or e}."
        ) from e


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise StateValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _is_int(x: Any) -> bool:
    return type(x) is int


def _validate_entry(i: int, raw: Any) -> str | None:
    """The first thing wrong with header entry `i`, or None."""
    if not isinstance(raw, dict):
        return f"entry {i} is a {type(raw).__name__}, not an object"
    label = f"entry {i}"
    path = raw.get("path")
    if not isinstance(path, str):
        return f"{label} has no string 'path'"
    label = f"entry {i} ({path[:200]})"
    kind = raw.get("kind")
    if kind not in _KINDS:
        return f"{label} has an unknown 'kind' {kind!r}"
    keys = set(raw)
    missing = _REQUIRED[kind] - keys
    if missing:
        return f"{label} lacks the field(s) {sorted(missing)}"
    unknown = keys - _REQUIRED[kind] - _OPTIONAL[kind]
    if unknown:
        return f"{label} has unknown field(s) {sorted(unknown)}"
    if not isinstance(raw["dtype"], str) or raw["dtype"] not in _DTYPES:
        return f"{label} has an unknown dtype {raw['dtype']!r}"
    shape = raw["shape"]
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_NDIM
        or not all(_is_int(d) and d >= 0 for d in shape)
    ):
        return f"{label} has a 'shape' that is not a list of non-negative integers"
    if kind == "jax":
        if type(raw["weak_type"]) is not bool or type(raw["ref"]) is not bool:
            return f"{label} has a non-boolean 'weak_type' or 'ref'"
        if "key_impl" in raw:
            if raw["key_impl"] not in _KEY_IMPLS:
                return f"{label} has an unknown 'key_impl' {raw['key_impl']!r}"
            if raw["dtype"] != "uint32" or raw["weak_type"]:
                return f"{label} is a PRNG key whose data are not strong uint32"
        if raw["weak_type"] and _weak_fill(_DTYPES[raw["dtype"]]) is None:
            return f"{label} is weakly typed with a dtype that cannot be weak"
    elif kind != "numpy" and shape:
        return f"{label} is a scalar with a non-empty 'shape'"
    if kind == "python":
        pytype = raw["python_type"]
        spec = _PYTHON_TYPES.get(pytype) if isinstance(pytype, str) else None
        if spec is None or raw["dtype"] not in (
            (spec[1], "uint64") if pytype == "int" else (spec[1],)  # ints >= 2**63
        ):
            return f"{label} has an invalid 'python_type' for dtype {raw['dtype']!r}"
    return None


def _parse(name: str, blob: bytes | bytearray) -> list[_Entry]:
    """Verify and parse a whole file. Any problem raises `CheckpointError`; nothing is
    allocated beyond the header's Python objects."""
    if not blob:
        raise CheckpointError(
            f"{name} is not an eqx_state checkpoint: it holds no bytes (a file that "
            "is empty, or a stream at its end: every checkpoint in it was read)."
        )
    if len(blob) < _FIXED + _DIGEST or not blob.startswith(_MAGIC):
        raise CheckpointError(
            f"{name} is not an eqx_state checkpoint (bad magic bytes or too short): "
            "it is truncated, corrupt, or was written by something else."
        )
    version, header_len = _PREFIX.unpack_from(blob, len(_MAGIC))
    body_end = len(blob) - _DIGEST
    signed = hashlib.sha256(memoryview(blob)[:body_end]).digest() == blob[body_end:]
    if version not in (1, _VERSION) and not signed:  # a flipped bit, no other version
        # (version 1 files have no whole-file checksum; a newer one would be signed)
        raise CheckpointError(
            f"{name} is truncated or corrupt: its bytes do not match the checksum "
            f"at its end (its format version field reads {version}; this eqx_state "
            f"writes and reads version {_VERSION})."
        )
    if version != _VERSION:
        raise CheckpointError(
            f"{name} has checkpoint format version {version}; this eqx_state reads "
            f"version {_VERSION}. (Version 1 files, from eqx_state 0.1 before its "
            "whole-file checksum, must be re-saved with the version that wrote them.)"
        )
    if header_len > body_end - _FIXED:
        raise CheckpointError(
            f"{name} is truncated or corrupt: its header length ({header_len} bytes) "
            "runs past the end of the file."
        )
    if not signed:
        raise CheckpointError(
            f"{name} is truncated or corrupt: its bytes do not match the checksum "
            "at its end."
        )
    try:
        header = json.loads(
            blob[_FIXED : _FIXED + header_len].decode("utf-8"),
            object_pairs_hook=_no_duplicate_keys,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{name} has a malformed header: {e}.") from e
    if not isinstance(header, dict) or set(header) != {"entries"}:
        raise CheckpointError(
            f"{name} has a malformed header: expected an object with exactly the key "
            "'entries'."
        )
    raws = header["entries"]
    if not isinstance(raws, list):
        raise CheckpointError(
            f"{name} has a malformed header: 'entries' is not a list."
        )
    entries = []
    seen: set[str] = set()
    offset = _FIXED + header_len
    for i, raw in enumerate(raws):
        problem = _validate_entry(i, raw)
        if problem is None and raw["path"] in seen:
            problem = f"entry {i} ({raw['path']}) repeats the path of an earlier entry"
        if problem is None:
            entry = _Entry(raw, offset)
            offset += entry.nbytes
            if offset > body_end:
                problem = f"entry {i} ({entry.path}) runs past the end of the data"
        if problem is not None:
            raise CheckpointError(f"{name} has a malformed header: {problem}.")
        seen.add(entry.path)
        entries.append(entry)
    if offset != body_end:
        raise CheckpointError(
            f"{name} is corrupt: its header lists {offset - _FIXED - header_len} bytes "
            f"of data but it holds {body_end - _FIXED - header_len}."
        )
    return entries


_KIND_WORDS = {
    "jax": "a JAX array",
    "numpy": "a NumPy array",
    "numpy_scalar": "a NumPy scalar",
    "python": "a Python scalar",
}


def _like_kind(leaf: Any) -> str:
    if isinstance(leaf, (jax.Array, jax.Ref)):
        return "jax"
    if isinstance(leaf, np.ndarray):
        return "numpy"
    if isinstance(leaf, np.generic):
        return "numpy_scalar"
    if _python_type(leaf) is not None:
        return "python"
    return "abstract"  # jax.ShapeDtypeStruct: any array kind


def kind_message(where: str, source: str, saved: str, held: str, leaf: Any) -> str:
    """The one message for a checkpoint leaf of another kind than `like`'s (a JAX
    array where `like` holds a Python scalar, ...), for every persistence path."""
    return (
        f"At {where} {source} holds {_KIND_WORDS[saved]} but `like` "
        f"holds {_KIND_WORDS.get(held, type(leaf).__name__)}. Build `like` the way "
        "the saved tree was built."
    )


def _is_loaded(x: Any) -> bool:
    return _is_saved(x) or isinstance(x, jax.ShapeDtypeStruct)


def _check_against(name: str, where: str, entry: _Entry, leaf: Any) -> None:
    kind = _like_kind(leaf)
    if kind == "abstract":
        if entry.kind == "python":
            kind = "python"  # an abstract leaf is never a Python scalar
    if (
        kind != "abstract"
        and kind != entry.kind
        and not _numpy_kinds_agree(entry.kind, kind, {entry.shape, np.shape(leaf)})
    ):
        raise CheckpointError(
            kind_message(where, f"the checkpoint {name}", entry.kind, kind, leaf)
        )
    if kind == "python":
        if _python_type(leaf) is not entry.pytype:
            raise CheckpointError(
                f"At {where} the checkpoint {name} holds a Python "
                f"{entry.pytype.__name__} but `like` holds a "  # type: ignore[union-attr]
                f"{type(leaf).__name__}."
            )
        return
    want_dtype = np.asarray(leaf).dtype if kind == "numpy_scalar" else leaf.dtype
    want_shape = tuple(np.shape(leaf)) if kind == "numpy_scalar" else tuple(leaf.shape)
    if _is_key_dtype(want_dtype) or entry.key_impl is not None:
        got = None
        if entry.key_impl is not None:
            try:
                got = jax.eval_shape(
                    lambda d: jax.random.wrap_key_data(d, impl=entry.key_impl),
                    jax.ShapeDtypeStruct(entry.shape, entry.dtype),
                )
            except (TypeError, ValueError):  # data of the wrong shape for the impl
                got = None
        if got is None or got.dtype != want_dtype or tuple(got.shape) != want_shape:
            held = (
                f"{entry.describe()} (keys of shape {tuple(got.shape)})"
                if got is not None
                else entry.describe()
            )
            raise CheckpointError(
                f"At {where} the checkpoint {name} holds {held} but the model expects "
                f"{want_dtype}{want_shape}. Build `like` with the same keys (typed "
                "`jax.random.key` vs raw `jax.random.PRNGKey`, same implementation)."
            )
        return
    same_dtype = entry.dtype.name == np.dtype(want_dtype).name
    if kind == "abstract" and entry.kind != "jax":
        # `eqx.filter_eval_shape` describes a NumPy int64 leaf as int32 when JAX runs
        # without x64: the NumPy leaf is restored with its saved 64-bit dtype.
        same_dtype = (
            same_dtype or jax.dtypes.canonicalize_dtype(entry.dtype) == want_dtype
        )
    if (
        entry.kind == "jax"
        and entry.shape == want_shape
        and cut_by_x64(entry.dtype)
        and jax.dtypes.canonicalize_dtype(entry.dtype)
        == jax.dtypes.canonicalize_dtype(want_dtype)
    ):  # `like` 32-bit (JAX's canonical dtype) or an abstract 64-bit leaf
        raise CheckpointError(
            f"At {where} the checkpoint {name} holds a JAX {entry.describe()} array, "
            + saved_with_x64(jax.dtypes.canonicalize_dtype(entry.dtype))
        )
    if entry.shape != want_shape or not same_dtype:
        raise CheckpointError(
            f"At {where} the checkpoint {name} holds {entry.describe()} but the model "
            f"expects {np.dtype(want_dtype).name}{want_shape}. Build `like` with the same "
            "sizes and dtypes as the saved model."
        )


def cut_by_x64(dtype: Any) -> bool:
    """Whether this JAX (64-bit types off) would hold a JAX array of `dtype` in 32
    bits: the one check of `es.load` and `es.orbax_target` / `es.from_orbax`."""
    return (
        not jax.config.read("jax_enable_x64")
        and jax.dtypes.canonicalize_dtype(dtype) != dtype
    )


def saved_with_x64(held: Any) -> str:
    """The one message for a 64-bit array loaded where JAX runs without 64-bit
    types (every persistence path refuses it: a count or a float64 would be cut to
    32 bits silently), `held` being the dtype JAX would give it."""
    return (
        f"saved with 64-bit types on, which are off now: JAX would hold it as "
        f"{np.dtype(held).name}, cutting the saved values (whatever dtype `like` "
        "gives it). Turn them on before building the model and "
        "`like` (`jax.config.update('jax_enable_x64', True)`); cast the loaded "
        "tree afterwards if you want 32 bits."
    )


def _build(
    name: str, where: str, entry: _Entry, blob: bytes | bytearray, leaf: Any
) -> Any:
    arr = np.frombuffer(
        blob,
        dtype=entry.dtype.newbyteorder("<"),
        count=math.prod(entry.shape),
        offset=entry.start,
    ).reshape(entry.shape)
    arr = arr.astype(entry.dtype, copy=False)  # native byte order (a copy if not)
    if entry.kind == "python":
        return _python_leaf(arr.item(), leaf, where, f"the checkpoint {name}")
    if entry.kind in ("numpy", "numpy_scalar"):
        return _numpy_leaf(arr.copy(), leaf)
    # a new buffer where `like`'s array (or ref's) is (`put_as`)
    value = put_as(arr, leaf, may_alias=False, where=where)
    if value.dtype != entry.dtype:  # (`_check_against` refuses it first)
        raise CheckpointError(
            f"At {where} the checkpoint {name} holds a JAX {entry.describe()} array, "
            + saved_with_x64(value.dtype)
        )
    if entry.key_impl is not None:
        value = jax.random.wrap_key_data(value, impl=entry.key_impl)
    elif entry.weak:
        value = _make_weak(value)
    if isinstance(leaf, jax.Ref):
        value = new_cell_ref(
            value, kind=getattr(jax.typeof(leaf), "kind", None), like=leaf
        )
    return value


def load(path_or_file: str | os.PathLike[str] | io.IOBase, like: Any) -> Any:
    """Load a checkpoint written by [`eqx_state.save`][] into the structure of `like`.

    Everything is checked before any array is built, and any problem raises
    [`eqx_state.CheckpointError`][] naming the file and the first bad entry — never a
    partially loaded model, never other values than those saved:

    1. **Integrity**: the magic bytes and format version, then a SHA-256 of the
       whole file (header and data), so any truncation or flipped bit is detected.
    2. **Structure of the header**: known fields only, of the right types; known
       dtypes; shapes of non-negative integers; no path twice; the leaves' data
       exactly fill the file. (An unreadable file, a directory, a text-mode file
       object, `None` or bytes instead of a path also raise `CheckpointError`.)
    3. **Against `like`**: the file holds exactly the leaves of `like` (same paths,
       none missing, none extra), each with the same shape and dtype, the same array
       kind (JAX array, NumPy data, or the same Python scalar type) and,
       for PRNG keys, the same kind of key (typed with the same implementation, or
       raw `uint32` data).

    What comes back: each leaf with the dtype, shape, weak type and kind it was saved
    with (NumPy `int64`/`float64` stay 64-bit NumPy; typed keys stay typed). NumPy
    values follow one rule, shared with [`eqx_state.from_orbax`][]: they come back
    as the type of `like`'s leaf, a NumPy scalar or a NumPy array (at shape `()`
    these are the same data and load into each other); where `like`'s leaf is a
    `jax.ShapeDtypeStruct`, a 0-d value comes back as a NumPy scalar. The storage
    mode comes from `like`: where `like` holds a ref (ref mode), a new ref is made.
    Each position gets its own array (two positions that held one array object
    become two independent arrays). Leaves of `like` that are `jax.ShapeDtypeStruct`s
    (from `eqx.filter_eval_shape`) are filled with the saved array (JAX or NumPy, as
    saved), placed on the struct's sharding if it has one, so a large model is never
    allocated twice. Python values that are not saved (functions, static fields) come
    from `like`.

    **Arguments:**

    - `path_or_file`: the file to read, or a binary file object, read from its
        current position. Exactly one checkpoint is read and a stream is left just
        after it, so checkpoints saved one after the other into one stream load one
        per call, as with `np.load` (from a path, the first is read). In a file or
        seekable stream, what follows must be another checkpoint or nothing.
    - `like`: a tree of the same structure, e.g. a freshly initialised
        `(model, opt_state)`, or `eqx.filter_eval_shape` of the function that makes it.

    **Returns:**

    A tree like `like` holding the saved values.

    **Example:**

    ```python
    import equinox as eqx
    import eqx_state as es

    es.save("/tmp/bn.eqxs", es.nn.BatchNorm(3))
    abstract = eqx.filter_eval_shape(es.nn.BatchNorm, 3)  # allocates nothing
    bn = es.load("/tmp/bn.eqxs", like=abstract)
    bn_refs = es.load("/tmp/bn.eqxs", like=es.to_refs(es.nn.BatchNorm(3)))  # ref mode
    ```
    """
    name, blob, tail = _read_blob(path_or_file)
    entries = _parse(name, blob)
    _check_tail(name, tail)
    saved = {e.path: e for e in entries}
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    witnesses = _witness_paths(like)
    wanted: list[tuple[int, str, Any]] = []
    for i, (p, leaf) in enumerate(flat):
        where = jax.tree_util.keystr(p)
        if _is_loaded(leaf) and where not in witnesses:
            wanted.append((i, where, leaf))
    for _, where, leaf in wanted:
        if where not in saved:
            raise CheckpointError(
                f"The checkpoint {name} has no array at {shown_path(where)}: it was "
                "saved from a "
                "different model or optimizer. Load it into the structure it was saved "
                "from."
            )
        _check_against(name, shown_path(where), saved[where], leaf)
    names = {where for _, where, _ in wanted}
    if len(names) != len(wanted):
        raise CheckpointError(
            "Two leaves of `like` have the same path; a checkpoint names each leaf by "
            "its path. Give the pytree nodes distinct keys."
        )
    extra = [e.path for e in entries if e.path not in names]
    if extra:
        raise CheckpointError(
            f"The checkpoint {name} holds an array at {shown_path(extra[0])} that "
            "`like` does not "
            "have: it was saved from a different model or optimizer."
        )
    out = [leaf for _, leaf in flat]
    for i, where, leaf in wanted:
        out[i] = _build(name, shown_path(where), saved[where], blob, leaf)
    for i, (p, leaf) in enumerate(flat):
        if jax.tree_util.keystr(p) in witnesses and not isinstance(leaf, jax.Array):
            out[i] = jnp.zeros(leaf.shape, leaf.dtype)  # an abstract `like`
    return jax.tree_util.tree_unflatten(treedef, out)
