"""How each module is named in a PyTorch state dict: one registry of conversions
(`register_torch_names`), which declares every built-in one (convolutions,
attention, LSTM/GRU cells, containers, spectral and weight normalisation, averaged
models) and any user module's, and the naming walk that `state_dict`,
`load_state_dict` and `recorded` share."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._buffer import Buffer, RecordState, is_state
from ._errors import StateTypeError
from ._modes import key_name
from .nn._batched import Batched
from .nn._ema import EMA
from .nn._spectral_norm import SpectralNorm


# --------------------------------------------------------------------------- names


def _join(prefix: str, name: str) -> str:
    if not prefix:
        return name
    if not name:
        return prefix
    return f"{prefix}.{name}"


def _path_name(prefix: str, path: tuple[Any, ...]) -> str:
    name = prefix
    for k in path:
        name = _join(name, key_name(k))
    return name


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


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
    # `(module, local) -> note or None`: what a size mismatch of the local name
    # most likely means (a built-in conversion's hint; not public)
    size_hint: Callable[[Any, str], str | None] = lambda m, local: None


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
        under `eqx.filter_eval_shape` to give the shapes. In a model stacked with
        `eqx.filter_vmap` the module's arrays have leading (stacked) axes: write
        the conversion on the trailing axes (`x[..., :n]`, `axis=-1`) so that it
        holds per member, as the built-in ones do.
    - `from_torch(module, view)` gets a dict with the same keys and the loaded
        values (arrays in PyTorch's layout, loaded cells, loaded sub-trees) and
        returns the module holding them. Keys that a `strict=False` load did not
        provide hold the module's current values, as `to_torch` gave them, so
        `from_torch(m, to_torch(m))` must give `m` back.
    - Shapes and dtypes are checked against `to_torch`'s values before
        `from_torch` sees them, and what `from_torch` returns against the
        module: its type, structure, and each array's shape and dtype (a
        `ValueError` naming the module's path and the leaf); `to_torch` must
        return a dict (or `(name, value)` pairs) with str names (a `TypeError`
        naming the module). An error
        raised inside either direction carries a note naming the module.

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
    if not (callable(to_torch) and callable(from_torch)):
        raise StateTypeError(
            f"register_torch_names({cls.__name__}, to_torch, from_torch): both "
            "directions must be functions, `to_torch(module) -> dict` and "
            "`from_torch(module, dict) -> module`."
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


def _view(module: Any, conv: _Converter, name: str = "") -> dict[str, Any]:
    """`conv.to_torch(module)`; for an abstract module, its shapes (in order).
    `name`: the module's path, for errors. One call of every registered `to_torch`:
    its output is checked (a dict from str names) and an error raised inside it
    names the module, as `from_torch`'s do (`_state_dict.converted`)."""
    abstract = _is_abstract(module)
    at = f", at `{name}`" if name else ""

    def run(m: Any) -> dict[str, Any]:
        try:
            out = conv.to_torch(m)
        except Exception as e:  # a registered conversion's own error: say where
            how = (
                " (the model is abstract: `to_torch` ran under "
                "`eqx.filter_eval_shape`, so it must use `jnp`, not NumPy, on "
                "the module's arrays)"
                if abstract and isinstance(e, jax.errors.TracerArrayConversionError)
                else ""
            )
            e.add_note(f"(in the `to_torch` of {type(m).__name__}{at}{how})")
            raise
        fix = (
            ": it must return a dict from local PyTorch names (str, e.g. "
            '`{"weight": ..., "bias": ...}`) to values, in the order PyTorch '
            "registers them (see `es.register_torch_names`)."
        )
        try:
            view = dict(out)  # (a dict, or what `dict()` takes: (name, value) pairs)
        except (TypeError, ValueError) as e:
            raise StateTypeError(
                f"The `to_torch` registered for {type(m).__name__}{at} returned a "
                f"{type(out).__name__} that is no mapping{fix}"
            ) from e
        if not all(isinstance(k, str) for k in view):
            raise StateTypeError(
                f"The `to_torch` registered for {type(m).__name__}{at} returned a "
                f"name that is not a str{fix}"
            )
        return view

    if not abstract:
        return run(module)
    order: list[list[str]] = []

    def ordered(m: Any) -> dict[str, Any]:
        out = run(m)
        order.append(list(out))
        return out

    shapes = eqx.filter_eval_shape(ordered, module)
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


