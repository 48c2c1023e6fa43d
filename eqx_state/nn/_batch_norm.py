from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Inexact

from .._buffer import (
    BatchStat,
    Buffer,
    _LayerBase,
    check_cell_dtype,
    check_live,
)
from .._errors import (
    StateTypeError,
    StateValueError,
    check_axis_name,
    check_bool,
    check_dtype,
    check_int,
    check_real,
)
from .._modes import check_cell_fields
from ._axis import axis_size
from ._complex import refuse_complex, refuse_non_array
from ._counter import saturating_add
from ._flag import inference_flag


class _Options(NamedTuple):
    """A BatchNorm's static options (one static field: see `BatchNorm._options`)."""

    num_features: int
    eps: float
    momentum: float | None
    channel_axis: int
    axis_name: Hashable | None
    zero_debias: bool
    unbiased_running_var: bool


class BatchNorm(_LayerBase):
    r"""Batch normalisation with PyTorch's semantics and state kept in cells.

    On a batch `x` of shape `[N, C, *spatial]` (channel axis 1, configurable) it
    matches `torch.nn.BatchNorm1d/2d/3d`:

    - training (the default): normalise with the batch mean and the **biased** batch
      variance; update `running_mean = (1 - m) * running_mean + m * mean` and
      `running_var = (1 - m) * running_var + m * unbiased_var`, where `m` is
      `momentum`, or `1 / num_batches_tracked` (a cumulative average) when
      `momentum=None`; `num_batches_tracked += 1` (an int32, saturating at
      $2^{31} - 1$ instead of wrapping: PyTorch's int64 count goes on, so past
      that `momentum=None` weighs a batch $1 / (2^{31} - 1)$ where PyTorch weighs
      it $1 / 2^{31}$ or less). Compiled (a step, [`eqx_state.make_apply`][], any
      `jax.jit`), XLA computes each update as a fused multiply-add, rounding once
      where PyTorch rounds each product: the statistics can differ from PyTorch's
      in the last bit at each update. The fused form is the more accurate one:
      with `momentum=None` resumed from a large count ($3 \cdot 10^7$) on
      stationary data, PyTorch's running mean falls by about an ulp per batch
      while this one stays at the exact average.
    - evaluation ([`eqx.nn.inference_mode`](https://docs.kidger.site/equinox/api/nn/inference/)): normalise
      with the running statistics; nothing is written.
    - `track_running_stats=False`: always normalise with batch statistics (also in
      evaluation, as PyTorch); no cells.

    The variance is computed in two passes (the mean first, then the mean of the
    squared deviations from it), also when it is reduced over `axis_name`, so data
    far from zero (an offset of $10^4$ on unit-variance data) is normalised to
    float32 round-off. Statistics are computed in float32 (or the input dtype if
    wider). Complex input is refused, as in PyTorch: normalise the real and
    imaginary parts (e.g. stacked as channels) instead.

    **Other conventions.** Flax, Haiku and Equinox keep the *biased* batch variance
    in the running average (`unbiased_running_var=False`), and Haiku and Equinox's
    `BatchNorm(mode="batch")` divide the running statistics by $1 - (1 - m)^t$ at
    inference, $t$ = `num_batches_tracked` (`zero_debias=True`). So
    `eqx.nn.BatchNorm(C, axis_name, momentum=0.99, mode="batch")` is exactly
    `BatchNorm(C, momentum=0.01, zero_debias=True, unbiased_running_var=False,
    channel_axis=0, axis_name=axis_name)` (called per example under
    [`eqx_state.vmap`][]), or the same without `axis_name` and with
    `channel_axis=1` on the whole batch. Equinox's `mode="ema"` (which normalises
    training batches with the running average) has no counterpart.

    **Padding.** `bn(x, mask=m)` computes the batch statistics from the entries
    where `m` is `True` only (Flax's `mask`): padded examples contribute nothing,
    and the statistics equal those of the unpadded batch. Every entry of `x` is
    normalised with them; no gradient flows to or through padded entries, so
    padding may be left unset (NaN, inf). A channel with no unmasked entry has no batch
    statistics: its output is NaN, as Flax's (mask the loss with `jnp.where`, not
    by multiplying, so the NaN of padding stays out of it; gradients through the
    channel are zero, not NaN), and it keeps its running statistics
    (`num_batches_tracked` still counts the call), as PyTorch does on an empty
    batch (Flax writes NaN into them). One with a single unmasked entry updates its
    running mean and keeps its running variance (the unbiased variance of one value
    is undefined; with `unbiased_running_var=False` the biased variance 0 is folded
    in, as Flax does); its output is normalised with batch variance 0, i.e.
    `(x - x0) / sqrt(eps)` (large: the mask's count is traced, so it is not
    refused as the unmasked case is; mask such a batch out of the loss, or give
    every channel two or more entries). Unmasked, a batch of one value per channel is refused
    wherever batch statistics are used, as in PyTorch: in training, and in
    evaluation with `track_running_stats=False`.

    **Arguments:**

    - `num_features`: the number of channels `C`.
    - `eps`: added to the variance before the square root.
    - `momentum`: the running-average factor (PyTorch's convention: the weight of
        the *new* batch), or `None` for a cumulative average.
    - `affine`: learn a per-channel `weight` (init 1) and `bias` (init 0).
    - `track_running_stats`: keep `running_mean` (init 0), `running_var` (init 1)
        and `num_batches_tracked` (init 0) as [`eqx_state.BatchStat`][] cells, so
        that `es.reset(model, es.BatchStat)` is PyTorch's `reset_running_stats()`
        (for a recalibration, e.g. with `momentum=None`).
    - `channel_axis`: the axis of `x` holding the channels (default 1, PyTorch's).
    - `axis_name`: a named axis (of [`eqx_state.vmap`][], `jax.shard_map` or
        `jax.pmap`) over which the batch statistics are reduced, for per-example or
        per-device calls. Not for `make_step(..., mesh=...)`, which already
        computes them over the global batch: there a bound-less `axis_name` raises
        a `NameError` saying to drop it.
    - `zero_debias`: at inference, divide the running statistics by
        $1 - (1 - m)^t$ (Haiku's and Equinox's zero-debiasing). Needs a `momentum`.
    - `unbiased_running_var`: keep the unbiased batch variance in `running_var`
        (PyTorch, the default), or the biased one (Flax, Haiku, Equinox).
    - `inference`: start in evaluation mode.
    - `dtype`: the dtype of `weight` and `bias` (default float32). The running
        statistics are kept in `dtype` promoted to at least float32: in bfloat16 a
        running average stalls once its updates fall below half an ulp.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    bn = es.nn.BatchNorm(3)
    y, bn = es.apply(lambda m, x: m(x), bn, jnp.arange(12.0).reshape(4, 3))
    print(bn.running_mean[...].round(4))  # [0.45 0.55 0.65]
    ```
    """

    weight: Float[Array, " channels"] | None
    bias: Float[Array, " channels"] | None
    running_mean: BatchStat | None
    running_var: BatchStat | None
    num_batches_tracked: BatchStat | None
    inference: bool
    # The static options, in one field: every call rebuilds the model (and the
    # optimizer state's copies of its structure) node by node, and Equinox sets
    # each field of a node one at a time. Read them as `bn.eps`, ... (below).
    _options: _Options = eqx.field(static=True)

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
        zero_debias: bool = False,
        unbiased_running_var: bool = True,
        inference: bool = False,
        dtype=None,
    ):
        num_features = check_int(
            "BatchNorm",
            "num_features (the number of channels)",
            num_features,
            1,
            hint="E.g. `BatchNorm(x.shape[1])` for inputs laid out [N, C, ...].",
        )
        channel_axis = check_int(
            "BatchNorm",
            "channel_axis",
            channel_axis,
            hint="1 for inputs laid out [N, C, ...], -1 for channels-last.",
        )
        eps = check_real("BatchNorm", "eps", eps)
        affine = check_bool("BatchNorm", "affine", affine)
        track_running_stats = check_bool(
            "BatchNorm", "track_running_stats", track_running_stats
        )
        zero_debias = check_bool("BatchNorm", "zero_debias", zero_debias)
        unbiased_running_var = check_bool(
            "BatchNorm", "unbiased_running_var", unbiased_running_var
        )
        inference = check_bool("BatchNorm", "inference", inference)
        if momentum is not None:
            momentum = check_real("BatchNorm", "momentum", momentum)
        if not 0 <= eps < math.inf:
            raise StateValueError(
                f"BatchNorm: eps must be non-negative and finite, got {eps!r}: it is added to "
                "the variance before the square root (PyTorch's default, 1e-5, keeps "
                "a constant channel finite)."
            )
        if momentum is not None and not 0.0 <= momentum <= 1.0:
            raise StateValueError(
                f"BatchNorm: momentum must be in [0, 1] or None, got {momentum}."
            )
        if zero_debias and momentum is None:
            raise StateValueError(
                "BatchNorm: zero_debias=True needs a momentum: it divides the running "
                "statistics by 1 - (1 - momentum)**t, and momentum=None (a "
                "cumulative average) has nothing to correct. Drop one of them."
            )
        dtype = (
            jnp.float32 if dtype is None else check_dtype("BatchNorm", "dtype", dtype)
        )
        if not jnp.issubdtype(dtype, jnp.floating):
            raise StateValueError(
                f"BatchNorm: dtype must be a real floating dtype, got {dtype}."
            )
        self._options = _Options(
            num_features=num_features,
            eps=float(eps),
            momentum=None if momentum is None else float(momentum),
            channel_axis=int(channel_axis),
            axis_name=check_axis_name("BatchNorm", axis_name),
            zero_debias=zero_debias,
            unbiased_running_var=unbiased_running_var,
        )
        self.inference = inference
        if affine:
            self.weight = jnp.ones(num_features, dtype)
            self.bias = jnp.zeros(num_features, dtype)
        else:
            self.weight = self.bias = None
        if track_running_stats:
            # Narrow dtypes (bfloat16, float16) would lose every update below half
            # an ulp of the running average: the statistics are kept in float32
            # (as Flax keeps its batch statistics), as EMA keeps its average.
            sdtype = jnp.promote_types(dtype, jnp.float32)
            self.running_mean = BatchStat(jnp.zeros(num_features, sdtype), init=0)
            self.running_var = BatchStat(jnp.ones(num_features, sdtype), init=1)
            self.num_batches_tracked = BatchStat(jnp.zeros((), jnp.int32), init=0)
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    def __setattr__(self, name: str, value: Any) -> None:
        # An option set by a subclass's `__init__` after `super().__init__()`, as
        # when the options were fields: it goes into `_options` (which Equinox lets
        # `__init__` set, and freezes afterwards, as it froze the fields).
        if name in _Options._fields and "_options" in self.__dict__:
            options = self._options._replace(**{name: value})
            try:
                super().__setattr__("_options", options)
            except dataclasses.FrozenInstanceError:  # named as the user wrote it
                raise dataclasses.FrozenInstanceError(
                    f"cannot assign to field {name!r}"
                ) from None
            return
        super().__setattr__(name, value)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A BatchNorm pickled before its options were one field held them as
        # seven fields: packed here, so it loads and runs as it did.
        if "_options" not in state and all(k in state for k in _Options._fields):
            state = dict(state)
            state["_options"] = _Options(*(state.pop(k) for k in _Options._fields))
        for name, value in state.items():
            object.__setattr__(self, name, value)

    @property
    def num_features(self) -> int:
        return self._options.num_features

    @property
    def eps(self) -> float:
        return self._options.eps

    @property
    def momentum(self) -> float | None:
        return self._options.momentum

    @property
    def channel_axis(self) -> int:
        return self._options.channel_axis

    @property
    def axis_name(self) -> Hashable | None:
        return self._options.axis_name

    @property
    def zero_debias(self) -> bool:
        return self._options.zero_debias

    @property
    def unbiased_running_var(self) -> bool:
        return self._options.unbiased_running_var

    @property
    def affine(self) -> bool:
        return self.weight is not None

    @property
    def track_running_stats(self) -> bool:
        return self.running_mean is not None

    def _check(self, x: Array) -> int:
        # how errors name the layer (inside a step or an apply `named_cells` adds
        # its path: `In `model.blocks[1].bn` (BatchNorm): BatchNorm(4) got ...`)
        where = f"BatchNorm({self.num_features})"
        refuse_non_array(where, x)
        for name in ("weight", "bias"):  # as a cell read checks its array
            check_live(getattr(self, name), f"{where} `{name}`")
        stats = ("running_mean", "running_var", "num_batches_tracked")
        gone = [name for name in stats if getattr(self, name) is None]
        if 0 < len(gone) < len(stats):
            kept = ", ".join(f"`{n}`" for n in stats if n not in gone)
            raise StateTypeError(
                f"{where} has {', '.join(f'`{n}`' for n in gone)} set to None but "
                f"still holds {kept}: its running statistics are kept all together "
                "(track_running_stats=True) or not at all (False). PyTorch refuses "
                "one of running_mean and running_var being None (and with "
                "num_batches_tracked None and momentum=None it never updates them). "
                "To normalise with batch statistics only, build it with "
                "`BatchNorm(..., track_running_stats=False)` (or set all three to "
                "None); otherwise put the cells back."
            )
        if x.ndim < 1:
            raise StateValueError(
                f"{where} expects an input with a channel axis, got a scalar."
            )
        refuse_complex(
            where,
            x.dtype,
            "as in torch.nn.BatchNorm, the variance of complex data has more than "
            "one definition",
            "Normalise the real and imaginary parts, e.g. "
            "`bn(jnp.concatenate([x.real, x.imag], axis=channel_axis))` with twice "
            "the channels.",
        )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise StateTypeError(
                f"{where} expects a floating-point input, got {x.dtype}. Cast it "
                "first, e.g. `bn(x.astype(jnp.float32))`."
            )
        # One example [C] (a per-example call, e.g. under `jax.vmap`): said before
        # the channel axis is checked, which a 1-d input has only as axis 0.
        if (
            x.ndim == 1
            and x.shape[0] == self.num_features
            and self.axis_name is None
            and self._uses_batch_stats()
        ):
            raise StateValueError(
                f"{where} got a single example of shape {x.shape} "
                f"{self._why()}: "
                "batch statistics need a batch. Call it on a batch [N, C, ...], or, "
                "per example under `eqx_state.vmap(model, axis_name=name)`, build it "
                "with `BatchNorm(..., channel_axis=0, axis_name=name)`."
            )
        if not -x.ndim <= self.channel_axis < x.ndim:
            raise StateValueError(
                f"BatchNorm({self.num_features}, channel_axis={self.channel_axis})"
                f" got an input of shape {x.shape}, which has no axis "
                f"{self.channel_axis}. Inputs are laid out [N, C, ...] with "
                "channel_axis=1 (PyTorch's layout), or channels-last with "
                "channel_axis=-1; one example [C] (per-example code) needs "
                "channel_axis=0."
            )
        axis = self.channel_axis % x.ndim
        if x.shape[axis] != self.num_features:
            raise StateValueError(
                f"{where} got an input of shape {x.shape} with "
                f"channel_axis={self.channel_axis}: expected {self.num_features} "
                f"channels on that axis, found {x.shape[axis]}. For inputs laid out "
                "[N, C, ...] use channel_axis=1 (PyTorch's layout); for "
                "channels-last, channel_axis=-1."
            )
        for name in ("weight", "bias", "running_mean", "running_var"):
            held = getattr(self, name)
            if name.startswith("running") and not isinstance(
                held, Buffer | jax.Array | None
            ):
                check_cell_fields(self, root="BatchNorm")  # not a cell: say so
            if held is not None and tuple(held.shape) != (self.num_features,):
                raise StateValueError(
                    f"{where}: its `{name}` "
                    f"has shape {tuple(held.shape)}, not ({self.num_features},): a "
                    "value of another shape was put there (e.g. by `eqx.tree_at`, or "
                    "from another model's checkpoint). Put one of shape "
                    f"({self.num_features},) there, or build the layer with "
                    f"BatchNorm({held.shape[0] if held.shape else '...'})."
                )
        return axis

    def _uses_batch_stats(self) -> bool:
        """Whether this call normalises with batch statistics (PyTorch's
        `bn_training`): in training, and always without running statistics."""
        return not inference_flag(self) or not self.track_running_stats

    def _why(self) -> str:
        if inference_flag(self):
            return (
                "in evaluation mode without running statistics "
                "(track_running_stats=False normalises with batch statistics in "
                "both modes)"
            )
        return "in training mode"

    def _mask(self, mask: ArrayLike, x: Array) -> Array:
        m = jnp.asarray(mask)
        if m.dtype != jnp.bool_:
            raise StateTypeError(
                f"BatchNorm({self.num_features}): mask must be "
                "boolean (True where an entry counts), got "
                f"{m.dtype}. E.g. `mask=lengths[:, None] > jnp.arange(T)`."
            )
        try:
            return jnp.broadcast_to(m, x.shape)
        except ValueError:
            raise StateValueError(
                f"BatchNorm({self.num_features}): a mask of shape "
                f"{m.shape} does not broadcast to the input "
                f"shape {x.shape}. Give one entry per example (shape [N] + [1] * "
                f"{x.ndim - 1}, e.g. `mask[:, None]` for [N, C]), or the input's shape."
            ) from None

    def _batch_stats(
        self, xc: Array, red: tuple[int, ...], shape: list[int], mask: Array | None
    ) -> tuple[Array, Array, Array | int]:
        """Batch mean, biased variance and count per channel (two passes)."""
        if mask is None:
            n: Array | int = math.prod(xc.shape[i] for i in red)
            total = jnp.sum(xc, axis=red)
        else:
            n = jnp.sum(mask, axis=red, dtype=jnp.int32)
            total = jnp.sum(jnp.where(mask, xc, 0), axis=red)
        if self.axis_name is not None:
            size = axis_size(self.axis_name, "BatchNorm")
            total = jax.lax.psum(total, self.axis_name)
            n = n * size if mask is None else jax.lax.psum(n, self.axis_name)
        if isinstance(n, int):  # no mask: the count is known while tracing
            nf: Array | np.ndarray = np.asarray(max(n, 1), xc.dtype)
        else:
            nf = jnp.maximum(jnp.asarray(n, xc.dtype), 1)
        mean = total / nf
        dev = xc - mean.reshape(shape)
        sq = jnp.square(dev) if mask is None else jnp.where(mask, jnp.square(dev), 0)
        ssd = jnp.sum(sq, axis=red)
        if self.axis_name is not None:
            ssd = jax.lax.psum(ssd, self.axis_name)
        return mean, ssd / nf, n

    def __call__(
        self,
        x: Inexact[Array, "..."],
        *,
        mask: Bool[ArrayLike, "..."] | None = None,
        key=None,
    ) -> Inexact[Array, "..."]:
        """Normalise `x`; in training mode also update the running statistics.

        **Arguments:**

        - `x`: an array with `num_features` channels on `channel_axis`.
        - `mask`: optional boolean array broadcastable to `x.shape`: only the
            entries where it is `True` enter the batch statistics (padding).
            Ignored in evaluation with running statistics.
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
        n = None
        m: Array | None = None  # the mask, where batch statistics use it
        padded = xc
        if self._uses_batch_stats():
            if self.eps <= 0:  # as PyTorch: a constant channel would give NaN
                raise StateValueError(
                    f"BatchNorm({self.num_features}) normalises "
                    f"with batch statistics {self._why()} and has eps={self.eps}: a "
                    "channel whose values are all equal has variance 0 and would "
                    "normalise to NaN. Use eps > 0 (PyTorch refuses eps <= 0 in "
                    "training too); eps=0 is fine in inference with running "
                    "statistics."
                )
            if mask is not None:
                m = self._mask(mask, x)
            if m is not None:
                # padding may hold anything (NaN, inf, float32's max: unset rows);
                # the statistics and gradients are computed with it as 0, so the
                # zero cotangents of masked entries never meet an infinite partial
                # derivative (NaN gradients of weight, bias and the unmasked
                # entries); its output is put back below, without a gradient
                xc = jnp.where(m, xc, jnp.zeros((), cdtype))
            mean, var, n = self._batch_stats(xc, red, shape, m)
            if isinstance(n, int) and n == 1:
                raise StateValueError(self._one_value_message(x.shape))
            if not inference_flag(self) and self.track_running_stats:
                self._update(mean, var, n)
        else:
            mean, var = self._running_stats(cdtype)
        y = self._normalise(xc, mean, var, shape, cdtype)
        if m is not None:
            # the padding's output, normalised as given: no gradient flows to it
            # (it contributes nothing), so an infinite value there stays out of them
            out = self._normalise(padded, mean, var, shape, cdtype)
            y = jnp.where(m, y, jax.lax.stop_gradient(out))
        if n is not None and not isinstance(n, int):
            # A channel with no unmasked entry has no batch statistics (0 / 0): its
            # output is NaN, as Flax's. The NaN is a constant selected by `where`,
            # so gradients through the channel stay finite (zero).
            y = jnp.where(n.reshape(shape) > 0, y, jnp.asarray(jnp.nan, cdtype))
        return y.astype(x.dtype)

    def _normalise(self, v: Array, mean: Array, var: Array, shape, cdtype) -> Array:
        y = (v - mean.reshape(shape)) * jax.lax.rsqrt(var.reshape(shape) + self.eps)
        if self.weight is not None and self.bias is not None:
            w = self.weight.astype(cdtype).reshape(shape)
            y = y * w + self.bias.astype(cdtype).reshape(shape)
        return y

    def _one_value_message(self, shape: tuple[int, ...]) -> str:
        where = "" if self.axis_name is None else f" over axis {self.axis_name!r}"
        if inference_flag(self):
            # PyTorch: `bn_training = training or running stats are None`, and
            # F.batch_norm refuses one value per channel whenever it is set.
            return (
                f"BatchNorm got one value per channel{where} (input shape {shape}) "
                f"{self._why()}: the batch variance is 0, so every output would "
                "be the bias (PyTorch raises here too). Evaluate on batches of "
                "more than one example, or build the layer with "
                "track_running_stats=True to evaluate with running statistics."
            )
        return (
            f"BatchNorm got one value per channel{where} (input shape {shape}) in "
            "training mode: the batch variance is 0, so the running variance would "
            "shrink towards 0 (PyTorch raises here too). Train with batches of more "
            "than one example, or evaluate with `eqx.nn.inference_mode(model)`."
        )

    def _running_stats(self, cdtype) -> tuple[Array, Array]:
        assert self.running_mean is not None and self.running_var is not None
        for cell in (self.running_mean, self.running_var):  # any float is read
            check_cell_dtype("BatchNorm", self, cell, jnp.floating)
        mean = self.running_mean[...].astype(cdtype)
        var = self.running_var[...].astype(cdtype)
        if self.zero_debias:
            assert self.num_batches_tracked is not None and self.momentum is not None
            t = self.num_batches_tracked[...]
            scale = 1 - jnp.power(jnp.asarray(1 - self.momentum, cdtype), t)
            scale = jnp.where(t > 0, scale, jnp.ones((), cdtype))
            mean, var = mean / scale, var / scale
        return mean, var

    def _update(self, mean: Array, var: Array, n: Array | int) -> None:
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        # the statistics are updated in float32 or wider, the count in 32 bits or
        # more (reading narrower statistics, in inference, is fine)
        for cell in (self.running_mean, self.running_var):
            check_cell_dtype("BatchNorm", self, cell, jnp.floating, 32)
        check_cell_dtype("BatchNorm", self, self.num_batches_tracked, jnp.integer, 32)
        # saturates instead of wrapping (an int32 count loaded from PyTorch's int64
        # near 2**31 would turn negative, and `momentum=None`'s weight with it)
        count = saturating_add(self.num_batches_tracked[...], 1)
        self.num_batches_tracked[...] = count
        dt = mean.dtype
        if self.momentum is None:
            m: Array | np.ndarray = 1.0 / count.astype(dt)
            keep: Array | np.ndarray = 1 - m
        else:  # constants, computed in the statistics' dtype as the program would
            m = np.asarray(self.momentum, dt)
            keep = np.asarray(1, dt) - m
        rm, rv = self.running_mean, self.running_var
        old_mean, old_var = rm[...].astype(dt), rv[...].astype(var.dtype)
        new_mean = keep * old_mean + m * mean
        # Without a mask every channel has the same count, a Python int known while
        # tracing: the arithmetic on it is NumPy constants and the guards below are
        # decided here (`_keep_where`), not staged into the program.
        xp = np if isinstance(n, int) else jnp
        if self.unbiased_running_var:
            nf = xp.asarray(n, var.dtype)
            var = var * (nf / xp.maximum(nf - 1, xp.asarray(1, var.dtype)))
        new_var = keep * old_var + m * var
        # A channel with no entry (an empty batch, or all masked out) keeps its
        # statistics, as PyTorch on an empty batch; one with a single masked-in
        # entry has no unbiased variance: it keeps its running variance.
        new_mean = _keep_where(n > 0, new_mean, old_mean)
        var_defined = n > (1 if self.unbiased_running_var else 0)
        new_var = _keep_where(var_defined, new_var, old_var)
        rm[...] = new_mean.astype(rm.dtype)
        rv[...] = new_var.astype(rv.dtype)


def _keep_where(cond: Any, new: Any, old: Array) -> Any:
    """`jnp.where(cond, new, old)`, decided while tracing when `cond` is a Python
    bool (nothing staged)."""
    if isinstance(cond, bool):
        return new if cond else old
    return jnp.where(cond, new, old)
