"""PyTorch-style state dicts: `state_dict` names every parameter and state cell of a
model with PyTorch's dotted names; `load_state_dict` loads such a mapping (from
PyTorch or from `state_dict`) back into a model, converting the layouts in which
Equinox and PyTorch differ."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._buffer import Buffer, RecordState, RngState, cells_of, check_live, is_state
from ._checkpoint import (
    _check_refs_unshared,
    _make_weak,
    _numpy_leaf,
    _python_type,
    refuse_tracer,
)
from ._compat import Tracer, placement_source, put_as
from ._errors import (
    StaleModelError,
    StateTypeError,
    StateValueError,
    check_bool,
    stale_message,
)
from ._modes import refs_in
from ._torch_names import (
    _SKIPPED,
    _Converter,
    _converter,
    _is_abstract,
    _is_array,
    _items,
    _join,
    _path_name,
    _stop,
    _view,
    torch_path_name,
)
from .nn._ema import EMA


def _is_key_dtype(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


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


# ------------------------------------------------------------------ reading


def _stale(name: str, e: Exception | None = None) -> StaleModelError:
    detail = f"\n{e}" if e is not None else ""
    return StaleModelError(stale_message("model", f"`{name}`") + detail)


def _check_live(x: Any, name: str) -> None:
    check_live(x, "model", f"`{name}`")


def _check_module(module: Any, name: str) -> None:
    """Check the arrays of a converted module before its conversion reads them
    (nested conversions and cells are checked when they are reached)."""
    flat = jax.tree_util.tree_flatten_with_path(
        module, is_leaf=lambda x: x is not module and _stop(x)
    )[0]
    for path, x in flat:
        _check_live(x, _path_name(name, path))


def _read_cell(cell: Buffer, name: str) -> Any:
    try:
        return cell[...]
    except StaleModelError as e:
        raise _stale(name, e) from e


def _host(x: Any, name: str) -> np.ndarray | jax.ShapeDtypeStruct:
    """A copy on the host; for an abstract value, its shape and dtype. A tracer
    (`es.state_dict` inside `jax.jit`) is refused as every persistence path
    refuses it."""
    if isinstance(x, Tracer):
        refuse_tracer("es.state_dict", f"model's `{name}`", "export")
    if isinstance(x, jax.ShapeDtypeStruct):
        if _is_key_dtype(x.dtype):
            x = _key_data_shape(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    if _is_key_dtype(x.dtype):
        x = jax.random.key_data(x)
    return np.array(x, copy=True)


def _export(tree: Any, prefix: str, out: dict[str, Any]) -> None:
    items, _ = _items(tree, prefix)
    for name, leaf in items:
        if isinstance(leaf, _SKIPPED):
            continue
        elif is_state(leaf):
            _check_live(leaf.value, name)
            value = leaf.value
            if not isinstance(value, jax.ShapeDtypeStruct):
                value = _read_cell(leaf, name)
            _put(out, name, _host(value, name))
        elif (conv := _converter(leaf)) is not None:
            _check_module(leaf, name)
            for local, v in _view(leaf, conv, name).items():
                _export(v, _join(name, local), out)
        elif _is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            _check_live(leaf, name)
            _put(out, name, _host(leaf, name))


def _put(out: dict[str, Any], name: str, value: Any) -> None:
    if name in out:
        raise StateValueError(
            f"Two parts of the model have the PyTorch name `{name}` (e.g. a dict key "
            "containing a dot, or an `eqx.nn.Sequential` beside a field of the same "
            "name): rename one of the fields so that every name is unique."
        )
    out[name] = value


def state_dict(model: Any) -> dict[str, np.ndarray | jax.ShapeDtypeStruct]:
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
    `GRUCell` give `bias_ih` / `bias_hh`, `eqx.nn.PReLU` gives `weight`,
    [`eqx_state.nn.SpectralNorm`][] and `eqx.nn.WeightNorm` give the names of
    `torch.nn.utils.parametrizations` (`parametrizations.weight.original`,
    `parametrizations.weight.0._u`, ...), [`eqx_state.nn.EMA`][] those of
    `torch.optim.swa_utils.AveragedModel` (`n_averaged`, `module.*`). Every one of
    these is declared with [`eqx_state.register_torch_names`][], which does the
    same for your own modules. Dtypes are
    the model's (`num_batches_tracked` is int32; PyTorch's is int64 and
    `torch.nn.Module.load_state_dict` casts it). PRNG key cells give their key data
    (`jax.random.key_data`).

    **Stacked layers** (built with `eqx.filter_vmap`: an ensemble, or layers
    stacked for `jax.lax.scan`) give each member's PyTorch arrays stacked along the
    leading axes (`np.stack` of the members' state dicts), and
    [`eqx_state.load_state_dict`][] takes that layout.

    What PyTorch has no buffer for is left out: `es.nn.Record` / `Capture`
    recordings (diagnostics; `es.save` keeps them; loading into an abstract model
    gives them their initial values). A zero-debiased
    [`eqx_state.nn.EMA`][] exports its debiased average (PyTorch's meaning) and
    loading multiplies the correction back in float32, so its round trip is exact
    to float32 rounding, not bit for bit: resume such a run with [`eqx_state.save`][].

    The arrays are copies: later steps (which donate buffers) do not change them.
    Works in both storage modes. For an **abstract** model (built with
    `eqx.filter_eval_shape`, PyTorch's meta device) the values are
    `jax.ShapeDtypeStruct`s with PyTorch's shapes: the names, without any array.

    **Arguments:**

    - `model`: any model (value or ref mode).

    **Returns:**

    A `dict` from names to NumPy arrays (`jax.ShapeDtypeStruct`s where the model
    is abstract). For PyTorch:
    `torch_model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})`;
    `torch.from_numpy` takes no bfloat16 (NumPy has none; these are `ml_dtypes`
    arrays): convert such an entry by its bits,
    `torch.from_numpy(v.view(np.uint16)).view(torch.bfloat16)`.

    **Raises:**

    `eqx_state.StaleModelError` if the model was consumed by a step;
    `eqx_state.CheckpointError` if a ref-mode model holds one ref at two places (it
    would be listed under two names and loaded back as two states; share state with
    `eqx.nn.Shared`, as [`eqx_state.save`][] also requires).

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
    _check_refs_unshared(model, "es.state_dict", "a state dict")
    out: dict[str, Any] = {}
    _export(model, "", out)
    return out


# ------------------------------------------------------------------ loading


# PyTorch dtypes that NumPy lacks, as the ml_dtypes types JAX uses.
_NO_NUMPY_DTYPE = {
    name: np.dtype(getattr(jnp, name))
    for name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(jnp, name)
}


def _incoming(value: Any, name: str) -> Any:
    """A state-dict value as a NumPy or JAX array (no copy yet)."""
    if isinstance(value, jax.Array):
        if _is_key_dtype(value.dtype):  # (as `state_dict` writes a key)
            raise StateTypeError(
                f"state_dict[{name!r}] is an array of typed PRNG keys: a state "
                "dict holds a key as its key data. Pass "
                f"`jax.random.key_data(...)` for {name!r}."
            )
        return value
    if isinstance(value, np.ma.MaskedArray) and np.ma.is_masked(value):
        # np.asarray drops the mask: the masked entries' stale data would load
        # (one with nothing masked, netCDF4's default, loads its data)
        raise StateTypeError(
            f"state_dict[{name!r}] is a NumPy masked array: its mask has no place "
            "in the model, and loading would take the data under it as values. "
            "Fill the masked entries first (`value.filled(fill_value)`) or pass "
            "`value.data` if the mask means nothing."
        )
    if isinstance(value, (np.ndarray, np.generic)):
        return np.asarray(value)
    mod = type(value).__module__ or ""
    if mod.startswith("torch") and hasattr(value, "detach"):
        if getattr(value, "is_meta", False):
            raise StateValueError(
                f"state_dict[{name!r}] is a tensor on PyTorch's meta device: it has "
                "no values. Materialise the PyTorch model first (`to_empty`, then "
                "load or initialise its weights)."
            )
        t = value.detach().cpu().resolve_conj().resolve_neg()
        narrow = _NO_NUMPY_DTYPE.get(str(t.dtype).removeprefix("torch."))
        try:
            if narrow is not None:  # NumPy has no such dtype: bit-cast (ml_dtypes)
                import torch

                bits = torch.int8 if np.dtype(narrow).itemsize == 1 else torch.int16
                return t.view(bits).numpy().view(narrow)
            return t.numpy()
        except (TypeError, RuntimeError) as e:  # a dtype or layout NumPy cannot hold
            raise StateTypeError(
                f"state_dict[{name!r}] is a torch.Tensor of dtype {t.dtype} and "
                f"layout {t.layout}, which cannot be read as an array ({e}). Convert "
                "it in PyTorch first (`.to(torch.float32)`, `.to_dense()`)."
            ) from e
    raise StateTypeError(
        f"state_dict[{name!r}] is a {type(value).__name__}; expected an array "
        "(a torch.Tensor, a NumPy array or a JAX array)."
    )


def _fits(x: Any, dtype: np.dtype, name: str) -> bool:
    if isinstance(x, Tracer):  # its range cannot be read
        refuse_tracer("es.load_state_dict", f"state-dict entry {name!r}", "load")
    info = np.iinfo(dtype)
    if x.size == 0:
        return True
    lo, hi = np.min(np.asarray(x)), np.max(np.asarray(x))
    return bool(lo >= info.min and hi <= info.max)


def _checked(
    value: Any, name: str, want: jax.ShapeDtypeStruct, where: str, *, numpy=False
) -> Any:
    """Check a state-dict value against the model's expected (PyTorch-layout) shape
    and dtype; return it as a new JAX array of the model's dtype (`numpy`: a new
    NumPy array, for a NumPy leaf, whose 64-bit dtype JAX would narrow)."""
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
        if ints and _fits(x, dtype, name):
            x = np.asarray(x).astype(dtype)
        elif floats and jnp.promote_types(have, dtype) == dtype:
            # exact: every value of the narrower float is one of the wider (a
            # bfloat16 model's BatchNorm statistics are kept in float32)
            x = np.asarray(x).astype(dtype)
        else:
            fix = (
                f"cast that entry first, e.g. `sd[{name!r}] = sd[{name!r}]"
                f".to(torch.{dtype.name})` for a torch tensor or "
                f"`.astype(np.{dtype.name})`"
            )
            if floats:  # a precision that the whole model could be built in
                fix += f", or build the model with dtype={have.name}"
            if ints:
                info = np.iinfo(dtype)
                fix = (
                    f"its values do not fit in {dtype.name}. Bring the entry into "
                    f"{dtype.name}'s range first, e.g. `sd[{name!r}] = "
                    f"sd[{name!r}].clamp({info.min}, {info.max})` for a torch "
                    f"tensor or `np.clip(..., {info.min}, {info.max})` (a count "
                    "such as `num_batches_tracked` at its largest value weighs a "
                    "`momentum=None` update as a count one higher would, to "
                    "float32 precision)"
                )
            raise StateTypeError(
                f"Dtype mismatch for `{name}`: the state dict has {have.name}, the "
                f"model ({where}) holds {dtype.name}. Loading does not change a "
                f"value's precision or kind silently: {fix}."
            )
    if numpy:
        return np.array(x, dtype=dtype)
    return jnp.array(x, dtype=dtype, copy=True)


def _weak_like(new: jax.Array, old: Any) -> jax.Array:
    """`new`, weakly typed where the model's parameter is (`jnp.asarray(0.5)`,
    the alpha of `eqx.nn.PReLU`): loading keeps how the model computes with it (a
    strong float32 scale would promote a bfloat16 model's activations), as
    `es.load` and the other paths keep it."""
    return _make_weak(new) if getattr(old, "weak_type", False) else new


def _check_count(value: Any, name: str) -> None:
    """A count of batches is never negative: PyTorch's `momentum=None` divides by
    it (-1 + 1 = 0 raised `ZeroDivisionError` there and would make every statistic
    NaN here, silently), and any negative count weighs the next batch wrongly."""
    if isinstance(value, Tracer):  # its values cannot be read
        refuse_tracer("es.load_state_dict", f"state-dict entry {name!r}", "load")
    low = int(np.min(np.asarray(value))) if np.size(value) else 0
    if low < 0:
        raise StateValueError(
            f"`{name}` is {low} in the state dict: a count of batches is never "
            "negative (the state dict is corrupt, or was edited). Set it to the "
            f"number of batches seen, or to 0 to start the count over "
            f"(`sd[{name!r}] = torch.tensor(0)`)."
        )


def _loaded(
    value: Any, name: str, old: Any, where: str, *, cell: bool = False
) -> jax.Array:
    """The state-dict entry `value` for the model's array `old` (a parameter's, a
    `cell`'s, or an abstract leaf): checked against its shape and dtype (a typed
    PRNG key's against its key data, as `state_dict` writes it), a new JAX array
    of its type (a key wrapped in its implementation; a parameter weakly typed
    where `old` is: a cell holds a strongly typed array, although an abstract
    model's struct of one built from a weak value says weak), placed as `old`
    is."""
    is_key = _is_key_dtype(old.dtype)
    want = _key_data_shape(old) if is_key else old
    if _uncommits(value, old):  # public JAX uncommits an array only through the host
        value = np.asarray(value)
    new = _checked(value, name, jax.ShapeDtypeStruct(want.shape, want.dtype), where)
    if is_key:
        new = jax.random.wrap_key_data(new, impl=_key_impl(old))
    return _placed(new if cell else _weak_like(new, old), old, f"`{name}`")


def _exactly(x: Any, dtype: Any) -> bool:
    """Whether the Python number `x` (`_python_type`: a bool, int, float or
    complex) fits NumPy's `dtype`: of its kind (a bool for a bool, an int for a
    number type, a float for a float type, rounded as NumPy rounds it, a complex
    for a complex one) and in its range."""
    dtype = np.dtype(dtype)
    if isinstance(x, bool):
        return dtype.kind == "b"
    kinds = "iufc" if isinstance(x, int) else "fc" if isinstance(x, float) else "c"
    if dtype.kind not in kinds:
        return False
    try:
        with np.errstate(over="raise", invalid="raise"):
            v = np.array(x, dtype=dtype)
    except (OverflowError, FloatingPointError, ValueError, TypeError):
        return False
    if dtype.kind in "iu":
        return int(v) == x
    return bool(np.isfinite(v)) or not np.isfinite(x)


def _as_before(new: Any, old: Any) -> Any:
    """A converted layer's leaf `new` as the leaf `old` it replaces: NumPy of its
    dtype where `old` is (the rule of every load path), else placed as `old` is."""
    if isinstance(old, np.ndarray | np.generic):
        return _numpy_leaf(np.array(new, dtype=old.dtype), old)
    return _placed(new, old)


def _uncommits(value: Any, old: Any) -> bool:
    """Whether the state-dict value `value` is a JAX array committed to its
    devices where the model's `old` is not (an uncommitted array, one a step
    consumed, an abstract leaf naming no sharding): the loaded array is then made
    uncommitted where `old` is, as PyTorch's `load_state_dict` copies into the
    module's own tensors, wherever the given ones are (kept committed, it moved
    every later call onto the value's device, or mixed devices)."""
    if not (
        isinstance(value, jax.Array)
        and not isinstance(value, Tracer)
        and not _is_key_dtype(value.dtype)  # (refused by name: `_incoming`)
        and value.committed
        and value.is_fully_addressable
    ):
        return False
    src = placement_source(old)
    if src is not None:
        return not src.committed
    return not (
        isinstance(old, jax.ShapeDtypeStruct)
        and isinstance(old.sharding, jax.sharding.Sharding)
    )


