"""PyTorch-style state dicts: `state_dict` names every parameter and state cell of a
model with PyTorch's dotted names; `load_state_dict` loads such a mapping (from
PyTorch or from `state_dict`) back into a model, converting the layouts in which
Equinox and PyTorch differ."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._buffer import Buffer, RecordState, RngState, is_state
from ._errors import StaleModelError, StateTypeError, StateValueError
from ._modes import to_refs
from .nn._batched import Batched
from .nn._ema import EMA
from .nn._spectral_norm import SpectralNorm


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


# --------------------------------------------------------- PyTorch conversions
#
# One mechanism names every module: a *converter*, registered per type with
# `register_torch_names`, says how a module is stored in PyTorch when that
# differs from its fields. `to_torch(module)` gives a dict, in PyTorch's
# registration order, from local PyTorch names to arrays in PyTorch's layout, state
# cells, or sub-trees (named further by the same rules, so wrapped layers keep
# their own conversion); `from_torch(module, view)` takes such a dict with the
# loaded values and returns the module. Modules without a converter are named
# field by field.


class _Converter(NamedTuple):
    to_torch: Callable[[Any], Mapping[str, Any]]
    from_torch: Callable[[Any, dict[str, Any]], Any]
    applies: Callable[[Any], bool]
    joint: Callable[[Any], Sequence[Sequence[str]]]
    aliases: Callable[[Any], Mapping[str, Sequence[str]]]


_CONVERTERS: dict[type, _Converter] = {}


def _per_module(x: Any, default: Any) -> Callable[[Any], Any]:
    if x is None:
        return lambda m: default
    if callable(x):
        return x
    return lambda m: x


def register_torch_names(
    cls: type,
    to_torch: Callable[[Any], Mapping[str, Any]],
    from_torch: Callable[[Any, dict[str, Any]], Any],
    *,
    applies: Callable[[Any], bool] | None = None,
    joint: Sequence[Sequence[str]] | Callable[[Any], Sequence[Sequence[str]]] = (),
    aliases: Mapping[str, Sequence[str]]
    | Callable[[Any], Mapping[str, Sequence[str]]]
    | None = None,
) -> None:
    """Declare how modules of type `cls` are named and laid out in a PyTorch state
    dict, for both [`eqx_state.state_dict`][] and [`eqx_state.load_state_dict`][].

    Every built-in conversion is declared this way (convolutions, attention,
    LSTM/GRU cells, `eqx.nn.Sequential`, [`eqx_state.nn.SpectralNorm`][],
    [`eqx_state.nn.EMA`][], ...); a module type without a declaration is named
    field by field.

    The rules:

    - `to_torch(module)` returns a `dict` from **local** PyTorch names (relative to
        the module, dotted if need be: `"out_proj.weight"`) to values, **in the order
        PyTorch registers them** (a module's own parameters, then its buffers, then
        its submodules): that order is the order of `es.state_dict` and of
        `missing_keys`. A value is an array in PyTorch's layout, a state cell, or any
        sub-tree (a layer, a list of layers), which is named under its key by the
        same rules, its own conversion included; `None` is skipped. Use `jnp`
        operations only: for an abstract model (`eqx.filter_eval_shape`) it runs
        under `eqx.filter_eval_shape` to give the shapes.
    - `from_torch(module, view)` gets a dict with the same keys and the loaded
        values (arrays in PyTorch's layout, loaded cells, loaded sub-trees) and
        returns the module holding them. Keys that a `strict=False` load did not
        provide hold the module's current values, as `to_torch` gave them, so
        `from_torch(m, to_torch(m))` must give `m` back.
    - Shapes and dtypes are checked against `to_torch`'s values before
        `from_torch` sees them.

    **Arguments:**

    - `cls`: the module type (exactly this type; subclasses are not covered, since
        they may have more fields).
    - `to_torch`, `from_torch`: the two directions, as above.
    - `applies`: optional `module -> bool`; where it is `False` the module is named
        field by field (e.g. an attention layer that PyTorch cannot express).
    - `joint`: groups of local names that can only be loaded together (or a
        `module -> groups` function), e.g. `[("bias_ih", "bias_hh")]` when two
        PyTorch arrays are summed into one Equinox array: a load that provides only
        part of a group is refused, naming the group.
    - `aliases`: older local names accepted on loading, `{name: [old, ...]}` (or a
        `module -> dict` function), e.g. `{"parametrizations.weight.original":
        ["weight_orig"]}`. Exporting always uses the first name.

    **Returns:**

    Nothing. A second registration for `cls` replaces the first.

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    import eqx_state as es

    class Scale(eqx.Module):  # PyTorch: a parameter `log_scale` of shape [1]
        scale: jax.Array

    es.register_torch_names(
        Scale,
        lambda m: {"log_scale": jnp.log(m.scale)[None]},
        lambda m, a: Scale(jnp.exp(a["log_scale"][0])),
    )
    sd = es.state_dict({"head": Scale(jnp.asarray(2.0))})
    print(list(sd), sd["head.log_scale"].shape)  # ['head.log_scale'] (1,)
    ```
    """
    if not isinstance(cls, type):
        raise StateTypeError(
            f"register_torch_names expects a class, got {type(cls).__name__}."
        )
    _CONVERTERS[cls] = _Converter(
        to_torch,
        from_torch,
        applies if applies is not None else (lambda m: True),
        _per_module(joint, ()),
        _per_module(aliases, {}),
    )


def _converter(x: Any) -> _Converter | None:
    conv = _CONVERTERS.get(type(x))
    return conv if conv is not None and conv.applies(x) else None


def _is_abstract(tree: Any) -> bool:
    return any(
        isinstance(x, jax.ShapeDtypeStruct)
        for x in jax.tree_util.tree_leaves(tree, is_leaf=is_state)
        for x in ([x.value] if is_state(x) else [x])
    )


def _view(module: Any, conv: _Converter) -> dict[str, Any]:
    """`conv.to_torch(module)`; for an abstract module, its shapes (in order)."""
    if not _is_abstract(module):
        return dict(conv.to_torch(module))
    order: list[list[str]] = []

    def run(m: Any) -> dict[str, Any]:
        out = dict(conv.to_torch(m))
        order.append(list(out))
        return out

    shapes = eqx.filter_eval_shape(run, module)
    return {k: shapes[k] for k in order[0]}


def _module_view(module: Any) -> tuple[dict[str, Any], Callable[[dict[str, Any]], Any]]:
    """Any module's local PyTorch names: its converter's view, or its fields. With
    the function that rebuilds it from such a dict (for wrappers such as
    `SpectralNorm`, which rename one entry of the layer they wrap)."""
    conv = _converter(module)
    if conv is not None:
        return _view(module, conv), lambda a: conv.from_torch(module, a)
    items, treedef = _items(module, "")
    view = dict(items)
    return view, lambda a: jax.tree_util.tree_unflatten(treedef, [a[k] for k in view])


def _spatial(w: Any) -> tuple[int, ...]:
    return tuple(range(2, w.ndim))


def _bias_view(m: Any) -> dict[str, Any]:
    return {} if m.bias is None else {"bias": m.bias.reshape(-1)}


def _with_bias(m: Any, a: dict[str, Any]) -> Any:
    if m.bias is None:
        return m
    return eqx.tree_at(lambda x: x.bias, m, a["bias"].reshape(m.bias.shape))


# Convolutions: bias [C] in PyTorch, [C, 1, ...] in Equinox.
def _conv_to_torch(m: Any) -> dict[str, Any]:
    return {"weight": m.weight, **_bias_view(m)}


def _conv_from_torch(m: Any, a: dict[str, Any]) -> Any:
    return _with_bias(eqx.tree_at(lambda x: x.weight, m, a["weight"]), a)


# Equinox's ConvTranspose weight is the forward convolution's kernel
# `[out, in/groups, *k]`, flipped in space; PyTorch's is `[in, out/groups, *k]`.
def _convt_to_torch(m: Any) -> dict[str, Any]:
    w = jnp.flip(m.weight, _spatial(m.weight))
    g, k = m.groups, w.shape[2:]
    out_c, in_g = w.shape[0], w.shape[1]
    w = w.reshape((g, out_c // g, in_g) + k).swapaxes(1, 2)
    return {"weight": w.reshape((g * in_g, out_c // g) + k), **_bias_view(m)}


def _convt_from_torch(m: Any, a: dict[str, Any]) -> Any:
    t = a["weight"]
    g, k = m.groups, t.shape[2:]
    in_c, out_g = t.shape[0], t.shape[1]
    w = t.reshape((g, in_c // g, out_g) + k).swapaxes(1, 2)
    w = w.reshape((g * out_g, in_c // g) + k)
    return _with_bias(eqx.tree_at(lambda x: x.weight, m, jnp.flip(w, _spatial(w))), a)


def _prelu_to_torch(m: Any) -> dict[str, Any]:
    return {"weight": m.negative_slope.reshape(-1)}  # PyTorch: [num_parameters]


def _prelu_from_torch(m: Any, a: dict[str, Any]) -> Any:
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


def _mha_to_torch(m: Any) -> dict[str, Any]:
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


def _mha_from_torch(m: Any, a: dict[str, Any]) -> Any:
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
# (i, f, g, o) is the same. Export puts the whole bias in `bias_ih`; loading needs
# both halves (`joint`): one half alone cannot be added to the other.
def _lstm_to_torch(m: Any) -> dict[str, Any]:
    out = {"weight_ih": m.weight_ih, "weight_hh": m.weight_hh}
    if m.bias is not None:
        out["bias_ih"] = m.bias
        out["bias_hh"] = jnp.zeros_like(m.bias)
    return out


def _lstm_from_torch(m: Any, a: dict[str, Any]) -> Any:
    m = eqx.tree_at(
        lambda x: (x.weight_ih, x.weight_hh), m, (a["weight_ih"], a["weight_hh"])
    )
    if m.bias is not None:
        m = eqx.tree_at(lambda x: x.bias, m, a["bias_ih"] + a["bias_hh"])
    return m


# eqx.nn.GRUCell: `bias` (3H) is added to the input gates, `bias_n` (H) to the
# hidden part of the candidate inside the reset product, which is where PyTorch's
# `bias_hh[2H:]` goes; PyTorch's `bias_hh[:2H]` adds to the r, z gates like `bias`.
def _gru_to_torch(m: Any) -> dict[str, Any]:
    out = {"weight_ih": m.weight_ih, "weight_hh": m.weight_hh}
    if m.bias is not None:
        h = m.hidden_size
        out["bias_ih"] = m.bias
        out["bias_hh"] = jnp.concatenate(
            [jnp.zeros((2 * h,), m.bias_n.dtype), m.bias_n]
        )
    return out


def _gru_from_torch(m: Any, a: dict[str, Any]) -> Any:
    m = eqx.tree_at(
        lambda x: (x.weight_ih, x.weight_hh), m, (a["weight_ih"], a["weight_hh"])
    )
    if m.bias is not None:
        h = m.hidden_size
        b_ih, b_hh = a["bias_ih"], a["bias_hh"]
        bias = jnp.concatenate([b_ih[: 2 * h] + b_hh[: 2 * h], b_ih[2 * h :]])
        m = eqx.tree_at(lambda x: (x.bias, x.bias_n), m, (bias, b_hh[2 * h :]))
    return m


def _rnn_joint(m: Any) -> list[tuple[str, str]]:
    return [] if m.bias is None else [("bias_ih", "bias_hh")]


# Containers that PyTorch does not name: `eqx.nn.Sequential([...])` is
# `nn.Sequential(...)` (`features.0.weight`, not `features.layers.0.weight`), and a
# `Batched` wrapper is the layer it maps (the empty local name).
def _sequential_from_torch(m: Any, a: dict[str, Any]) -> Any:
    layers = type(m.layers)(a[str(i)] for i in range(len(m.layers)))
    return eqx.tree_at(lambda s: s.layers, m, layers)


# Weight reparametrisations, as `torch.nn.utils.parametrizations` stores them: the
# wrapped layer's other entries, then `parametrizations.<weight>.original` (or
# `original0`, `original1`) and the parametrisation's buffers (`...0._u`).
def _reparam_view(layer: Any, weight: str, new: dict[str, Any]) -> dict[str, Any]:
    inner, _ = _module_view(layer)
    return {**{k: v for k, v in inner.items() if k != weight}, **new}


def _reparam_layer(layer: Any, weight: str, a: dict[str, Any], w: Any) -> Any:
    inner, rebuild = _module_view(layer)
    return rebuild({k: (w if k == weight else a[k]) for k in inner})


def _cell_with(cell: Buffer, value: Any) -> Buffer:
    return eqx.tree_at(lambda c: c.value, cell, value.astype(cell.dtype))


def _sn_v(sn: Any, v: Any) -> Any:
    """A ConvTranspose's v, PyTorch's `(in, *k)` flattened, is Equinox's flipped in
    space (as the kernels are); its own inverse. Other layers: unchanged."""
    if not (isinstance(sn.layer, eqx.nn.ConvTranspose) and sn.dim == 0):
        return v
    k = sn.weight.shape[2:]
    shaped = v.reshape((-1,) + k)
    return jnp.flip(shaped, tuple(range(1, shaped.ndim))).reshape(v.shape)


def _sn_names(sn: Any) -> tuple[str, str, str]:
    p = f"parametrizations.{sn.weight_name}"
    return f"{p}.original", f"{p}.0._u", f"{p}.0._v"


def _sn_to_torch(sn: Any) -> dict[str, Any]:
    w, u, v = _sn_names(sn)
    inner, _ = _module_view(sn.layer)
    return _reparam_view(
        sn.layer,
        sn.weight_name,
        {w: inner[sn.weight_name], u: sn.u[...], v: _sn_v(sn, sn.v[...])},
    )


def _sn_from_torch(sn: Any, a: dict[str, Any]) -> Any:
    w, u, v = _sn_names(sn)
    layer = _reparam_layer(sn.layer, sn.weight_name, a, a[w])
    return eqx.tree_at(
        lambda s: (s.layer, s.u, s.v),
        sn,
        (layer, _cell_with(sn.u, a[u]), _cell_with(sn.v, _sn_v(sn, a[v]))),
    )


def _sn_aliases(sn: Any) -> dict[str, list[str]]:
    # `torch.nn.utils.spectral_norm` (the older API): weight_orig, weight_u, weight_v
    n = sn.weight_name
    w, u, v = _sn_names(sn)
    return {w: [f"{n}_orig"], u: [f"{n}_u"], v: [f"{n}_v"]}


# eqx.nn.WeightNorm: `g` has PyTorch's shape ([out, 1, ...]) for `axis=0`, which is
# PyTorch's default `dim=0` for every layer but a transposed convolution.
def _wn_applies(m: Any) -> bool:
    return m.axis == 0 and not isinstance(m.layer, eqx.nn.ConvTranspose)


def _wn_to_torch(m: Any) -> dict[str, Any]:
    inner, _ = _module_view(m.layer)
    p = f"parametrizations.{m.weight_name}"
    return _reparam_view(
        m.layer,
        m.weight_name,
        {f"{p}.original0": m.g, f"{p}.original1": inner[m.weight_name]},
    )


def _wn_from_torch(m: Any, a: dict[str, Any]) -> Any:
    p = f"parametrizations.{m.weight_name}"
    layer = _reparam_layer(m.layer, m.weight_name, a, a[f"{p}.original1"])
    return eqx.tree_at(lambda x: (x.layer, x.g), m, (layer, a[f"{p}.original0"]))


def _wn_aliases(m: Any) -> dict[str, list[str]]:
    # `torch.nn.utils.weight_norm` (the older API): weight_g, weight_v
    n, p = m.weight_name, f"parametrizations.{m.weight_name}"
    return {f"{p}.original0": [f"{n}_g"], f"{p}.original1": [f"{n}_v"]}


# es.nn.EMA <-> torch.optim.swa_utils.AveragedModel: `n_averaged` (its own buffer,
# first), then the averaged model as `module.*`, named by the rules of the model
# the EMA was built from. With `zero_debias` PyTorch's `module` is the debiased
# average, and loading multiplies the correction back.
def _ema_correction(ema: Any, count: Any, dtype: Any) -> Any:
    d = jnp.asarray(ema.decay, dtype)
    return 1 - jnp.power(d, count.astype(dtype))


def _ema_to_torch(ema: Any) -> dict[str, Any]:
    count = ema.count[...]
    hidden = [cell[...] for cell in ema.hidden]
    if ema.zero_debias:
        hidden = [
            jnp.where(count > 0, h / jnp.where(count > 0, c, 1), h)
            for h in hidden
            for c in [_ema_correction(ema, count, h.dtype)]
        ]
    module = jax.tree_util.tree_unflatten(ema.treedef, hidden)
    return {"n_averaged": count, "module": module}


def _ema_from_torch(ema: Any, a: dict[str, Any]) -> Any:
    count = a["n_averaged"]
    leaves = jax.tree_util.tree_leaves(a["module"])
    if ema.zero_debias:
        leaves = [
            jnp.where(count > 0, x * _ema_correction(ema, count, x.dtype), x)
            for x in leaves
        ]
    hidden = tuple(_cell_with(c, x) for c, x in zip(ema.hidden, leaves))
    return eqx.tree_at(
        lambda e: (e.hidden, e.count), ema, (hidden, _cell_with(ema.count, count))
    )


for _cls in (eqx.nn.Conv, eqx.nn.Conv1d, eqx.nn.Conv2d, eqx.nn.Conv3d):
    register_torch_names(_cls, _conv_to_torch, _conv_from_torch)
for _cls in (
    eqx.nn.ConvTranspose,
    eqx.nn.ConvTranspose1d,
    eqx.nn.ConvTranspose2d,
    eqx.nn.ConvTranspose3d,
):
    register_torch_names(_cls, _convt_to_torch, _convt_from_torch)
register_torch_names(eqx.nn.PReLU, _prelu_to_torch, _prelu_from_torch)
register_torch_names(
    eqx.nn.MultiheadAttention, _mha_to_torch, _mha_from_torch, applies=_mha_applies
)
register_torch_names(
    eqx.nn.LSTMCell, _lstm_to_torch, _lstm_from_torch, joint=_rnn_joint
)
register_torch_names(eqx.nn.GRUCell, _gru_to_torch, _gru_from_torch, joint=_rnn_joint)
register_torch_names(
    eqx.nn.Sequential,
    lambda m: {str(i): layer for i, layer in enumerate(m.layers)},
    _sequential_from_torch,
)
register_torch_names(
    Batched,
    lambda m: {"": m.layer},
    lambda m, a: eqx.tree_at(lambda b: b.layer, m, a[""]),
)
register_torch_names(SpectralNorm, _sn_to_torch, _sn_from_torch, aliases=_sn_aliases)
register_torch_names(
    eqx.nn.WeightNorm,
    _wn_to_torch,
    _wn_from_torch,
    applies=_wn_applies,
    aliases=_wn_aliases,
)
register_torch_names(EMA, _ema_to_torch, _ema_from_torch)

# Not part of a state dict: Equinox's own state (`eqx.nn.StateIndex`, e.g. in
# `eqx.nn.BatchNorm`, lives outside the model), and recordings (what PyTorch's
# forward hooks would collect, which no state dict holds).
_SKIPPED: tuple[type, ...] = (eqx.nn.StateIndex, RecordState)


def _stop(x: Any) -> bool:
    return is_state(x) or isinstance(x, _SKIPPED) or _converter(x) is not None


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


def _host(x: Any) -> np.ndarray | jax.ShapeDtypeStruct:
    """A copy on the host; for an abstract value, its shape and dtype."""
    if isinstance(x, jax.ShapeDtypeStruct):
        if _is_key_dtype(x.dtype):
            x = _key_data_shape(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    if _is_key_dtype(x.dtype):
        x = jax.random.key_data(x)
    return np.array(x, copy=True)


def _items(tree: Any, prefix: str) -> tuple[list[tuple[str, Any]], Any]:
    """`(name, leaf)` for every leaf of `tree` (flattened with `_stop`)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_stop)
    return [(_path_name(prefix, p), leaf) for p, leaf in flat], treedef


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
            _put(out, name, _host(value))
        elif (conv := _converter(leaf)) is not None:
            _check_module(leaf, name)
            for local, v in _view(leaf, conv).items():
                _export(v, _join(name, local), out)
        elif _is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            _check_live(leaf, name)
            _put(out, name, _host(leaf))


def _put(out: dict[str, Any], name: str, value: Any) -> None:
    if name in out:
        raise StateValueError(
            f"Two parts of the model have the PyTorch name `{name}` (e.g. a dict key "
            "containing a dot, or an `eqx.nn.Sequential` beside a field of the same "
            "name): rename one of the fields so that every name is unique."
        )
    out[name] = value


def _child(node: Any, key: Any) -> Any:
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    if isinstance(key, jax.tree_util.DictKey):
        return node[key.key]
    raise KeyError(key)  # FlattenedIndexKey: no object to follow


def torch_path_name(model: Any, path: Sequence[Any]) -> str:
    """The state-dict name of the part of `model` at `path` (a JAX key path, as
    `jax.tree_util.tree_flatten_with_path` gives it), by the rules of `state_dict`:
    `eqx.nn.Sequential` members are `0`, `1`, ..., a `Batched` wrapper is the layer
    it maps, and every registered conversion names what it holds. A part that a
    conversion does not hold as such (e.g. an array it converts) keeps its field
    names below the conversion."""
    name, node, i = "", model, 0
    while i < len(path):
        conv = _converter(node)
        if conv is not None:
            view = _view(node, conv)
            obj, j, found = node, i, None
            try:
                while j < len(path) and found is None:
                    obj, j = _child(obj, path[j]), j + 1
                    found = next((k for k, v in view.items() if v is obj), None)
            except (KeyError, AttributeError, IndexError, TypeError):
                found = None
            if found is not None:
                name, node, i = _join(name, found), obj, j
                continue
        name = _join(name, _key_name(path[i]))
        try:
            node = _child(node, path[i])
        except (KeyError, AttributeError, IndexError, TypeError):
            node = None
        i += 1
    return name


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

    The arrays are copies: later steps (which donate buffers) do not change them.
    Works in both storage modes. For an **abstract** model (built with
    `eqx.filter_eval_shape`, PyTorch's meta device) the values are
    `jax.ShapeDtypeStruct`s with PyTorch's shapes: the names, without any array.

    **Arguments:**

    - `model`: any model (value or ref mode).

    **Returns:**

    A `dict` from names to NumPy arrays (`jax.ShapeDtypeStruct`s where the model
    is abstract). For PyTorch:
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
    out: dict[str, Any] = {}
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
        want = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
        return _placed(_checked(value, key, want, where), leaf)

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
            is_key = _is_key_dtype(old.dtype)
            want = _key_data_shape(old) if is_key else old
            want = jax.ShapeDtypeStruct(want.shape, want.dtype)
            new = _placed(_checked(value, name, want, _desc(cell)), old)
            if is_key:
                new = jax.random.wrap_key_data(new, impl=_key_impl(old))
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
        return to_refs(new_cell) if ref_mode else new_cell

    def converted(self, name: str, module: Any, conv: _Converter) -> Any:
        _check_module(module, name)
        view = _view(module, conv)
        aliases = conv.aliases(module)
        where = f"{_desc(module)}, in PyTorch's layout"
        used, missing = len(self.used), len(self.missing)
        new: dict[str, Any] = {}
        loaded: dict[str, bool] = {}
        for local, value in view.items():
            full = _join(name, local)
            if _is_array(value) or isinstance(value, jax.ShapeDtypeStruct):
                alts = [_join(name, a) for a in aliases.get(local, ())]
                before = len(self.used)
                new[local] = self.array(full, value, where, alts)
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
        if _is_abstract(module) and len(self.missing) > missing:
            return module  # partly loaded: reported as having no value
        out = conv.from_torch(module, new)
        out = jax.tree_util.tree_map(_placed, out, module, is_leaf=is_state)
        return to_refs(out) if _has_refs(module) else out


def _cells(tree: Any) -> list[Buffer]:
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_state) if is_state(x)]


def _has_refs(tree: Any) -> bool:
    return any(isinstance(c.value, jax.Ref) for c in _cells(tree))


def _fresh_refs(tree: Any) -> Any:
    """`tree` with a new ref (holding the same value) in each ref-mode cell."""

    def one(x: Any) -> Any:
        if is_state(x) and isinstance(x.value, jax.Ref):
            return to_refs(eqx.tree_at(lambda c: c.value, x, x[...]))
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
