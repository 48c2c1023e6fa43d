from __future__ import annotations

import functools
from typing import Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._buffer import PowerIterationState, _LayerBase
from .._errors import (
    StateTypeError,
    StateValueError,
    check_bool,
    check_int,
    check_real,
)
from ._complex import refuse_non_array
from ._flag import inference_flag
from ._rng import as_key


_Layer = TypeVar("_Layer")

_INIT_ITERATIONS = 15  # PyTorch's warm start of u, v at construction


def _normalize(x: Array, eps: float) -> Array:
    # torch.nn.functional.normalize: x / max(||x||, eps)
    return x / jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(x))), eps)


def _power_method(
    mat: Array, u: Array, v: Array, n: int, eps: float, v_first: bool = False
):
    for _ in range(n):
        if v_first:  # torch.nn.utils.spectral_norm (the older API)
            v = _normalize(mat.T @ u, eps)
            u = _normalize(mat @ v, eps)
        else:  # torch.nn.utils.parametrizations.spectral_norm
            u = _normalize(mat @ v, eps)
            v = _normalize(mat.T @ u, eps)
    return u, v


@functools.partial(jax.jit, static_argnums=(2,))
def _initial_uv(mat: Array, key: PRNGKeyArray, eps: float) -> tuple[Array, Array]:
    # jitted: one compiled call at construction instead of ~40 eager dispatches
    ku, kv = jax.random.split(key)
    u = _normalize(jax.random.normal(ku, mat.shape[:1], mat.dtype), eps)
    v = _normalize(jax.random.normal(kv, mat.shape[1:], mat.dtype), eps)
    return _power_method(mat, u, v, _INIT_ITERATIONS, eps)