def _placed(new: Any, old: Any, name: str | None = None) -> Any:
    """`new` (an array) placed and committed as the live array or ref `old` it
    replaces is, or on the sharding an abstract model's leaf names (`put_as`, as
    `es.load`); as it is where `old` holds no array and names no sharding."""
    if isinstance(new, jax.Ref | jax.ShapeDtypeStruct) or (
        placement_source(old) is None and not isinstance(old, jax.ShapeDtypeStruct)
    ):
        return new
    if isinstance(new, Tracer):  # a load staged into a trace, into a concrete model
        refuse_tracer("es.load_state_dict", f"value for {name or 'a leaf'}", "load")
    return put_as(new, old, where=name)


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
        # parts of abstract converted layers that their conversion does not name
        self.unnamed: list[str] = []
        # (name, layer) of each `eqx.nn.MultiheadAttention`, for the error's hint
        self.attention: list[tuple[str, Any]] = []

    def take(
        self, name: str, old: Any = None, alts: Sequence[str] = ()
    ) -> tuple[Any, bool, str]:
        for key in (name, *alts):
            if key in self.sd:
                self.used.add(key)
                return self.sd[key], True, key
        self.missing.append(name)
        if isinstance(old, jax.ShapeDtypeStruct):
            self.no_value.append(name)
        return None, False, name

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
        if isinstance(leaf, RecordState):
            return self.recording(name, leaf)
        if isinstance(leaf, _SKIPPED):
            return leaf
        if is_state(leaf):
            return self.cell(name, leaf)
        conv = _converter(leaf)
        if conv is not None:
            return self.converted(name, leaf, conv)
        if _is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            return self.array(name, leaf, _desc(leaf))
        return leaf

    def array(self, name: str, leaf: Any, where: str, alts: Sequence[str] = ()) -> Any:
        _check_live(leaf, name)
        value, found, key = self.take(name, leaf, alts)
        if not found:
            return leaf
        if isinstance(leaf, np.ndarray | np.generic):  # stays NumPy, as every load
            want = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
            return _numpy_leaf(_checked(value, key, want, where, numpy=True), leaf)
        return _loaded(value, key, leaf, where)

    def recording(self, name: str, cell: RecordState) -> RecordState:
        """A recording (`es.nn.Record`, `Capture`) is in no state dict. In an
        abstract model it gets its initial value, as a fresh model has it (like
        `num_batches_tracked` absent from an old state dict): every cell then has
        a value, and a training call, a step or `es.save` work on the result."""
        old = cell.value
        if isinstance(old, jax.Ref):
            # a new ref holding the recording, as every other ref-mode cell gets:
            # the model passed in is not written through the result
            return _fresh_refs(cell)
        if not isinstance(old, jax.ShapeDtypeStruct):
            return cell
        if cell.init is None:  # nothing to fill with: reported as having no value
            self.no_value.append(name)
            return cell
        fill = jnp.full(old.shape, cell.init, old.dtype)
        return eqx.tree_at(lambda c: c.value, cell, fill)

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
            value, found, name = self.take(name, old)
        if found:
            new = _loaded(value, name, old, _desc(cell), cell=True)
            if name.rpartition(".")[2] == "num_batches_tracked":
                # the value given, checked (shape, dtype) above: `new` is a
                # tracer where the model's cell is (a jit argument)
                _check_count(_incoming(value, name), name)
        elif isinstance(old, jax.ShapeDtypeStruct) and isinstance(cell, RngState):
            # randomness, which PyTorch keeps outside its state dicts (Dropout
            # draws from the global generator): a stream of an abstract model
            # that the state dict does not seed is seeded from its name
            self.no_value.remove(name)
            new = _seeded(name, old)
        else:
            new = old
        new_cell = eqx.tree_at(lambda c: c.value, cell, new)
        # ref mode: a new ref, so the model passed in is left as it was
        return refs_in(new_cell, like=cell) if ref_mode else new_cell

    def left_without_value(self, name: str, out: Any) -> None:
        """Report each part of a converted abstract layer that its conversion left
        without a value (a cell it does not hold in PyTorch's layout)."""

        def stop(x: Any) -> bool:  # a converted sub-layer reports its own
            return is_state(x) or (x is not out and _converter(x) is not None)

        flat = jax.tree_util.tree_flatten_with_path(out, is_leaf=stop)[0]
        for path, leaf in flat:
            if isinstance(getattr(leaf, "value", leaf), jax.ShapeDtypeStruct):
                self.unnamed.append(_join(name, torch_path_name(out, path)))

    def converted(self, name: str, module: Any, conv: _Converter) -> Any:
        _check_module(module, name)
        if isinstance(module, eqx.nn.MultiheadAttention):
            self.attention.append((name, module))
        view = _view(module, conv, name)
        aliases = conv.aliases(module)
        where = f"{_desc(module)}, in PyTorch's layout"
        used, no_value = len(self.used), len(self.no_value)
        new: dict[str, Any] = {}
        loaded: dict[str, bool] = {}
        for local, value in view.items():
            full = _join(name, local)
            if _is_array(value) or isinstance(value, jax.ShapeDtypeStruct):
                alts = [_join(name, a) for a in aliases.get(local, ())]
                before = len(self.used)
                try:
                    new[local] = self.array(full, value, where, alts)
                except StateValueError as e:  # the conversion's hint, if it has one
                    hint = conv.size_hint(module, local)
                    if hint is not None and str(e).startswith("Size mismatch"):
                        e.add_note(hint)
                    raise
                loaded[local] = len(self.used) > before
            else:  # a cell, a sub-tree, None
                new[local] = self.tree(value, full)
        for group in conv.joint(module):
            got = [loaded.get(k, False) for k in group]
            if any(got) and not all(got):
                names = [_join(name, k) for k in group]
                given = ", ".join(f"`{n}`" for n, g in zip(names, got) if g)
                absent = ", ".join(f"`{n}`" for n, g in zip(names, got) if not g)
                raise StateValueError(
                    f"The state dict has {given} but not {absent}: {_desc(module)} "
                    "keeps these PyTorch arrays as one (e.g. their sum), so part of "
                    "them cannot be loaded into it. Provide all of "
                    + ", ".join(f"`{n}`" for n in names)
                    + " (PyTorch would combine the new one with the layer's current "
                    "other one: take that from the PyTorch model's state dict)."
                )
        if len(self.used) == used:  # nothing loaded: the module as it was
            return _fresh_refs(module)
        if _is_abstract(module) and len(self.no_value) > no_value:
            # partly loaded: reported as having no value (a missing name that
            # got a value, a Dropout's stream seeded from its name, does not count)
            return module
        try:
            out = conv.from_torch(module, new)
        except Exception as e:  # a registered conversion's own error: say where
            e.add_note(
                f"(in the `from_torch` of {type(module).__name__}, loading "
                f"`{name or 'the model'}`)"
            )
            raise
        _check_converted(name, module, out)
        flat, treedef = jax.tree_util.tree_flatten(out)
        old, old_treedef = jax.tree_util.tree_flatten(module)
        if treedef == old_treedef:  # each array where the one it replaces was
            # (a cell's too: the conversion's arithmetic ran where JAX chose), a
            # NumPy one as NumPy (the conversion's arithmetic gave a JAX array)
            out = jax.tree_util.tree_unflatten(treedef, map(_as_before, flat, old))
        if _is_abstract(module):
            self.left_without_value(name, out)
        if not _has_refs(module):
            return out
        # a cell the conversion left out holds the module's own ref: a new one, so
        # that the model passed in and the loaded one do not write each other
        return refs_in(_fresh_refs(out), like=module)


