"""PyTorch-style state dicts: `state_dict` names every parameter and state cell of a
model with PyTorch's dotted names; `load_state_dict` loads such a mapping (from
PyTorch or from `state_dict`) back into a model, converting the layouts in which
Equinox and PyTorch differ."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._buffer import Buffer, RecordState, is_state
from ._errors import StaleModelError, StateTypeError, StateValueError
from ._modes import to_refs
from .nn._batched import Batched


class IncompatibleKeys(NamedTuple):
    """What `load_state_dict(..., strict=False)` did not load, as PyTorch reports it.

    **Fields:**

    - `missing_keys`: names of the model that the state dict does not have (those
        parameters and cells keep their values).
    - `unexpected_keys`: names of the state dict that the model does not have
        (ignored).
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


# --------------------------------------------------------------------------- names


def _join(prefix: str, name: str) -> str:
    if not prefix:
        return name
    if not name:
        return prefix
    return f"{prefix}.{name}"


def _key_name(k: Any) -> str:
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return str(k)  # pragma: no cover - user-defined key types


def _path_name(prefix: str, path: tuple[Any, ...]) -> str:
    name = prefix
    for k in path:
        name = _join(name, _key_name(k))
    return name


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _is_key_dtype(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


# ------------------------------------------------------------ PyTorch layouts
#
# A *layout* says how one Equinox layer type is stored in PyTorch when the two
# differ (names or array layouts). `export` gives the layer's arrays in PyTorch's
# layout under PyTorch's local names (jnp ops only, so `jax.eval_shape` gives the
# expected shapes); `import_` takes every local name (PyTorch layout) and returns the
# layer with the converted arrays. Layers without a layout are named field by field.


class _Layout(NamedTuple):
    applies: Callable[[Any], bool]
    export: Callable[[Any], dict[str, Any]]
    import_: Callable[[Any, dict[str, Any]], Any]


def _spatial(w: Any) -> tuple[int, ...]:
    return tuple(range(2, w.ndim))


def _conv_export(m: Any) -> dict[str, Any]:
    out = {"weight": m.weight}
    if m.bias is not None:
        out["bias"] = m.bias.reshape(-1)  # Equinox [C, 1, ...], PyTorch [C]
    return out


def _conv_import(m: Any, a: dict[str, Any]) -> Any:
    m = eqx.tree_at(lambda x: x.weight, m, a["weight"])
    if m.bias is not None:
        m = eqx.tree_at(lambda x: x.bias, m, a["bias"].reshape(m.bias.shape))
    return m


# Equinox's ConvTranspose weight is the forward convolution's kernel
# `[out, in/groups, *k]`, flipped in space; PyTorch's is `[in, out/groups, *k]`.
def _convt_export(m: Any) -> dict[str, Any]:
    w = jnp.flip(m.weight, _spatial(m.weight))
    g, k = m.groups, w.shape[2:]
    out_c, in_g = w.shape[0], w.shape[1]
    w = w.reshape((g, out_c // g, in_g) + k).swapaxes(1, 2)
    out = {"weight": w.reshape((g * in_g, out_c // g) + k)}
    if m.bias is not None:
        out["bias"] = m.bias.reshape(-1)
    return out


def _convt_import(m: Any, a: dict[str, Any]) -> Any:
    t = a["weight"]
    g, k = m.groups, t.shape[2:]
    in_c, out_g = t.shape[0], t.shape[1]
    w = t.reshape((g, in_c // g, out_g) + k).swapaxes(1, 2)
    w = w.reshape((g * out_g, in_c // g) + k)
    m = eqx.tree_at(lambda x: x.weight, m, jnp.flip(w, _spatial(w)))
    if m.bias is not None:
        m = eqx.tree_at(lambda x: x.bias, m, a["bias"].reshape(m.bias.shape))
    return m


def _prelu_export(m: Any) -> dict[str, Any]:
    return {"weight": m.negative_slope.reshape(-1)}  # PyTorch: [num_parameters]


def _prelu_import(m: Any, a: dict[str, Any]) -> Any:
    shape = m.negative_slope.shape
    return eqx.tree_at(lambda x: x.negative_slope, m, a["weight"].reshape(shape))


# eqx.nn.MultiheadAttention <-> torch.nn.MultiheadAttention(E, H, kdim, vdim,
# bias=...): PyTorch packs the three input projections (`in_proj_weight` when
# kdim == vdim == E, else `q/k/v_proj_weight`) and their biases (`in_proj_bias`),
# and names the output projection `out_proj`.
def _mha_applies(m: Any) -> bool:
    e = m.query_size
    in_bias = (m.use_query_bias, m.use_key_bias, m.use_value_bias)
    return (
        m.num_heads * m.qk_size == e
        and m.num_heads * m.vo_size == e
        and m.output_size == e
        and len(set(in_bias)) == 1
    )


def _mha_packed(m: Any) -> bool:
    return m.key_size == m.value_size == m.query_size


def _mha_export(m: Any) -> dict[str, Any]:
    projs = (m.query_proj, m.key_proj, m.value_proj)
    out: dict[str, Any] = {}
    if _mha_packed(m):
        out["in_proj_weight"] = jnp.concatenate([p.weight for p in projs])
    else:
        for n, p in zip("qkv", projs):
            out[f"{n}_proj_weight"] = p.weight
    if m.use_query_bias:
        out["in_proj_bias"] = jnp.concatenate([p.bias for p in projs])
    out["out_proj.weight"] = m.output_proj.weight
    if m.use_output_bias:
        out["out_proj.bias"] = m.output_proj.bias
    return out


def _mha_import(m: Any, a: dict[str, Any]) -> Any:
    e = m.query_size
    if _mha_packed(m):
        ws = [a["in_proj_weight"][i * e : (i + 1) * e] for i in range(3)]
    else:
        ws = [a[f"{n}_proj_weight"] for n in "qkv"]
    m = eqx.tree_at(
        lambda x: (x.query_proj.weight, x.key_proj.weight, x.value_proj.weight), m, ws
    )
    if m.use_query_bias:
        bs = [a["in_proj_bias"][i * e : (i + 1) * e] for i in range(3)]
        m = eqx.tree_at(
            lambda x: (x.query_proj.bias, x.key_proj.bias, x.value_proj.bias), m, bs
        )
    m = eqx.tree_at(lambda x: x.output_proj.weight, m, a["out_proj.weight"])
    if m.use_output_bias:
        m = eqx.tree_at(lambda x: x.output_proj.bias, m, a["out_proj.bias"])
    return m


# eqx.nn.LSTMCell keeps one bias, PyTorch two (`bias_ih + bias_hh`); the gate order
# (i, f, g, o) is the same. Export puts the whole bias in `bias_ih`.
def _lstm_export(m: Any) -> dict[str, Any]:
    out = {"weight_ih": m.weight_ih, "weight_hh": m.weight_hh}
    if m.bias is not None:
        out["bias_ih"] = m.bias
        out["bias_hh"] = jnp.zeros_like(m.bias)
    return out


def _lstm_import(m: Any, a: dict[str, Any]) -> Any:
    m = eqx.tree_at(
        lambda x: (x.weight_ih, x.weight_hh), m, (a["weight_ih"], a["weight_hh"])
    )
    if m.bias is not None:
        m = eqx.tree_at(lambda x: x.bias, m, a["bias_ih"] + a["bias_hh"])
    return m


# eqx.nn.GRUCell: `bias` (3H) is added to the input gates, `bias_n` (H) to the
# hidden part of the candidate inside the reset product, which is where PyTorch's
# `bias_hh[2H:]` goes; PyTorch's `bias_hh[:2H]` adds to the r, z gates like `bias`.
def _gru_export(m: Any) -> dict[str, Any]:
    out = {"weight_ih": m.weight_ih, "weight_hh": m.weight_hh}
    if m.bias is not None:
        h = m.hidden_size
        out["bias_ih"] = m.bias
        out["bias_hh"] = jnp.concatenate(
            [jnp.zeros((2 * h,), m.bias_n.dtype), m.bias_n]
        )
    return out


def _gru_import(m: Any, a: dict[str, Any]) -> Any:
    m = eqx.tree_at(
        lambda x: (x.weight_ih, x.weight_hh), m, (a["weight_ih"], a["weight_hh"])
    )
    if m.bias is not None:
        h = m.hidden_size
        b_ih, b_hh = a["bias_ih"], a["bias_hh"]
        bias = jnp.concatenate([b_ih[: 2 * h] + b_hh[: 2 * h], b_ih[2 * h :]])
        m = eqx.tree_at(lambda x: (x.bias, x.bias_n), m, (bias, b_hh[2 * h :]))
    return m


def _always(m: Any) -> bool:
    return True


_CONV = _Layout(_always, _conv_export, _conv_import)
_CONVT = _Layout(_always, _convt_export, _convt_import)
_LAYOUTS: dict[type, _Layout] = {
    eqx.nn.Conv: _CONV,
    eqx.nn.Conv1d: _CONV,
    eqx.nn.Conv2d: _CONV,
    eqx.nn.Conv3d: _CONV,
    eqx.nn.ConvTranspose: _CONVT,
    eqx.nn.ConvTranspose1d: _CONVT,
    eqx.nn.ConvTranspose2d: _CONVT,
    eqx.nn.ConvTranspose3d: _CONVT,
    eqx.nn.PReLU: _Layout(_always, _prelu_export, _prelu_import),
    eqx.nn.MultiheadAttention: _Layout(_mha_applies, _mha_export, _mha_import),
    eqx.nn.LSTMCell: _Layout(_always, _lstm_export, _lstm_import),
    eqx.nn.GRUCell: _Layout(_always, _gru_export, _gru_import),
}

# Containers that PyTorch does not name: `eqx.nn.Sequential([...])` is
# `nn.Sequential(...)` (`features.0.weight`, not `features.layers.0.weight`), and a
# `Batched` wrapper is the layer it maps.
_TRANSPARENT: dict[type, str] = {eqx.nn.Sequential: "layers", Batched: "layer"}
# Not part of a state dict: Equinox's own state (`eqx.nn.StateIndex`, e.g. in
# `eqx.nn.BatchNorm`, lives outside the model), and recordings (what PyTorch's
# forward hooks would collect, which no state dict holds).
_SKIPPED: tuple[type, ...] = (eqx.nn.StateIndex, RecordState)


def _layout(x: Any) -> _Layout | None:
    lay = _LAYOUTS.get(type(x))
    return lay if lay is not None and lay.applies(x) else None


def _stop(x: Any) -> bool:
    t = type(x)
    return (
        is_state(x)
        or t in _TRANSPARENT
        or isinstance(x, _SKIPPED)
        or _layout(x) is not None
    )


# ------------------------------------------------------------------ reading


def _stale(name: str, e: Exception | None = None) -> StaleModelError:
    detail = f"\n{e}" if e is not None else ""
    return StaleModelError(
        f"`{name}` holds an array that was consumed (donated) by an earlier call: "
        "the model passed in was given to a step (`make_step` / `make_apply` donate "
        "the buffers they replace) and must not be used again. Use the model the "
        "step returned, or build the step with `donate=False`." + detail
    )


def _check_live(x: Any, name: str) -> None:
    if isinstance(x, jax.Array):
        try:
            deleted = x.is_deleted()
        except jax.errors.ConcretizationTypeError:  # a tracer: nothing to check
            return
        if deleted:
            raise _stale(name)


def _check_module(module: Any, name: str, check: Callable[[Any, str], None]) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(module)[0]:
        check(x, _path_name(name, path))


def _check_concrete(x: Any, name: str) -> None:
    _check_live(x, name)
    if isinstance(x, jax.ShapeDtypeStruct):
        raise StateValueError(
            f"`{name}` has no value: the model is abstract (built with "
            "`eqx.filter_eval_shape`, leaves are `jax.ShapeDtypeStruct`s). Load "
            "values into it first with `es.load_state_dict(model, state_dict)`."
        )


def _read_cell(cell: Buffer, name: str) -> Any:
    try:
        return cell[...]
    except StaleModelError as e:
        raise _stale(name, e) from e


def _host(x: Any) -> np.ndarray:
    if _is_key_dtype(x.dtype):
        x = jax.random.key_data(x)
    return np.array(x, copy=True)


def _items(tree: Any, prefix: str):
    """Yield `(name, leaf)` for every leaf of `tree` (flattened with `_stop`)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_stop)
    return [(_path_name(prefix, p), leaf) for p, leaf in flat], treedef


def _export(tree: Any, prefix: str, out: dict[str, np.ndarray]) -> None:
    items, _ = _items(tree, prefix)
    for name, leaf in items:
        if type(leaf) in _TRANSPARENT:
            _export(getattr(leaf, _TRANSPARENT[type(leaf)]), name, out)
        elif isinstance(leaf, _SKIPPED):
            continue
        elif is_state(leaf):
            _check_concrete(leaf.value, name)
            _put(out, name, _host(_read_cell(leaf, name)))
        elif (lay := _layout(leaf)) is not None:
            _check_module(leaf, name, _check_concrete)
            for local, v in lay.export(leaf).items():
                _put(out, _join(name, local), _host(v))
        elif _is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            _check_concrete(leaf, name)
            _put(out, name, _host(leaf))


def _put(out: dict[str, Any], name: str, value: Any) -> None:
    if name in out:
        raise StateValueError(
            f"Two parts of the model have the PyTorch name `{name}` (e.g. a dict key "
            "containing a dot, or an `eqx.nn.Sequential` beside a field of the same "
            "name): rename one of the fields so that every name is unique."
        )
    out[name] = value


def state_dict(model: Any) -> dict[str, np.ndarray]:
    """The parameters and state of `model` under PyTorch's names, as NumPy arrays.

    Names are dotted paths of the model's fields, as `torch.nn.Module.state_dict()`
    makes them: `conv1.weight`, `bn1.running_mean`, `bn1.num_batches_tracked`,
    `layer1.0.conv1.weight` (list/tuple items by index, dict items by key). A state
    cell counts under its field name (`bn1.running_mean`, not
    `bn1.running_mean.value`). Python fields (`inference`, hyperparameters) are not
    included. So naming the model's fields like the PyTorch attributes is all a port
    needs; `eqx.nn.Sequential` is named like `torch.nn.Sequential` (`features.0.weight`).

    Arrays come in PyTorch's layout where Equinox's differs: convolution biases are
    `[C]` (Equinox keeps `[C, 1, ...]`), transposed-convolution kernels are
    `[in, out/groups, *k]`, `eqx.nn.MultiheadAttention` gives `in_proj_weight` /
    `in_proj_bias` / `out_proj.*` (when PyTorch can express it, i.e. every head
    size times the number of heads is the query size), `eqx.nn.LSTMCell` /
    `GRUCell` give `bias_ih` / `bias_hh`, `eqx.nn.PReLU` gives `weight`. Dtypes are
    the model's (`num_batches_tracked` is int32; PyTorch's is int64 and
    `torch.nn.Module.load_state_dict` casts it). PRNG key cells give their key data
    (`jax.random.key_data`).

    The arrays are copies: later steps (which donate buffers) do not change them.
    Works in both storage modes.

    **Arguments:**

    - `model`: any model (value or ref mode).

    **Returns:**

    A `dict` from names to NumPy arrays. For PyTorch:
    `torch_model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})`.

    **Raises:**

    `eqx_state.StaleModelError` if the model was consumed by a step.

    **Example:**

    ```python
    import equinox as eqx, jax
    import eqx_state as es

    class Net(eqx.Module):
        conv1: eqx.nn.Conv2d
        bn1: es.nn.BatchNorm

    net = Net(eqx.nn.Conv2d(3, 8, 3, key=jax.random.key(0)), es.nn.BatchNorm(8))
    sd = es.state_dict(net)
    print(list(sd))  # ['conv1.weight', 'conv1.bias', 'bn1.weight', 'bn1.bias', 'bn1.running_mean', 'bn1.running_var', 'bn1.num_batches_tracked']
    print(sd["conv1.bias"].shape)  # (8,)
    ```
    """
    out: dict[str, np.ndarray] = {}
    _export(model, "", out)
    return out


# ------------------------------------------------------------------ loading


def _incoming(value: Any, name: str) -> Any:
    """A state-dict value as a NumPy or JAX array (no copy yet)."""
    if isinstance(value, jax.Array):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        return np.asarray(value)
    mod = type(value).__module__ or ""
    if mod.startswith("torch") and hasattr(value, "detach"):
        t = value.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":  # NumPy has no bfloat16: bit-cast
            import torch

            return t.view(torch.int16).numpy().view(jnp.bfloat16)
        return t.numpy()
    raise StateTypeError(
        f"state_dict[{name!r}] is a {type(value).__name__}; expected an array "
        "(a torch.Tensor, a NumPy array or a JAX array)."
    )


def _fits(x: Any, dtype: np.dtype) -> bool:
    info = np.iinfo(dtype)
    if x.size == 0:
        return True
    lo, hi = np.min(np.asarray(x)), np.max(np.asarray(x))
    return bool(lo >= info.min and hi <= info.max)


def _checked(
    value: Any, name: str, want: jax.ShapeDtypeStruct, where: str
) -> jax.Array:
    """Check a state-dict value against the model's expected (PyTorch-layout) shape
    and dtype; return it as a new JAX array of the model's dtype."""
    x = _incoming(value, name)
    shape = tuple(want.shape)
    if tuple(x.shape) != shape:
        raise StateValueError(
            f"Size mismatch for `{name}`: the state dict has shape "
            f"{tuple(x.shape)}, the model ({where}) expects {shape} in PyTorch's "
            "layout. Check that the layer is built with the same sizes as the "
            "PyTorch one (channels, kernel size, features)."
        )
    have, dtype = np.dtype(x.dtype), np.dtype(want.dtype)
    if have != dtype:
        ints = np.issubdtype(have, np.integer) and np.issubdtype(dtype, np.integer)
        floats = jnp.issubdtype(have, jnp.floating) and jnp.issubdtype(
            dtype, jnp.floating
        )
        if ints and _fits(x, dtype):
            x = np.asarray(x).astype(dtype)
        elif floats and jnp.promote_types(have, dtype) == dtype:
            # exact: every value of the narrower float is one of the wider (a
            # bfloat16 model's BatchNorm statistics are kept in float32)
            x = np.asarray(x).astype(dtype)
        else:
            fix = (
                "cast the state dict first, e.g. "
                f"`{{k: v.to(torch.{dtype.name}) for k, v in sd.items()}}` for torch "
                f"tensors or `v.astype(np.{dtype.name})`, or build the model with "
                f"dtype={have.name}"
            )
            if ints:
                fix = f"its values do not fit in {dtype.name}"
            raise StateTypeError(
                f"Dtype mismatch for `{name}`: the state dict has {have.name}, the "
                f"model ({where}) holds {dtype.name}. Loading does not change a "
                f"value's precision or kind silently: {fix}."
            )
    return jnp.array(x, dtype=dtype, copy=True)


def _placed(new: Any, old: Any) -> Any:
    sharding = getattr(old, "sharding", None)
    if isinstance(old, jax.Array) and sharding is not None:
        return jax.device_put(new, sharding)
    return new


def _desc(leaf: Any) -> str:
    t = type(leaf)
    if is_state(leaf):
        return f"a {t.__name__} cell"
    if isinstance(leaf, eqx.Module):
        return f"{t.__module__.split('.')[0]}.{t.__qualname__}"
    return "a parameter"


def _key_impl(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):  # an abstract key: ask inside a trace
        box: list[Any] = []
        jax.eval_shape(lambda k: box.append(jax.random.key_impl(k)), x)
        return box[0]
    return jax.random.key_impl(x)


def _key_data_shape(x: Any) -> jax.ShapeDtypeStruct:
    return jax.eval_shape(jax.random.key_data, x)


class _Loader:
    def __init__(self, sd: Mapping[str, Any]):
        self.sd = sd
        self.used: set[str] = set()
        self.missing: list[str] = []
        self.no_value: list[str] = []  # missing, and the model has no value either

    def take(self, name: str, old: Any = None) -> tuple[Any, bool]:
        if name in self.sd:
            self.used.add(name)
            return self.sd[name], True
        self.missing.append(name)
        if isinstance(old, jax.ShapeDtypeStruct):
            self.no_value.append(name)
        return None, False

    def count_is_optional(self, name: str) -> bool:
        """PyTorch's rule for BatchNorm's `num_batches_tracked` (added in PyTorch
        0.4.1): a state dict without it loads, keeping the count, unless the state
        dict's metadata says that the module was saved at version 2 or later."""
        prefix, _, last = name.rpartition(".")
        if last != "num_batches_tracked":
            return False
        meta = getattr(self.sd, "_metadata", None)
        version = meta.get(prefix, {}).get("version") if meta is not None else None
        return version is None or version < 2

    def tree(self, tree: Any, prefix: str) -> Any:
        items, treedef = _items(tree, prefix)
        new = [self.leaf(name, leaf) for name, leaf in items]
        return jax.tree_util.tree_unflatten(treedef, new)

    def leaf(self, name: str, leaf: Any) -> Any:
        if type(leaf) in _TRANSPARENT:
            field = _TRANSPARENT[type(leaf)]
            sub = self.tree(getattr(leaf, field), name)
            return eqx.tree_at(lambda m: getattr(m, field), leaf, sub)
        if isinstance(leaf, _SKIPPED):
            return leaf
        if is_state(leaf):
            return self.cell(name, leaf)
        lay = _layout(leaf)
        if lay is not None:
            return self.layout(name, leaf, lay)
        if _is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            _check_live(leaf, name)
            value, found = self.take(name, leaf)
            if not found:
                return leaf
            want = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
            return _placed(_checked(value, name, want, _desc(leaf)), leaf)
        return leaf

    def cell(self, name: str, cell: Buffer) -> Buffer:
        ref_mode = isinstance(cell.value, jax.Ref)
        old = _read_cell(cell, name) if ref_mode else cell.value
        _check_live(old, name)
        if (
            jnp.issubdtype(old.dtype, jnp.integer)
            and name not in self.sd
            and self.count_is_optional(name)
        ):
            if isinstance(old, jax.ShapeDtypeStruct):  # PyTorch's fallback: 0
                return eqx.tree_at(lambda c: c.value, cell, jnp.zeros_like(old))
            value, found = None, False
        else:
            value, found = self.take(name, old)
        if found:
            is_key = _is_key_dtype(old.dtype)
            want = _key_data_shape(old) if is_key else old
            want = jax.ShapeDtypeStruct(want.shape, want.dtype)
            new = _placed(_checked(value, name, want, _desc(cell)), old)
            if is_key:
                new = jax.random.wrap_key_data(new, impl=_key_impl(old))
        else:
            new = old
        new_cell = eqx.tree_at(lambda c: c.value, cell, new)
        # ref mode: a new ref, so the model passed in is left as it was
        return to_refs(new_cell) if ref_mode else new_cell

    def layout(self, name: str, module: Any, lay: _Layout) -> Any:
        _check_module(module, name, _check_live)
        expected = jax.eval_shape(lay.export, module)
        abstract = any(
            isinstance(x, jax.ShapeDtypeStruct)
            for x in jax.tree_util.tree_leaves(module)
        )
        arrays: dict[str, Any] = {}
        for local, want in expected.items():
            full = _join(name, local)
            value, found = self.take(full, want if abstract else None)
            if found:
                where = f"{_desc(module)}, in PyTorch's layout"
                arrays[local] = _checked(value, full, want, where)
        if not arrays or (abstract and len(arrays) < len(expected)):
            return module
        if len(arrays) < len(expected):  # partly loaded: the rest keeps its value
            current = lay.export(module)
            arrays = {k: arrays.get(k, current[k]) for k in expected}
        new = lay.import_(module, arrays)
        return jax.tree_util.tree_map(_placed, new, module)


def _mismatch_message(model: Any, missing: list[str], unexpected: list[str]) -> str:
    lines = [f"Error(s) in loading a state dict into {type(model).__name__}:"]
    if missing:
        lines.append("  Missing key(s) in state_dict: " + ", ".join(missing) + ".")
    if unexpected:
        lines.append(
            "  Unexpected key(s) in state_dict: " + ", ".join(unexpected) + "."
        )
    hints = []
    if unexpected and all(k.startswith("module.") for k in unexpected):
        hints.append(
            "every unexpected key starts with `module.` (saved from "
            "`DataParallel`/`DistributedDataParallel`): strip it, e.g. "
            "`{k.removeprefix('module.'): v for k, v in sd.items()}`"
        )
    bn_stats = ("running_mean", "running_var", "num_batches_tracked")
    has_eqx_bn = any(
        isinstance(x, eqx.nn.BatchNorm)
        for x in jax.tree_util.tree_leaves(
            model, is_leaf=lambda x: isinstance(x, eqx.nn.BatchNorm)
        )
    )
    if has_eqx_bn and any(k.rsplit(".", 1)[-1] in bn_stats for k in unexpected):
        hints.append(
            "the model uses `eqx.nn.BatchNorm`, whose running statistics live in a "
            "separate `eqx.nn.State`: use `eqx_state.nn.BatchNorm`, which keeps "
            "`running_mean`, `running_var` and `num_batches_tracked` in the model"
        )
    hints.append(
        "names come from the model's field names: name each field like the PyTorch "
        "attribute (an `eqx.nn.Sequential` for an `nn.Sequential`, a list or tuple "
        "for an `nn.ModuleList`), or rename keys in the dict; `strict=False` loads "
        "the names that match and returns the lists above"
    )
    return "\n".join(lines + [f"  Hint: {h}." for h in hints])


@overload
def load_state_dict(
    model: Any, state_dict: Mapping[str, Any], *, strict: Literal[True] = True
) -> Any: ...


@overload
def load_state_dict(
    model: Any, state_dict: Mapping[str, Any], *, strict: Literal[False]
) -> tuple[Any, IncompatibleKeys]: ...


def load_state_dict(
    model: Any, state_dict: Mapping[str, Any], *, strict: bool = True
) -> Any:
    """Load a PyTorch-style state dict (from `torch.nn.Module.state_dict()` or
    [`eqx_state.state_dict`][]) into `model`, and return the loaded model.

    Names are matched as [`eqx_state.state_dict`][] makes them, and arrays are
    converted from PyTorch's layout where Equinox's differs (convolution biases,
    transposed-convolution kernels, packed attention projections, LSTM/GRU biases;
    see there). State cells keep their kind: the loaded value is written into the
    cell (`bn1.running_mean` stays an [`eqx_state.BatchStat`][]). Values may be
    `torch.Tensor`s, NumPy arrays or JAX arrays; each is copied.

    As in PyTorch, a BatchNorm's `num_batches_tracked` may be absent from a state
    dict without version metadata (checkpoints saved before PyTorch 0.4.1, plain
    dicts): the count then keeps its value and is not reported missing.

    Shapes must match exactly, and dtypes too, except where the conversion is
    exact: integers of another width whose values fit (PyTorch's int64
    `num_batches_tracked` into an int32 cell), and a float into a wider float (a
    bfloat16 model's BatchNorm statistics, kept in float32). A float64 tensor is
    not loaded silently into a float32 parameter.

    The model may be **abstract**, built without initialising anything (PyTorch's
    meta device): `model = eqx.filter_eval_shape(Net, ..., key=key)` gives
    `jax.ShapeDtypeStruct` leaves, and every one of them then comes from the state
    dict (an error names any that would be left without a value).

    This is functional, like everything in Equinox: the model passed in is left
    unchanged. In value mode the returned model holds new arrays; in **ref mode**
    ([`eqx_state.to_refs`][]) it holds **new refs** with the loaded values (the
    refs of the model passed in are not written), so rebind:
    `model = es.load_state_dict(model, sd)`.

    **Arguments:**

    - `model`: the model to load into (value or ref mode). Its structure, sizes and
        dtypes decide what is expected.
    - `state_dict`: a mapping from names to arrays.
    - `strict`: if `True` (default), every name of the model must be in
        `state_dict` and nothing else; otherwise a `ValueError` lists the missing
        and unexpected keys. If `False`, matching names are loaded, the others
        keep their values, and the lists are returned.

    **Returns:**

    With `strict=True`, the loaded model. With `strict=False`, a pair
    `(model, keys)` where `keys` is an [`eqx_state.IncompatibleKeys`][]
    `(missing_keys, unexpected_keys)`, as `torch.nn.Module.load_state_dict` returns.

    **Raises:**

    `ValueError` for missing/unexpected keys (strict) or a shape mismatch,
    `TypeError` for a dtype mismatch or a value that is not an array (each names
    the key), `eqx_state.StaleModelError` if the model was consumed by a step.

    **Example:**

    ```python
    import equinox as eqx, jax, torch
    import eqx_state as es

    class Net(eqx.Module):
        fc: eqx.nn.Linear
        bn: es.nn.BatchNorm

    tnet = torch.nn.Module()
    tnet.fc, tnet.bn = torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)
    net = Net(eqx.nn.Linear(4, 3, key=jax.random.key(0)), es.nn.BatchNorm(3))
    net = es.load_state_dict(net, tnet.state_dict())
    assert (net.fc.weight == tnet.fc.weight.detach().numpy()).all()

    partial = {"fc.weight": tnet.fc.weight, "head.bias": tnet.fc.bias}
    net, keys = es.load_state_dict(net, partial, strict=False)
    print(keys.unexpected_keys)  # ['head.bias']
    print(keys.missing_keys[:2])  # ['fc.bias', 'bn.weight']
    ```
    """
    if not isinstance(state_dict, Mapping):
        raise StateTypeError(
            "load_state_dict expects a mapping from names to arrays (e.g. "
            f"`torch_model.state_dict()`), got {type(state_dict).__name__}."
        )
    loader = _Loader(state_dict)
    new = loader.tree(model, "")
    unexpected = [k for k in state_dict if k not in loader.used]
    missing = loader.missing
    if loader.no_value and not (strict and (missing or unexpected)):
        raise StateValueError(
            "The model is abstract (built with `eqx.filter_eval_shape`) and the state "
            "dict lacks these names, so they would have no value: "
            + ", ".join(loader.no_value)
            + ". Provide them, or build the model with real arrays."
        )
    if strict:
        if missing or unexpected:
            raise StateValueError(_mismatch_message(model, missing, unexpected))
        return new
    return new, IncompatibleKeys(missing, unexpected)
