from __future__ import annotations

import math
from typing import Any, Generic, TypeVar

import equinox as eqx
import jax

from .._buffer import _LayerBase
from .._errors import StateTypeError, StateValueError, check_int
from ._complex import refuse_non_array


_Layer = TypeVar("_Layer")


class Batched(_LayerBase, Generic[_Layer]):
    """Map a one-example Equinox layer over the leading batch axis (or axes).

    Equinox's layers take one example (`eqx.nn.Linear` wants `[in_features]`,
    `eqx.nn.Conv2d` wants `[C, H, W]`), while batch statistics need the whole batch
    ([`eqx_state.nn.BatchNorm`][] takes `[N, C, ...]`, like PyTorch). `Batched(layer)`
    is `jax.vmap(layer)` as a layer, so the two mix in one `eqx.nn.Sequential`. The
    wrapped layer is an ordinary field: its parameters are trained
    ([`eqx_state.params`][] sees them, unlike `eqx.nn.Lambda(jax.vmap(layer))`,
    which hides them from every filter), `eqx.nn.inference_mode` reaches it, and
    [`eqx_state.state_dict`][] names it as the layer itself (`fc.weight`, not
    `fc.layer.weight`), as PyTorch does.

    Use it for stateless per-example layers (Linear, Conv, pooling, Dropout,
    LayerNorm, ...). A layer that writes state takes the whole batch instead.

    **Arguments:**

    - `layer`: a callable module taking one example (`layer(x)` or
        `layer(x, key=...)`).
    - `batch_dims`: how many leading axes to map over (default 1: `[N, ...]`; 2 for
        token inputs `[N, T, ...]`).

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, optax
    import eqx_state as es

    k1, k2 = jax.random.split(jax.random.key(0))
    model = eqx.nn.Sequential([
        es.nn.Batched(eqx.nn.Linear(2, 4, key=k1)),
        es.nn.BatchNorm(4),
        eqx.nn.Lambda(jax.nn.relu),
        es.nn.Batched(eqx.nn.Linear(4, 1, key=k2)),
    ])

    def loss_fn(model, x, y):
        return jnp.mean((model(x)[:, 0] - y) ** 2)

    step = es.make_step(loss_fn, optax.adam(1e-2))
    opt_state = step.init(model)
    x = jax.random.normal(jax.random.key(1), (8, 2))
    model, opt_state = step(model, opt_state, x, jnp.zeros(8))
    print(eqx.nn.inference_mode(model)(x).shape)  # (8, 1)
    print(int(model.layers[1].num_batches_tracked[...]))  # 1
    ```
    """

    layer: _Layer
    batch_dims: int = eqx.field(static=True)

    def __init__(self, layer: _Layer, *, batch_dims: int = 1):
        if not callable(layer):
            raise StateTypeError(
                f"Batched wraps a callable layer, got {type(layer).__name__}."
            )
        batch_dims = check_int("Batched", "batch_dims", batch_dims, 1)
        self.layer = layer
        self.batch_dims = batch_dims

    def __call__(self, x: Any, *, key: Any = None) -> Any:
        """Apply the layer to every example of `x`.

        **Arguments:**

        - `x`: an array whose first `batch_dims` axes are batch axes.
        - `key`: an optional PRNG key, split into one key per example (e.g. for
            `eqx.nn.Dropout`); if `None` the layer is called without a key.

        **Returns:**

        The per-example outputs stacked along the same leading axes.
        """
        refuse_non_array(f"Batched({type(self.layer).__name__})", x)
        ndim = x.ndim
        if ndim < self.batch_dims:
            shape = getattr(x, "shape", None)
            raise StateValueError(
                f"Batched({type(self.layer).__name__}) maps over {self.batch_dims} "
                f"leading batch axis/axes, but got an input of shape {shape}. Pass a "
                "batch (e.g. `x[None]` for one example), or call the wrapped layer "
                "directly as `batched.layer(x)`."
            )
        batch = x.shape[: self.batch_dims]
        flat = x.reshape((math.prod(batch),) + x.shape[self.batch_dims :])
        layer: Any = self.layer
        if key is None:
            out = jax.vmap(lambda xi: layer(xi))(flat)
        else:
            keys = jax.random.split(key, flat.shape[0])
            out = jax.vmap(lambda xi, k: layer(xi, key=k))(flat, keys)
        return jax.tree_util.tree_map(lambda o: o.reshape(batch + o.shape[1:]), out)