def _check_converted(name: str, module: Any, out: Any) -> None:
    """What a conversion's `from_torch` gave back must be `module` with new
    values: the same type and structure, each array of the shape and dtype it
    replaces (a registered conversion could return a slice, a cast, or a bare
    array, which loaded without a word)."""
    where = f"`{name or 'the model'}`"
    fix = (
        f"The `from_torch` registered for {type(module).__name__} must return the "
        "module with the loaded values (`from_torch(m, to_torch(m))` gives `m` "
        "back, e.g. through `eqx.tree_at`)."
    )
    if type(out) is not type(module):
        raise StateValueError(
            f"Loading {where}: `from_torch` returned a {type(out).__name__}, not a "
            f"{type(module).__name__}. {fix}"
        )
    got, treedef = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_state)
    want, want_treedef = jax.tree_util.tree_flatten(module, is_leaf=is_state)
    if treedef != want_treedef:
        raise StateValueError(
            f"Loading {where}: `from_torch` returned a {type(out).__name__} of "
            f"another structure than the model's. {fix}"
        )
    for (path, a), b in zip(got, want):
        if is_state(a) or is_state(b):
            a, b = getattr(a, "value", a), getattr(b, "value", b)
        if not isinstance(
            b, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic
        ):
            continue
        if isinstance(b, np.ndarray | np.generic) and _python_type(a) is not None:
            # a Python number for a NumPy leaf: it has no dtype of its own, so it
            # must convert to the leaf's exactly (JAX's 32-bit reading is not it)
            if b.shape == () and _exactly(a, b.dtype):
                continue
            raise StateValueError(
                f"Loading {where}: `from_torch` returned {a!r} at "
                f"`{jax.tree_util.keystr(path)}`, where the model holds "
                f"{b.dtype}{list(b.shape)}, which does not hold it exactly. {fix}"
            )
        # the value's own dtype (`jnp.result_type` narrows a NumPy int64 to int32;
        # a key array's is JAX's, not NumPy's)
        dtype = a.dtype if hasattr(a, "dtype") else jnp.result_type(a)
        if jnp.shape(a) != b.shape or dtype != b.dtype:
            # JAX's 32-bit stand-in for the NumPy leaf's 64-bit dtype (x64 off)
            numpy = isinstance(b, np.ndarray | np.generic)
            stand_in = jax.dtypes.canonicalize_dtype(b.dtype) if numpy else None
            if numpy and stand_in != b.dtype and dtype == stand_in:
                fix = (
                    "(The model holds a 64-bit NumPy array there, which the "
                    "conversion's JAX arithmetic computes in 32 bits: enable "
                    "64-bit JAX, `jax.config.update('jax_enable_x64', True)`, or "
                    "hold that array as a JAX array.)"
                )
            raise StateValueError(
                f"Loading {where}: `from_torch` returned "
                f"{dtype}{list(jnp.shape(a))} at "
                f"`{jax.tree_util.keystr(path)}`, where the model holds "
                f"{b.dtype}{list(b.shape)}. {fix}"
            )


