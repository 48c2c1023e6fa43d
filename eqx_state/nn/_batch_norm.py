from __future__ import annotations

from collections.abc import Hashable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Inexact

from .._buffer import BatchStat, CounterState


class BatchNorm(eqx.Module):
    r"""Batch normalisation with PyTorch's semantics and state kept in cells.

    On a batch `x` of shape `[N, C, *spatial]` (channel axis 1, configurable) it
    matches `torch.nn.BatchNorm1d/2d/3d`:

    - training (the default): normalise with the batch mean and the **biased** batch
      variance; update `running_mean = (1 - m) * running_mean + m * mean` and
      `running_var = (1 - m) * running_var + m * unbiased_var`, where `m` is
      `momentum`, or `1 / num_batches_tracked` (a cumulative average) when
      `momentum=None`; `num_batches_tracked += 1`.
    - evaluation ([`eqx.nn.inference_mode`](https://docs.kidger.site/equinox/api/nn/inference/)): normalise
      with the running statistics; nothing is written.
    - `track_running_stats=False`: always normalise with batch statistics; no cells.

    Statistics are computed in float32 (or the input dtype if wider).

    **Arguments:**

    - `num_features`: the number of channels `C`.
    - `eps`: added to the variance before the square root.
    - `momentum`: the running-average factor (PyTorch's convention: the weight of
        the *new* batch), or `None` for a cumulative average.
    - `affine`: learn a per-channel `weight` (init 1) and `bias` (init 0).
    - `track_running_stats`: keep `running_mean`, `running_var`,
        `num_batches_tracked` as [`eqx_state.BatchStat`][] /
        [`eqx_state.CounterState`][] cells.
    - `channel_axis`: the axis of `x` holding the channels (default 1, PyTorch's).
    - `axis_name`: a named axis (of `jax.vmap` / `shard_map`) over which the batch
        statistics are averaged, for per-example or per-device calls.
    - `inference`: start in evaluation mode.
    - `dtype`: the dtype of parameters and statistics (default float32).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    bn = es.nn.BatchNorm(3)
    y, bn = es.apply(lambda m, x: m(x), bn, jnp.arange(12.0).reshape(4, 3))
    print(bn.running_mean[...])  # [0.45 0.55 0.65]
    ```
    """

    weight: Float[Array, " channels"] | None
    bias: Float[Array, " channels"] | None
    running_mean: BatchStat | None
    running_var: BatchStat | None
    num_batches_tracked: CounterState | None
    num_features: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    momentum: float | None = eqx.field(static=True)
    channel_axis: int = eqx.field(static=True)
    axis_name: Hashable | None = eqx.field(static=True)
    inference: bool

    def __init__(
        self,
        num_features: int,
        *,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        channel_axis: int = 1,
        axis_name: Hashable | None = None,
        inference: bool = False,
        dtype=None,
    ):
        if num_features <= 0:
            raise ValueError(
                f"BatchNorm: num_features must be positive, got {num_features}."
            )
        if momentum is not None and not 0.0 <= momentum <= 1.0:
            raise ValueError(
                f"BatchNorm: momentum must be in [0, 1] or None, got {momentum}."
            )
        dtype = jnp.float32 if dtype is None else dtype
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.channel_axis = channel_axis
        self.axis_name = axis_name
        self.inference = inference
        if affine:
            self.weight = jnp.ones(num_features, dtype)
            self.bias = jnp.zeros(num_features, dtype)
        else:
            self.weight = self.bias = None
        if track_running_stats:
            self.running_mean = BatchStat(jnp.zeros(num_features, dtype))
            self.running_var = BatchStat(jnp.ones(num_features, dtype))
            self.num_batches_tracked = CounterState(jnp.zeros((), jnp.int32))
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    @property
    def affine(self) -> bool:
        return self.weight is not None

    @property
    def track_running_stats(self) -> bool:
        return self.running_mean is not None

    def _check(self, x: Array) -> int:
        if x.ndim < 1:
            raise ValueError(
                "BatchNorm expects an input with a channel axis, got a scalar."
            )
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            raise TypeError(
                f"BatchNorm expects a floating-point input, got {x.dtype}. Cast it "
                "first, e.g. `bn(x.astype(jnp.float32))`."
            )
        axis = (
            self.channel_axis % x.ndim
            if -x.ndim <= self.channel_axis < x.ndim
            else None
        )
        if axis is None or x.shape[axis] != self.num_features:
            raise ValueError(
                f"BatchNorm({self.num_features}) got an input of shape {x.shape} with "
                f"channel_axis={self.channel_axis}: expected {self.num_features} "
                "channels on that axis. For inputs laid out [N, C, ...] use "
                "channel_axis=1 (PyTorch's layout); for channels-last, channel_axis=-1."
            )
        if x.ndim == 1 and self.axis_name is None and not self.inference:
            raise ValueError(
                f"BatchNorm got a single example of shape {x.shape} in training mode: "
                "batch statistics need a batch. Call it on a batch [N, C, ...], or, "
                "under `jax.vmap(..., axis_name=name)`, build it with "
                "`BatchNorm(..., axis_name=name)`."
            )
        return axis

    def __call__(self, x: Inexact[Array, "..."], *, key=None) -> Inexact[Array, "..."]:
        """Normalise `x`; in training mode also update the running statistics.

        **Arguments:**

        - `x`: an array with `num_features` channels on `channel_axis`.
        - `key`: ignored; accepted for compatibility with `eqx.nn.Sequential`.

        **Returns:**

        An array of the same shape and dtype as `x`.
        """
        del key
        axis = self._check(x)
        red = tuple(i for i in range(x.ndim) if i != axis)
        shape = [1] * x.ndim
        shape[axis] = self.num_features
        cdtype = x.dtype if jnp.finfo(x.dtype).bits >= 32 else jnp.dtype(jnp.float32)
        xc = x.astype(cdtype)
        use_batch = not self.inference or not self.track_running_stats
        if use_batch:
            mean = jnp.mean(xc, axis=red)
            var = jnp.mean(jnp.square(xc - mean.reshape(shape)), axis=red)
            n = 1
            for i in red:
                n *= x.shape[i]
            if n == 1 and self.axis_name is None and not self.inference:
                raise ValueError(
                    f"BatchNorm got one value per channel (input shape {x.shape}) in "
                    "training mode: the batch variance is 0, so the running variance "
                    "would shrink towards 0 (PyTorch raises here too). Train with "
                    "batches of more than one example, or evaluate with "
                    "`eqx.nn.inference_mode(model)`."
                )
            if self.axis_name is not None:
                # E[x] and E[x^2] over the named axis, then the variance from them.
                mean_sq = jnp.mean(jnp.square(xc), axis=red)
                mean = jax.lax.pmean(mean, self.axis_name)
                mean_sq = jax.lax.pmean(mean_sq, self.axis_name)
                var = jnp.maximum(mean_sq - jnp.square(mean), 0.0)
                n = n * jax.lax.psum(1, self.axis_name)
            if not self.inference and self.track_running_stats:
                self._update(mean, var, n)
        else:
            assert self.running_mean is not None and self.running_var is not None
            mean = self.running_mean[...].astype(cdtype)
            var = self.running_var[...].astype(cdtype)
        y = (xc - mean.reshape(shape)) * jax.lax.rsqrt(var.reshape(shape) + self.eps)
        if self.weight is not None and self.bias is not None:
            y = y * self.weight.astype(cdtype).reshape(shape) + self.bias.astype(
                cdtype
            ).reshape(shape)
        return y.astype(x.dtype)

    def _update(self, mean: Array, var: Array, n) -> None:
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        count = self.num_batches_tracked[...] + 1
        self.num_batches_tracked[...] = count
        if self.momentum is None:
            m = 1.0 / count.astype(mean.dtype)
        else:
            m = jnp.asarray(self.momentum, mean.dtype)
        unbiased = var * (n / jnp.maximum(n - 1, 1))
        rm, rv = self.running_mean, self.running_var
        rm[...] = ((1 - m) * rm[...] + m * mean).astype(rm.dtype)
        rv[...] = ((1 - m) * rv[...] + m * unbiased).astype(rv.dtype)
