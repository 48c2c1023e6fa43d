"""`LastValue`: the most recent value (a learning rate, the loss of the last step)."""

from __future__ import annotations

from collections.abc import Hashable

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Real, Shaped

from .._buffer import MetricState
from .._errors import StateTypeError, StateValueError
from ._base import (
    Metric,
    _check_dtype,
    _check_inputs,
    _check_int,
    _fit,
    _iota_like,
    _truthy,
    from_bits,
    statistic,
    to_bits,
)


class LastValue(Metric):
    """The most recent value given to `update` (e.g. the loss of the last step, the
    current learning rate).

    Statistics: the `value` (of the fixed `shape`, 0 before any data) and the
    `count` of values seen (float32: exact up to 2**24, never wraps). `a.merge(b)`
    keeps `b`'s value if `b` has seen any, else `a`'s (a `"custom"` merge, see
    [`eqx_state.metrics.Metric.merge_statistics`][]), so merging is associative and
    "last" means last in the order of the data. Over a named axis, the value comes
    from the highest axis index that has one (the last shard of the global batch).

    **Arguments:**

    - `shape`: the shape of one value (default `()`, a scalar).
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the value (default float32); an integer dtype
        takes integer values it holds only: a float, or an
        integer of a dtype it does not hold (uint32 into int32), raises a
        `TypeError` at `update` rather than being truncated or wrapped.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    last = es.to_refs(es.metrics.LastValue())
    last.update(0.5)
    last.update(jnp.array([0.4, 0.3, 0.2]), mask=jnp.array([True, True, False]))
    assert float(last.compute()) == jnp.float32(0.3)
    ```
    """

    _wide_cells = ("count",)

    value: MetricState
    count: MetricState
    shape: tuple[int, ...] = eqx.field(static=True)

    def __init__(
        self,
        shape: tuple[int, ...] = (),
        *,
        axis_name: Hashable | None = None,
        dtype=jnp.float32,
    ):
        dtype = _check_dtype("LastValue", dtype, "values")
        if not isinstance(shape, (tuple, list)):
            raise StateTypeError(
                "LastValue: shape must be a tuple of ints (the shape of one value; "
                f"`()` for scalars), got {shape!r}. E.g. `LastValue((3,))` for "
                "values of shape [3]."
            )
        self.shape = tuple(
            _check_int("LastValue", f"every size in shape {tuple(shape)}", s, 0)
            for s in shape
        )
        self.value = statistic("custom", shape=self.shape, dtype=dtype, init=0)
        self.count = statistic("sum", dtype=jnp.float32)
        self.axis_name = axis_name

    def update(
        self,
        value: Real[ArrayLike, "..."],
        *,
        mask: Shaped[ArrayLike, "..."] | None = None,
    ) -> None:
        """Record `value`.

        **Arguments:**

        - `value`: one value of shape `shape`, or a batch of them, of shape
            `[n, *shape]`, of which the last one (the last unmasked one) is kept.
        - `mask`: a scalar for one value (`False`: ignore it), or shape `[n]` for a
            batch.
        """
        dtype = self.value.dtype
        _check_inputs("LastValue", dtype, value=value)
        value = jnp.asarray(value).astype(dtype)
        if value.shape == self.shape:
            value = value[None]
            if mask is not None:
                mask = jnp.asarray(mask)
                if mask.size != 1:
                    raise StateValueError(
                        f"LastValue(shape={self.shape}) got one value with a mask of "
                        f"shape {mask.shape}: the mask of one value is a scalar (False: "
                        "ignore it). A batch's mask given to a collection reaches every "
                        "member: update this one apart, or give it "
                        "`mask=jnp.any(mask)` (kept when any example counts)."
                    )
                mask = jnp.reshape(mask, (1,))
        elif value.shape[1:] != self.shape:
            raise StateValueError(
                f"LastValue(shape={self.shape}) got a value of shape {value.shape}: "
                f"expected one value of shape {self.shape} or a batch of shape "
                f"[n, *{self.shape}]. Build the metric with the shape of one value, "
                "e.g. `LastValue(shape=x.shape)`."
            )
        n = value.shape[0]
        trailing = tuple(range(1, value.ndim))
        keep = jnp.all(jnp.ones_like(value, dtype=bool), axis=trailing)  # [n]
        if mask is not None:
            keep = keep & _fit("mask", _truthy(mask), (n,))
        index = _iota_like(keep)
        last = jnp.max(jnp.where(keep, index, -1), initial=-1)
        count = jnp.sum(keep.astype(jnp.float32))
        chosen = (index == last).reshape((n,) + (1,) * len(self.shape))
        picked = _pick(value, chosen)
        self.accumulate(value=picked, count=count)

    def merge_statistics(
        self, a: dict[str, Array], b: dict[str, Array]
    ) -> dict[str, Array]:
        """`b`'s value if `b` has seen any, else `a`'s; the counts add."""
        later = b["count"] > 0
        return {
            "value": jnp.where(later, b["value"], a["value"]),
            "count": a["count"] + b["count"],
        }

    def compute(self) -> Real[Array, "..."]:
        """The last value recorded; 0 if none was (`count` tells)."""
        return self.value[...]


def _pick(value: Array, chosen: Array) -> Array:
    """The row of `value` (axis 0) where `chosen` holds, bit for bit (zeros where no
    row is chosen). A masked sum rather than `value[last]`: no dynamic index, so it
    also works on a batch sharded across devices. One term is nonzero, so the sum
    of the rows' bits (`to_bits`) is that row's (JAX sums int8 in int32)."""
    bits = to_bits(value)
    zero = jnp.zeros_like(bits)
    picked = jnp.sum(jnp.where(chosen, bits, zero), axis=0, dtype=bits.dtype)
    return from_bits(picked, value.dtype)