def _has_refs(tree: Any) -> bool:
    return any(isinstance(c.value, jax.Ref) for c in cells_of(tree))


def _fresh_refs(tree: Any) -> Any:
    """`tree` with a new ref (holding the same value) in each ref-mode cell."""

    def one(x: Any) -> Any:
        if is_state(x) and isinstance(x.value, jax.Ref):
            return refs_in(eqx.tree_at(lambda c: c.value, x, x[...]), like=x)
        return x

    return jax.tree_util.tree_map(one, tree, is_leaf=is_state)


def _seeded(name: str, old: jax.ShapeDtypeStruct) -> jax.Array:
    """Key data for an `RngState` cell, from `jax.random.key(0)` and the cell's
    name (a fixed seed, like `torch.manual_seed(0)`; different per stream)."""
    key = jax.random.fold_in(jax.random.key(0), zlib.crc32(name.encode()))
    if _is_key_dtype(old.dtype):
        data = _key_data_shape(old)
        bits = jax.random.bits(key, data.shape, data.dtype)
        return jax.random.wrap_key_data(bits, impl=_key_impl(old))
    return jax.random.bits(key, old.shape, old.dtype)


_BN_STATS = ("running_mean", "running_var", "num_batches_tracked")


def _bias_hints(loader: _Loader, unexpected: list[str]) -> list[str]:
    """Hints for unexpected biases of layers built without them (Equinox's
    defaults differ from PyTorch's: `eqx.nn.MultiheadAttention` has none)."""
    hints = []
    extra = set(unexpected)
    for name, m in loader.attention:
        biases = [
            k
            for k, has in (
                ("in_proj_bias", m.use_query_bias),
                ("out_proj.bias", m.use_output_bias),
            )
            if not has and _join(name, k) in extra
        ]
        if biases:
            extra -= {_join(name, k) for k in biases}
            where = f"at `{name}`" if name else "(the model itself)"
            hints.append(
                f"the `eqx.nn.MultiheadAttention` {where} was built without the "
                "biases that the state dict has ("
                + ", ".join(f"`{_join(name, k)}`" for k in biases)
                + "; PyTorch's have biases by default, Equinox's do not): build it "
                "with `use_query_bias=True, use_key_bias=True, use_value_bias=True, "
                "use_output_bias=True`. `strict=False` would drop those biases, "
                "and the layer would compute something else"
            )
    layers = [
        k.removesuffix("bias").removesuffix(".")
        for k in sorted(extra)
        if k.rsplit(".", 1)[-1] == "bias"
        and _join(k.removesuffix("bias").removesuffix("."), "weight") in loader.used
    ]
    if layers:
        hints.append(
            "the layer(s) at "
            + ", ".join(f"`{n}`" if n else "the top" for n in layers)
            + " were built without the bias that the state dict has: build them "
            "with their bias (`use_bias=True` for `eqx.nn.Linear`, the "
            "convolutions, `eqx.nn.LayerNorm`), not `strict=False`, which would "
            "drop it"
        )
    return hints


