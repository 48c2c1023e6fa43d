from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Integer

from .._buffer import CounterState, _LayerBase
from .._compat import Tracer
from .._errors import (
    StateTypeError,
    check_bool,
    check_dtype,
    check_int,
    is_whole,
)
from ._flag import inference_flag


class Counter(_LayerBase):
    """An integer counter kept as state: the seed tutorial's counter as a layer.

    `increment()` adds one (or `by`) and returns the new count; `value` reads it. In
    evaluation ([`eqx.nn.inference_mode`](https://docs.kidger.site/equinox/api/nn/inference/)) `increment()`
    writes nothing and returns the current count.

    **Arguments:**

    - `start`: the initial count (also what `es.reset` writes back): a whole
        number that `dtype` holds (a Python or NumPy integer, or a concrete 0-d
        integer array, e.g. a restored step count).
    - `dtype`: the integer dtype of the count (default int32). The count wraps
        around past the dtype's largest value, as integer arithmetic does in JAX
        and PyTorch (int32: after 2³¹ − 1; `jnp.uint32` counts to 2³² − 1). A
        Python step `by` must lie in the dtype's range (for an unsigned count,
        down to minus its largest value: a decrement).

    **Example:**

    ```python
    import eqx_state as es

    counter = es.to_refs(es.nn.Counter())
    print([int(counter.increment()) for _ in range(3)])  # [1, 2, 3]
    ```
    """

    count: CounterState
    inference: bool = False

    def __init__(
        self,
        start: int | Integer[ArrayLike, ""] = 0,
        *,
        dtype=jnp.int32,
        inference: bool = False,
    ):
        dtype = check_dtype("Counter", "dtype", dtype)
        inference = check_bool("Counter", "inference", inference)
        if not jnp.issubdtype(dtype, jnp.integer):
            raise StateTypeError(
                f"Counter: `dtype` must be an integer dtype, got {jnp.dtype(dtype)}; "
                "a counter counts whole steps (use a metric, e.g. `es.metrics.Sum`, "
                "to accumulate fractional values)."
            )
        start = _whole("Counter", "`start`", start, dtype)
        self.count = CounterState(jnp.asarray(start, dtype=dtype), init=start)
        self.inference = inference

    @property
    def value(self) -> Integer[Array, "..."]:
        """The current count."""
        return self.count[...]

    def increment(self, by: int | Integer[Array, "..."] = 1) -> Integer[Array, "..."]:
        """Add `by` to the count (unless in inference mode); return the new count."""
        dtype = self.count.dtype
        weak_wide = (
            getattr(by, "weak_type", False)
            and jnp.issubdtype(getattr(by, "dtype", object), jnp.integer)
            and jnp.dtype(by.dtype).itemsize > jnp.dtype(dtype).itemsize  # pyright: ignore[reportAttributeAccessIssue]
        )
        if weak_wide and not isinstance(by, Tracer) and jnp.ndim(by) == 0:
            # a weakly typed array (`jnp.asarray(200)`) is a Python int to JAX:
            # checked as one (it was cast without a word: 200 into int8 is -56)
            by = int(by)  # pyright: ignore[reportArgumentType]
        elif weak_wide and isinstance(by, Tracer):
            raise StateTypeError(
                f"Counter.increment(by) got a traced, weakly typed step (a Python int "
                f"passed into `jit` or another transformation) for a "
                f"counter of dtype {jnp.dtype(dtype).name}: its value cannot be checked against "
                f"the counter's range while tracing, and a step out of range would be "
                f"cut to {jnp.dtype(dtype).itemsize * 8} bits. Cast it yourself "
                f"(`by.astype(jnp.{jnp.dtype(dtype).name})`), or build the counter "
                "with a wider dtype (the default, int32)."
            )
        if is_whole(by):
            by = _whole("Counter.increment", "`by`", by, dtype, step=True)
            # in the counter's dtype (`jnp.asarray` would take int32, which holds
            # no uint32 step past 2**31 - 1); a negative step of an unsigned
            # counter as its value modulo 2**bits, to which the sum wraps
            if jnp.iinfo(dtype).min == 0:
                by %= int(jnp.iinfo(dtype).max) + 1
            by = jnp.asarray(by, dtype)
        elif not jnp.issubdtype(getattr(by, "dtype", object), jnp.integer):
            raise StateTypeError(
                f"Counter.increment(by) needs an integer step, got {by!r}; a "
                "counter counts whole steps (use a metric, e.g. `es.metrics.Sum`, to "
                "accumulate fractional values)."
            )
        elif jnp.dtype(src := getattr(by, "dtype", None)).itemsize > jnp.dtype(
            dtype
        ).itemsize and not getattr(by, "weak_type", False):
            # a wider step would be cut to the counter's bits (40000 into int16:
            # -25536, the count going down), where a Python int is checked
            raise StateTypeError(
                f"Counter.increment(by) got a step of dtype {jnp.dtype(src).name} for a "
                f"{jnp.dtype(dtype).name} counter: the cast would cut it to "
                f"{jnp.dtype(dtype).itemsize * 8} bits. Cast the step yourself if it "
                f"fits (`by.astype(jnp.{jnp.dtype(dtype).name})`), or build the "
                f"counter with a wider dtype (`Counter(dtype=jnp.{jnp.dtype(src).name})`)."
            )
        step = jnp.asarray(by)
        if inference_flag(self):
            return self.count[...]
        new = self.count[...] + step.astype(self.count.dtype)
        self.count[...] = new
        return new

    def __call__(self) -> Integer[Array, "..."]:
        """Same as `increment()`."""
        return self.increment()


def _whole(
    where: str, name: str, value: object, dtype: object, step: bool = False
) -> int:
    """`value` as an `int` if it is a whole number that `dtype` holds (the one
    whole-number check, `_errors.check_int`)."""
    info = jnp.iinfo(dtype)  # pyright: ignore[reportArgumentType]
    # a step of an unsigned counter may be negative: cast, it wraps to the
    # same count modulo 2**bits (5 + (-1) is 4)
    low = -int(info.max) if step and info.min == 0 else int(info.min)
    return check_int(
        where,
        name,
        value,
        low,
        int(info.max),
        hint=f"The counter's dtype is {jnp.dtype(dtype).name}.",  # pyright: ignore
    )


_ = jax  # keep the import for type checkers that resolve `jax.Array` via jaxtyping


def saturating_add(count: Array, n: ArrayLike) -> Array:
    """`count + n` (`n >= 0`) in `count`'s integer dtype, stopping at the dtype's
    largest value instead of wrapping: the one rule for the layers' own counts
    (BatchNorm's `num_batches_tracked`, RunningNorm's, EMA's and Capture's). A
    count that wrapped would turn negative, and every weight computed from it
    (`1 / count`, `n / (count + n)`) with it."""
    dtype = jnp.dtype(count.dtype)
    top = int(jnp.iinfo(dtype).max)
    # `min(count, top - n) + n`: `top` where `count > top - n`, else `count + n`,
    # which then cannot wrap. Two operations (a `select` form takes four); for a
    # Python int `n` (a layer's `+ 1`), `top - n` is a constant, not staged.
    if isinstance(n, int) and 0 <= n <= top:
        room: ArrayLike = np.asarray(top - n, dtype)
        step: ArrayLike = np.asarray(n, dtype)
    else:
        step = jnp.asarray(n, dtype)
        room = np.asarray(top, dtype) - step
    return jnp.minimum(count, room) + step
