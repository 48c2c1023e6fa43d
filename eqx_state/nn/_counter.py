from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from .._buffer import CounterState, _LayerBase
from .._errors import StateTypeError
from ._flag import inference_flag


class Counter(_LayerBase):
    """An integer counter kept as state: the seed tutorial's counter as a layer.

    `increment()` adds one (or `by`) and returns the new count; `value` reads it. In
    evaluation ([`eqx.nn.inference_mode`](https://docs.kidger.site/equinox/api/nn/inference/)) `increment()`
    writes nothing and returns the current count.

    **Arguments:**

    - `start`: the initial count (also what `es.reset` writes back).
    - `dtype`: the integer dtype of the count (default int32).

    **Example:**

    ```python
    import eqx_state as es

    counter = es.to_refs(es.nn.Counter())
    print([int(counter.increment()) for _ in range(3)])  # [1, 2, 3]
    ```
    """

    count: CounterState
    inference: bool = False

    def __init__(self, start: int = 0, *, dtype=jnp.int32, inference: bool = False):
        self.count = CounterState(jnp.asarray(start, dtype=dtype), init=int(start))
        self.inference = inference

    @property
    def value(self) -> Int[Array, "..."]:
        """The current count."""
        return self.count[...]

    def increment(self, by: int | Int[Array, "..."] = 1) -> Int[Array, "..."]:
        """Add `by` to the count (unless in inference mode); return the new count."""
        step = jnp.asarray(by)
        if not jnp.issubdtype(step.dtype, jnp.integer):
            raise StateTypeError(
                f"Counter.increment(by) needs an integer step, got {by!r} of dtype "
                f"{step.dtype}; a counter counts whole steps (use a metric, e.g. "
                "`es.metrics.Sum`, to accumulate fractional values)."
            )
        if inference_flag(self):
            return self.count[...]
        new = self.count[...] + step.astype(self.count.dtype)
        self.count[...] = new
        return new

    def __call__(self) -> Int[Array, "..."]:
        """Same as `increment()`."""
        return self.increment()


_ = jax  # keep the import for type checkers that resolve `jax.Array` via jaxtyping