# Stacked layers. A model built with `eqx.filter_vmap` (an ensemble, or layers
# stacked for `jax.lax.scan`) holds each layer's arrays with extra leading axes, one
# per stacking. Every conversion below works on the trailing axes (the layer's own
# rank, known from its static fields) and keeps the leading ones, so a stacked
# layer's PyTorch arrays are its members' arrays, stacked along the same leading
# axes, in both directions.
def _lead(x: Any, own_ndim: int) -> int:
    """The number of leading (stacked) axes of `x` beyond the layer's own rank."""
    return max(x.ndim - own_ndim, 0)


def _conv_lead(m: Any) -> int:
    return _lead(m.weight, m.num_spatial_dims + 2)


def _bias_view(m: Any) -> dict[str, Any]:
    if m.bias is None:
        return {}
    return {"bias": m.bias.reshape(m.bias.shape[: _conv_lead(m)] + (-1,))}


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
def _spatial(w: Any, n: int) -> tuple[int, ...]:
    return tuple(range(w.ndim - n, w.ndim))


def _convt_to_torch(m: Any) -> dict[str, Any]:
    n, lead = m.num_spatial_dims, _conv_lead(m)
    w = jnp.flip(m.weight, _spatial(m.weight, n))
    stack, g, k = w.shape[:lead], m.groups, w.shape[lead + 2 :]
    out_c, in_g = w.shape[lead], w.shape[lead + 1]
    w = w.reshape(stack + (g, out_c // g, in_g) + k).swapaxes(lead + 1, lead + 2)
    return {"weight": w.reshape(stack + (g * in_g, out_c // g) + k), **_bias_view(m)}


def _convt_from_torch(m: Any, a: dict[str, Any]) -> Any:
    t, n, lead = a["weight"], m.num_spatial_dims, _conv_lead(m)
    stack, g, k = t.shape[:lead], m.groups, t.shape[lead + 2 :]
    in_c, out_g = t.shape[lead], t.shape[lead + 1]
    w = t.reshape(stack + (g, in_c // g, out_g) + k).swapaxes(lead + 1, lead + 2)
    w = w.reshape(stack + (g * out_g, in_c // g) + k)
    w = jnp.flip(w, _spatial(w, n))
    return _with_bias(eqx.tree_at(lambda x: x.weight, m, w), a)


def _prelu_lead(m: Any) -> int:
    """A member's slope has at most one axis longer than 1 (its channels, first:
    `[C, 1, ...]`, or `[C]`), as PyTorch's `[num_parameters]` along the channel
    axis; the axes before the last longer one are stacked axes. (A stacked PReLU
    whose members have one slope each cannot be told from one PReLU with a slope per
    channel: it is read as the latter.)"""
    shape = m.negative_slope.shape
    longer = [i for i, s in enumerate(shape) if s > 1]
    return longer[-1] if len(longer) > 1 else 0


def _prelu_to_torch(m: Any) -> dict[str, Any]:
    w = m.negative_slope
    # PyTorch: [num_parameters] (per member)
    return {"weight": w.reshape(w.shape[: _prelu_lead(m)] + (-1,))}


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
        out["in_proj_weight"] = jnp.concatenate([p.weight for p in projs], axis=-2)
    else:
        for n, p in zip("qkv", projs):
            out[f"{n}_proj_weight"] = p.weight
    if m.use_query_bias:
        out["in_proj_bias"] = jnp.concatenate([p.bias for p in projs], axis=-1)
    out["out_proj.weight"] = m.output_proj.weight
    if m.use_output_bias:
        out["out_proj.bias"] = m.output_proj.bias
    return out


def _mha_from_torch(m: Any, a: dict[str, Any]) -> Any:
    e = m.query_size
    if _mha_packed(m):
        ws = [a["in_proj_weight"][..., i * e : (i + 1) * e, :] for i in range(3)]
    else:
        ws = [a[f"{n}_proj_weight"] for n in "qkv"]
    m = eqx.tree_at(
        lambda x: (x.query_proj.weight, x.key_proj.weight, x.value_proj.weight), m, ws
    )
    if m.use_query_bias:
        bs = [a["in_proj_bias"][..., i * e : (i + 1) * e] for i in range(3)]
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
        zeros = jnp.zeros(m.bias_n.shape[:-1] + (2 * h,), m.bias_n.dtype)
        out["bias_hh"] = jnp.concatenate([zeros, m.bias_n], axis=-1)
    return out


def _gru_from_torch(m: Any, a: dict[str, Any]) -> Any:
    m = eqx.tree_at(
        lambda x: (x.weight_ih, x.weight_hh), m, (a["weight_ih"], a["weight_hh"])
    )
    if m.bias is not None:
        h = m.hidden_size
        b_ih, b_hh = a["bias_ih"], a["bias_hh"]
        bias = jnp.concatenate(
            [b_ih[..., : 2 * h] + b_hh[..., : 2 * h], b_ih[..., 2 * h :]], axis=-1
        )
        m = eqx.tree_at(lambda x: (x.bias, x.bias_n), m, (bias, b_hh[..., 2 * h :]))
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
    w = sn.weight
    k = w.shape[w.ndim - sn.layer.num_spatial_dims :]  # a member's kernel size
    shaped = v.reshape((-1,) + k)  # rows of each member together (stacked too)
    return jnp.flip(shaped, tuple(range(1, shaped.ndim))).reshape(v.shape)


def _sn_names(sn: Any) -> tuple[str, str, str]:
    p = f"parametrizations.{sn.weight_name}"
    return f"{p}.original", f"{p}.0._u", f"{p}.0._v"


def _sn_to_torch(sn: Any) -> dict[str, Any]:
    w, u, v = _sn_names(sn)
    inner, _ = _module_view(sn.layer)
    new = {w: inner[sn.weight_name]}
    if is_state(sn.u):  # not in `es.params(model)` (e.g. an EMA's average)
        new.update({u: sn.u[...], v: _sn_v(sn, sn.v[...])})
    return _reparam_view(sn.layer, sn.weight_name, new)


def _sn_from_torch(sn: Any, a: dict[str, Any]) -> Any:
    w, u, v = _sn_names(sn)
    sn = eqx.tree_at(
        lambda s: s.layer, sn, _reparam_layer(sn.layer, sn.weight_name, a, a[w])
    )
    if not is_state(sn.u):
        return sn
    new = (_cell_with(sn.u, a[u]), _cell_with(sn.v, _sn_v(sn, a[v])))
    return eqx.tree_at(lambda s: (s.u, s.v), sn, new)


def _sn_size_hint(sn: Any, local: str) -> str | None:
    """`u`/`v` of another size: most often `dim` given as PyTorch counts it for a
    transposed convolution (whose weight PyTorch lays out input axis first); ours
    counts the axes of Equinox's layout."""
    if local not in _sn_names(sn)[1:]:
        return None
    return (
        f"(this SpectralNorm has dim={sn.dim}, which counts the axes of "
        "Equinox's weight layout, output axis first for every layer: PyTorch's "
        "dim=1 of a transposed convolution is dim=0 here, its default)"
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


def _per_member(count: Any, x: Any) -> Any:
    """The count (a scalar per member; stacked: the leading axes) shaped to
    broadcast against `x` along the leading axes, not the trailing ones."""
    return count.reshape(count.shape + (1,) * (x.ndim - count.ndim))


def _ema_to_torch(ema: Any) -> dict[str, Any]:
    count = ema.count[...]
    hidden = [cell[...] for cell in ema.hidden]
    if ema.zero_debias:
        hidden = [
            jnp.where(n > 0, h / jnp.where(n > 0, c, 1), h)
            for h in hidden
            for n in [_per_member(count, h)]
            for c in [_ema_correction(ema, n, h.dtype)]
        ]
    module = jax.tree_util.tree_unflatten(ema.treedef, hidden)
    return {"n_averaged": count, "module": module}


def _ema_from_torch(ema: Any, a: dict[str, Any]) -> Any:
    count = a["n_averaged"]
    leaves = jax.tree_util.tree_leaves(a["module"])
    if ema.zero_debias:
        leaves = [
            jnp.where(n > 0, x * _ema_correction(ema, n, x.dtype), x)
            for x in leaves
            for n in [_per_member(count, x)]
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
# (the size hint is not part of the public `register_torch_names`)
_CONVERTERS[SpectralNorm] = _CONVERTERS[SpectralNorm]._replace(size_hint=_sn_size_hint)
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


def _items(tree: Any, prefix: str) -> tuple[list[tuple[str, Any]], Any]:
    """`(name, leaf)` for every leaf of `tree` (flattened with `_stop`)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_stop)
    return [(_path_name(prefix, p), leaf) for p, leaf in flat], treedef


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
        name = _join(name, key_name(path[i]))
        try:
            node = _child(node, path[i])
        except (KeyError, AttributeError, IndexError, TypeError):
            node = None
        i += 1
    return name