def _mismatch_message(
    model: Any, missing: list[str], unexpected: list[str], loader: _Loader
) -> str:
    lines = [f"Error(s) in loading a state dict into {type(model).__name__}:"]
    if missing:
        lines.append("  Missing key(s) in state_dict: " + ", ".join(missing) + ".")
    if unexpected:
        lines.append(
            "  Unexpected key(s) in state_dict: " + ", ".join(unexpected) + "."
        )
    hints = _bias_hints(loader, unexpected)
    has_ema = any(
        isinstance(x, EMA)
        for x in jax.tree_util.tree_leaves(model, is_leaf=lambda x: isinstance(x, EMA))
    )
    if has_ema and any(k.rsplit(".", 1)[-1] in _BN_STATS for k in unexpected):
        hints.append(
            "an `EMA` averages the parameters only; PyTorch's `AveragedModel` also "
            "saves the averaged module's buffers (copies of the source model's, "
            "e.g. BatchNorm statistics): load with `strict=False` (they are in the "
            "live model already), and load an exported EMA into `AveragedModel` "
            "with `strict=False` too"
        )
    elif unexpected and all(k.startswith("module.") for k in unexpected):
        hints.append(
            "every unexpected key starts with `module.` (saved from "
            "`DataParallel`/`DistributedDataParallel`): strip it, e.g. "
            "`{k.removeprefix('module.'): v for k, v in sd.items()}`"
        )
    bn_stats = _BN_STATS
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
    transposed-convolution kernels, packed attention projections, LSTM/GRU biases,
    spectral and weight normalisation, averaged models; see there). State cells keep their kind: the loaded value is written into the
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

    Older PyTorch names are accepted where a conversion declares them: the
    `weight_orig` / `weight_u` / `weight_v` of `torch.nn.utils.spectral_norm` and the
    `weight_g` / `weight_v` of `torch.nn.utils.weight_norm`. PyTorch arrays that
    Equinox keeps as one (an LSTM/GRU cell's `bias_ih` and `bias_hh`, summed) load
    together or not at all: a state dict with only one of them is refused, naming
    both (PyTorch would add the new half to the old one, which Equinox no longer
    has).

    The model may be **abstract**, built without initialising anything (PyTorch's
    meta device): `model = eqx.filter_eval_shape(Net, ..., key=key)` gives
    `jax.ShapeDtypeStruct` leaves, and every one of them then comes from the state
    dict (an error names any that would be left without a value). The exception is
    randomness, which PyTorch keeps outside its state dicts: an
    [`eqx_state.RngState`][] cell (an `es.nn.Dropout`'s stream) missing from the
    state dict is seeded from `jax.random.key(0)` and its name (different for every
    stream, the same in every run) and reported in `missing_keys`, so
    `strict=False` loads a PyTorch model into an abstract port that has `Dropout`s.
    To seed it otherwise, put its key data in the state dict
    (`sd["drop.rng.key"] = jax.random.key_data(jax.random.key(seed))`).
    Recordings (`es.nn.Record`, `Capture`), which no state dict holds, get their
    initial values, as in a freshly built model. A metric's statistics have no
    such fallback: an abstract model's metric that the state dict does not give
    values is refused, with `strict=False` too (build the model with real arrays,
    or add the statistics to the state dict).

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
    strict = check_bool("load_state_dict", "strict", strict)
    names = [k for k in state_dict if not isinstance(k, str)]
    if names:
        raise StateTypeError(
            "load_state_dict: a state dict's names are strings (PyTorch's "
            f"`layer.0.weight`), got {names[0]!r} of type {type(names[0]).__name__}"
            + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")
            + "."
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
    if strict and (missing or unexpected):
        raise StateValueError(_mismatch_message(model, missing, unexpected, loader))
    if loader.unnamed:
        raise StateValueError(
            "The model is abstract (built with `eqx.filter_eval_shape`), and "
            "these parts of it have no PyTorch name (their layer's conversion "
            "leaves them out of state dicts), so no state dict can give them a "
            "value: " + ", ".join(loader.unnamed) + ". Build the model with real "
            "arrays, or load them with `es.load` from a checkpoint of the whole "
            "model."
        )
    if strict:
        return new
    return new, IncompatibleKeys(missing, unexpected)
