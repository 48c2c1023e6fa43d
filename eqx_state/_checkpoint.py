"""Checkpoints of any mix of parameters, state cells (either mode), optimizer state,
counters, RNG keys and metrics. A plain, code-free file format: loading never
unpickles or evaluates anything."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._buffer import _REF_KIND, _is_ref
from ._compat import with_weak_type
from ._errors import StateError


_MAGIC = b"EQXSTATE"
_VERSION = 1


class CheckpointError(StateError):
    """A checkpoint that cannot be loaded: missing, truncated or corrupt, or whose
    tree, shapes or dtypes differ from the model it is loaded into."""


def _is_saved(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or _is_ref(x)


def _is_witness(path: tuple) -> bool:
    # a ref-mode cell's shape witness (`Buffer.witness`): derived, not saved
    return bool(path) and getattr(path[-1], "name", None) == "witness"


def _entries(tree: Any) -> list[tuple[str, Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [
        (jax.tree_util.keystr(path), leaf)
        for path, leaf in leaves
        if _is_saved(leaf) and not _is_witness(path)
    ]


def _host_value(leaf: Any) -> tuple[np.ndarray, dict[str, Any]]:
    meta: dict[str, Any] = {}
    if _is_ref(leaf):
        meta["ref"] = True
        leaf = jax.freeze(leaf)  # outside a trace this is a copy: the ref stays valid
    if isinstance(leaf, jax.Array):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            meta["key_impl"] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        meta["weak_type"] = bool(getattr(leaf, "weak_type", False))
    arr = np.asarray(leaf)
    return arr, meta


def save(path: str | os.PathLike, tree: Any) -> None:
    """Save every array of `tree` (parameters, state cells in value or ref mode,
    optimizer state, PRNG keys, metrics) to `path`.

    The write is atomic: the data go to a temporary file in the same folder, which
    then replaces `path`, so a crash mid-save never leaves a corrupt checkpoint. The
    format is a JSON header (paths, dtypes, shapes, a SHA-256 of the data) followed
    by the raw bytes; nothing in it is executable. Python values in `tree` (flags,
    activation functions) are not saved: they come from `like` at load time.

    **Arguments:**

    - `path`: the file to write.
    - `tree`: any pytree, e.g. `(model, opt_state)`.

    **Example:**

    ```python
    import eqx_state as es

    bn = es.nn.BatchNorm(3)
    es.save("/tmp/bn.eqxs", bn)
    bn2 = es.load("/tmp/bn.eqxs", like=bn)
    ```
    """
    path = os.fspath(path)
    entries = []
    chunks = []
    offset = 0
    digest = hashlib.sha256()
    for name, leaf in _entries(tree):
        arr, meta = _host_value(leaf)
        data = np.ascontiguousarray(arr).tobytes()
        entries.append(
            {
                "path": name,
                "dtype": arr.dtype.name,
                "shape": list(arr.shape),
                "offset": offset,
                "nbytes": len(data),
                **meta,
            }
        )
        digest.update(data)
        chunks.append(data)
        offset += len(data)
    header = json.dumps(
        {"version": _VERSION, "entries": entries, "sha256": digest.hexdigest()}
    ).encode()
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".eqxs-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + struct.pack("<IQ", _VERSION, len(header)) + header)
            for data in chunks:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _read(path: str) -> tuple[dict[str, Any], bytes]:
    if not os.path.exists(path):
        raise CheckpointError(f"No checkpoint at {path!r}.")
    with open(path, "rb") as f:
        blob = f.read()
    fixed = len(_MAGIC) + struct.calcsize("<IQ")
    if len(blob) < fixed or not blob.startswith(_MAGIC):
        raise CheckpointError(
            f"{path!r} is not an eqx_state checkpoint (bad magic bytes): it is "
            "truncated, corrupt, or was written by something else."
        )
    version, header_len = struct.unpack("<IQ", blob[len(_MAGIC) : fixed])
    if version != _VERSION:
        raise CheckpointError(
            f"{path!r} has checkpoint format version {version}; this eqx_state reads "
            f"version {_VERSION}."
        )
    try:
        header = json.loads(blob[fixed : fixed + header_len].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{path!r} is truncated or corrupt: its header cannot be read."
        ) from e
    data = blob[fixed + header_len :]
    expected = sum(int(e["nbytes"]) for e in header["entries"])
    if len(data) != expected:
        raise CheckpointError(
            f"{path!r} is truncated or corrupt: {len(data)} bytes of data, the header "
            f"lists {expected}."
        )
    if hashlib.sha256(data).hexdigest() != header["sha256"]:
        raise CheckpointError(
            f"{path!r} is corrupt: the data do not match the checksum in its header."
        )
    return header, data


def load(path: str | os.PathLike, like: Any) -> Any:
    """Load a checkpoint written by [`eqx_state.save`][] into the structure of `like`.

    Everything is checked before anything is built: the file must hold exactly the
    arrays of `like` (same paths), with the same shapes and dtypes, or a
    [`eqx_state.CheckpointError`][] names the first mismatching path — never a
    partially loaded model. Cells that are refs in `like` get new refs (ref mode
    stays ref mode); tied cells stay tied; weak types are restored, so a resumed step
    does not recompile.

    **Arguments:**

    - `path`: the file to read.
    - `like`: a tree of the same structure (e.g. a freshly initialised
        `(model, opt_state)`); its Python values are kept, its arrays replaced.

    **Returns:**

    A tree like `like` holding the saved values.
    """
    path = os.fspath(path)
    header, data = _read(path)
    saved = {e["path"]: e for e in header["entries"]}
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    wanted = [
        (jax.tree_util.keystr(p), leaf)
        for p, leaf in flat
        if _is_saved(leaf) and not _is_witness(p)
    ]
    names = [n for n, _ in wanted]
    for name, leaf in wanted:
        if name not in saved:
            raise CheckpointError(
                f"The checkpoint {path!r} has no array at {name}: it was saved from a "
                "different model or optimizer. Load it into the structure it was saved "
                "from."
            )
        entry = saved[name]
        want_shape = tuple(leaf.shape)
        want_dtype = leaf.dtype
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raw = jax.eval_shape(
                jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
            )
            want_shape, want_dtype = tuple(raw.shape), raw.dtype
        if (
            tuple(entry["shape"]) != want_shape
            or entry["dtype"] != np.dtype(want_dtype).name
        ):
            raise CheckpointError(
                f"At {name} the checkpoint {path!r} holds {entry['dtype']}"
                f"{tuple(entry['shape'])} but the model expects "
                f"{np.dtype(want_dtype).name}{want_shape}. Build `like` with the same "
                "sizes and dtypes as the saved model."
            )
    extra = sorted(set(saved) - set(names))
    if extra:
        raise CheckpointError(
            f"The checkpoint {path!r} holds an array at {extra[0]} that `like` does not "
            "have: it was saved from a different model or optimizer."
        )
    out = []
    for p, leaf in flat:
        if not _is_saved(leaf) or _is_witness(p):
            out.append(leaf)
            continue
        e = saved[jax.tree_util.keystr(p)]
        raw = data[e["offset"] : e["offset"] + e["nbytes"]]
        arr = np.frombuffer(raw, dtype=np.dtype(jnp.dtype(e["dtype"]))).reshape(
            e["shape"]
        )
        value: Any = jnp.array(arr)
        if "key_impl" in e:
            value = jax.random.wrap_key_data(value, impl=e["key_impl"])
        elif e.get("weak_type"):
            value = _weak(value)
        if isinstance(leaf, np.ndarray):
            value = np.asarray(value)
        if _is_ref(leaf):
            value = jax.new_ref(value, kind=_REF_KIND)
        out.append(value)
    return jax.tree_util.tree_unflatten(treedef, out)


def _weak(x: jax.Array) -> Any:
    return with_weak_type(x, x.dtype, True)