class SpectralNorm(_LayerBase, Generic[_Layer]):
    r"""Spectral normalisation of a layer's weight, with the power-iteration vectors
    kept as state.

    The wrapped layer runs with its weight $W$ replaced by $W / \sigma$, where
    $\sigma = u^\top W_{\text{mat}} v$ estimates the largest singular value of
    $W_{\text{mat}}$ (the weight with axis `dim` moved to the front and the other
    axes flattened, `(out, -1)` for a convolution). It matches
    `torch.nn.utils.parametrizations.spectral_norm`:

    - training (the default): each call first runs `n_power_iterations` steps of
        $u \leftarrow \mathrm{normalize}(W_{\text{mat}} v)$,
        $v \leftarrow \mathrm{normalize}(W_{\text{mat}}^\top u)$ (with
        `normalize(x) = x / max(|x|, eps)`) and writes $u, v$ to their
        [`eqx_state.BatchStat`][] cells;
    - evaluation ([`eqx.nn.inference_mode`](https://docs.kidger.site/equinox/api/nn/inference/)): uses the
        stored $u, v$; nothing is written.

    Gradients flow into $W$ through both $W$ and $\sigma$, with $u, v$ held
    constant, as in PyTorch. At construction $u, v$ are drawn from a normal
    distribution, normalised, and refined by 15 power iterations (PyTorch's warm
    start).

    **Batches: one rule for every layer.** The wrapped layer takes one example of
    rank `input_ndim` (Equinox's convention). A call on an input with more axes
    maps the layer over the extra leading (batch) axes and runs the power
    iteration once for the whole batch, like one PyTorch forward; an input of rank
    `input_ndim` is one example. `input_ndim` is read from Equinox's `Linear` (1, or
    0 for `in_features="scalar"`) and convolutions (`num_spatial_dims + 1`); any
    other layer needs it given (a constructor error says so), so that a batch is
    never silently passed to a layer written for one example. Per-example code
    works too through [`eqx_state.vmap`][] (`es.vmap(model)(x)`): every example
    computes the same $u, v$, which are written once. (A plain `jax.vmap` in
    training mode cannot write state at all; it raises
    [`eqx_state.StateWriteError`][].)

    **Arguments:**

    - `layer`: the layer to wrap, usually an `eqx.nn.Linear` or a convolution.
    - `weight_name`: the name of the layer's weight field.
    - `n_power_iterations`: power-iteration steps per training call.
    - `eps`: the floor of the norms in `normalize`.
    - `dim`: the axis of the weight that indexes the outputs. Equinox keeps the
        output axis first for every layer (`ConvTranspose` included), so the
        default 0 is PyTorch's default for each of them. For a grouped
        `ConvTranspose` (`groups > 1`) the default builds PyTorch's matrix,
        `(out / groups, in * prod(kernel))`: PyTorch's weight is laid out
        `[in, out / groups, *kernel]` and normalised along its axis 1.
    - `input_ndim`: the rank of one input of `layer`; see above. Needed for layers
        other than `eqx.nn.Linear` / `Conv` / `ConvTranspose`.
    - `v_first`: update $v$ before $u$ in each power-iteration step, as the older
        `torch.nn.utils.spectral_norm` does (the newer
        `torch.nn.utils.parametrizations.spectral_norm`, the default here, updates
        $u$ first). Only training differs: set it when continuing to train a model
        ported from the older API.
    - `inference`: start in evaluation mode.
    - `key`: a `jax.random.key` for the initial $u, v$ (random, so the cells have
        no reset fill: `es.reset` leaves them alone).

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    import eqx_state as es

    k1, k2 = jax.random.split(jax.random.key(0))
    sn = es.nn.SpectralNorm(eqx.nn.Linear(3, 4, key=k1), key=k2)
    y, sn = es.apply(lambda m, x: m(x), sn, jnp.ones((8, 3)))  # one iteration
    print(y.shape)  # (8, 4)
    sigma = sn.sigma  # the estimated largest singular value of the weight
    ```
    """

    layer: _Layer
    u: PowerIterationState
    v: PowerIterationState
    weight_name: str = eqx.field(static=True)
    input_ndim: int = eqx.field(static=True)
    n_power_iterations: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    dim: int = eqx.field(static=True)
    transpose_groups: int = eqx.field(static=True)
    v_first: bool = eqx.field(static=True)
    inference: bool

    def __init__(
        self,
        layer: _Layer,
        weight_name: str = "weight",
        *,
        n_power_iterations: int = 1,
        eps: float = 1e-12,
        dim: int = 0,
        input_ndim: int | None = None,
        v_first: bool = False,
        inference: bool = False,
        key: PRNGKeyArray,
    ):
        n_power_iterations = check_int(
            "SpectralNorm", "n_power_iterations", n_power_iterations, 1
        )
        eps = check_real("SpectralNorm", "eps", eps)
        dim = check_int("SpectralNorm", "dim", dim)
        if input_ndim is not None:
            input_ndim = check_int("SpectralNorm", "input_ndim", input_ndim, 0)
        if not isinstance(weight_name, str):
            raise StateTypeError(
                f"SpectralNorm: weight_name must be the name of the layer's weight "
                f"field (a str, e.g. 'weight'), got {weight_name!r}."
            )
        v_first = check_bool("SpectralNorm", "v_first", v_first)
        inference = check_bool("SpectralNorm", "inference", inference)
        key = as_key(key, "SpectralNorm(key=...)")
        weight = getattr(layer, weight_name, None)
        if weight is None or not eqx.is_inexact_array(weight):
            raise StateValueError(
                f"SpectralNorm: the layer {type(layer).__name__} has no floating-point "
                f"array field {weight_name!r} to normalise. Pass the name of its "
                "weight with `weight_name=...`."
            )
        if weight.ndim < 2:
            raise StateValueError(
                f"SpectralNorm: the weight {weight_name!r} has shape {weight.shape}; "
                "spectral normalisation needs a matrix or higher-rank weight."
            )
        if not -weight.ndim <= dim < weight.ndim:
            raise StateValueError(
                f"SpectralNorm: dim={dim} is out of range for a weight of shape "
                f"{weight.shape}."
            )
        if input_ndim is None:
            input_ndim = _known_input_ndim(layer)
            if input_ndim is None:
                raise StateValueError(
                    f"SpectralNorm cannot tell the rank of one input of "
                    f"{type(layer).__name__}: pass `input_ndim=` (e.g. 1 for a layer "
                    "that takes a vector, 3 for one that takes [C, H, W]). A call on an "
                    "input with more axes maps the layer over the extra leading "
                    "(batch) axes; an input of that rank is one example."
                )
        self.input_ndim = int(input_ndim)
        self.layer = layer
        self.weight_name = weight_name
        self.n_power_iterations = n_power_iterations
        if not (0 < eps < float("inf")):
            # a vector's norm is divided by max(norm, eps): eps <= 0 divides a zero
            # vector by 0, an infinite eps zeroes every vector
            raise StateValueError(
                f"SpectralNorm: eps must be positive and finite, got {eps}."
            )
        self.eps = eps
        self.dim = dim % weight.ndim
        grouped = isinstance(layer, eqx.nn.ConvTranspose) and self.dim == 0
        self.transpose_groups = int(getattr(layer, "groups", 1)) if grouped else 1
        self.v_first = bool(v_first)
        self.inference = inference
        u, v = _initial_uv(self._matrix(weight), key, eps)
        self.u = PowerIterationState(u)
        self.v = PowerIterationState(v)

    def _matrix(self, weight: Array) -> Array:
        g = self.transpose_groups
        if g > 1:
            # PyTorch keeps a grouped ConvTranspose's weight as [in, out/g, *k] and
            # normalises it along dim 1: W_mat is (out/g, in * k), the groups side
            # by side. Equinox's [out, in/g, *k] holds the same numbers by group.
            out, in_g = weight.shape[:2]
            w = weight.reshape(g, out // g, in_g, *weight.shape[2:])
            return jnp.moveaxis(w, 1, 0).reshape(out // g, -1)
        w = jnp.moveaxis(weight, self.dim, 0)
        return w.reshape(w.shape[0], -1)

    @property
    def weight(self) -> Array:
        """The layer's raw (unnormalised) weight."""
        return getattr(self.layer, self.weight_name)

    @property
    def sigma(self) -> Float[Array, ""]:  # noqa: F722
        """The current estimate $u^\\top W_{\\text{mat}} v$ of the largest singular
        value, from the stored $u, v$."""
        return jnp.dot(self.u[...], self._matrix(self.weight) @ self.v[...])

    def _check_input(self, x: Array) -> None:
        """The shape check: the rank rule for every layer, with the expected
        feature size named for Equinox's Linear and convolutions."""
        layer: Any = self.layer
        name = type(layer).__name__
        refuse_non_array(f"SpectralNorm({name})", x)
        if isinstance(layer, eqx.nn.Linear) and layer.in_features != "scalar":
            if x.ndim < 1 or x.shape[-1] != layer.in_features:
                raise StateValueError(
                    f"SpectralNorm({name}({layer.in_features}, ...)) got an input of "
                    f"shape {x.shape}: expected [..., {layer.in_features}] (one "
                    "example, or any leading batch axes)."
                )
        elif isinstance(layer, (eqx.nn.Conv, eqx.nn.ConvTranspose)):
            event = self.input_ndim
            if x.ndim < event or x.shape[-event] != layer.in_channels:
                spatial = ", ".join(["..."] * layer.num_spatial_dims)
                raise StateValueError(
                    f"SpectralNorm({name} with {layer.in_channels} input channels) got "
                    f"an input of shape {x.shape}: expected [{layer.in_channels}, "
                    f"{spatial}] for one example, or [N, {layer.in_channels}, "
                    f"{spatial}] for a batch (channels first, as Equinox convolutions "
                    "take them)."
                )
        elif x.ndim < self.input_ndim:
            raise StateValueError(
                f"SpectralNorm({name}, input_ndim={self.input_ndim}) got an input of "
                f"shape {x.shape}: one example has {self.input_ndim} axes, and any "
                "extra leading axes are batch axes."
            )

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        """Run the layer with its weight divided by the spectral-norm estimate; in
        training mode first advance the power iteration and store $u, v$.

        **Arguments:**

        - `x`: the layer's input: one example (rank `input_ndim`), or a batch of
            them with extra leading axes.
        - `key`: passed to the layer.

        **Returns:**

        The layer's output (with the same leading batch axes).
        """
        self._check_input(x)
        event_ndim = self.input_ndim
        weight = self.weight
        mat = self._matrix(weight)
        u, v = self.u[...], self.v[...]
        if not inference_flag(self):
            u, v = _power_method(
                jax.lax.stop_gradient(mat),
                u,
                v,
                self.n_power_iterations,
                self.eps,
                self.v_first,
            )
            self.u[...] = u
            self.v[...] = v
        u, v = jax.lax.stop_gradient(u), jax.lax.stop_gradient(v)
        sigma = jnp.dot(u, mat @ v)
        layer = eqx.tree_at(
            lambda m: getattr(m, self.weight_name), self.layer, weight / sigma
        )

        def run(xi: Array) -> Array:
            return layer(xi) if key is None else layer(xi, key=key)  # type: ignore[operator]

        if x.ndim == event_ndim:
            return run(x)
        batch = x.shape[: x.ndim - event_ndim]
        flat = x.reshape((-1,) + x.shape[x.ndim - event_ndim :])
        out = jax.vmap(run)(flat)
        return out.reshape(batch + out.shape[1:])


def _known_input_ndim(layer: Any) -> int | None:
    """The rank of one input of Equinox's layers whose input rank is fixed by their
    configuration; `None` for any other layer."""
    if isinstance(layer, eqx.nn.Linear):
        return 0 if layer.in_features == "scalar" else 1
    if isinstance(layer, (eqx.nn.Conv, eqx.nn.ConvTranspose)):
        return layer.num_spatial_dims + 1
    return None
