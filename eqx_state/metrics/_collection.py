"""`Metrics`: a named collection of metrics updated from one call."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from typing import Any

import equinox as eqx
from jaxtyping import ArrayLike, Shaped

from .._buffer import _LayerBase
from .._errors import StateTypeError, StateValueError
from ._base import Metric


_RESERVED = ("mask",)


class Metrics(_LayerBase):
    """A named collection of metrics: one `update` call updates several of them, one
    `compute` call returns a dict, in the order the metrics were given (kept as a
    static field, so it survives `eqx.partition` / `eqx.combine`, `jax.tree.map` and
    `es.apply`, which rebuild dicts with sorted keys).

    The collection is an `eqx.Module` like its members, so it can live in a model
    (updated in the loss function during [`eqx_state.make_step`][]) or on its own.
    Collections nest: a member may itself be a `Metrics`.

    **Arguments:**

    - `metrics`: a dict from names to metrics; or pass them as keyword arguments.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    metrics = es.to_refs(
        es.metrics.Metrics(loss=es.metrics.Mean(), accuracy=es.metrics.Accuracy())
    )
    logits = jnp.array([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0]])
    labels = jnp.array([0, 0, 0])
    metrics.update(loss=jnp.array([0.1, 1.3, 0.1]), accuracy=(logits, labels))
    result = metrics.compute()
    assert abs(float(result["loss"]) - 0.5) < 1e-6
    assert abs(float(result["accuracy"]) - 2 / 3) < 1e-6
    ```
    """

    metrics: dict[str, Metric | Metrics]
    names: tuple[str, ...] = eqx.field(static=True)

    def __init__(self, metrics: dict[str, Any] | None = None, /, **named: Any):
        if metrics is not None and not isinstance(metrics, Mapping):
            raise StateTypeError(
                "Metrics takes a dict from names to metrics, or the metrics as "
                f"keyword arguments (`Metrics(loss=Mean())`); got "
                f"{type(metrics).__name__}."
            )
        members = dict(metrics or {})
        for name, metric in named.items():
            if name in members:
                raise StateValueError(f"Metrics: the name {name!r} is given twice.")
            members[name] = metric
        for name, metric in members.items():
            if not isinstance(name, str) or name in _RESERVED:
                raise StateValueError(
                    f"Metrics: {name!r} cannot name a metric; names are strings other "
                    f"than {_RESERVED} (the keyword `update` uses for a shared mask)."
                )
            if not isinstance(metric, (Metric, Metrics)):
                raise StateTypeError(
                    f"Metrics: {name!r} is a {type(metric).__name__}, not a metric. "
                    "Members must be `eqx_state.metrics` metrics (or nested "
                    "`Metrics`)."
                )
        self.metrics = members
        self.names = tuple(members)

    def __getitem__(self, name: str) -> Any:
        return self.metrics[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def update(
        self,
        values: dict[str, Any] | None = None,
        /,
        *,
        mask: Shaped[ArrayLike, "..."] | None = None,
        **named: Any,
    ) -> None:
        """Update the named metrics; the others are left as they are.

        Each name maps to that metric's `update` arguments: a tuple is passed as
        positional arguments (`accuracy=(logits, labels)`), a dict as keyword
        arguments (`loss=dict(values=losses, sample_weight=w)`), anything else as
        the one positional argument (`loss=loss`). A nested `Metrics` takes a dict
        of its own members' arguments.

        **Arguments:**

        - `values`: a dict from names to arguments (for names that are not Python
            identifiers); or pass them as keyword arguments.
        - `mask`: passed as `mask=` to every metric updated in this call (e.g. the
            padding mask of the batch), unless its arguments set their own.
        """
        if values is not None and not isinstance(values, Mapping):
            raise StateTypeError(
                "Metrics.update takes each metric's arguments by its name "
                "(`metrics.update(loss=loss, acc=(logits, labels))`, or a dict from "
                f"names to arguments); got a {type(values).__name__}."
            )
        given = dict(values or {})
        given.update(named)
        unknown = [name for name in given if name not in self.metrics]
        if unknown:
            raise StateValueError(
                f"Metrics.update got values for {unknown}, which are not in this "
                f"collection; its metrics are {list(self.names)}."
            )
        for name in [n for n in self.names if n in given]:
            value, metric = given[name], self.metrics[name]
            if isinstance(metric, Metrics):
                if not isinstance(value, dict):
                    raise StateTypeError(
                        f"Metrics.update: {name!r} is a nested Metrics collection, so "
                        "its value must be a dict of its members' arguments, got a "
                        f"{type(value).__name__}."
                    )
                metric.update(value, mask=mask)
                continue
            if isinstance(value, tuple):
                args, kwargs = value, {}
            elif isinstance(value, dict):
                args, kwargs = (), dict(value)
            else:
                args, kwargs = (value,), {}
            if mask is not None:
                kwargs.setdefault("mask", mask)
            metric.update(*args, **kwargs)

    def update_all(self, *args: Any, **kwargs: Any) -> None:
        """Update every metric of the collection (nested collections included) with
        the same arguments, `metric.update(*args, **kwargs)`, as torchmetrics'
        `MetricCollection.update`. For a collection of classification metrics,
        `metrics.update_all(logits, labels, mask=mask)`.

        **Arguments:**

        - `*args`, `**kwargs`: the arguments of every member's `update`.
        """
        for name in self.names:
            metric = self.metrics[name]
            if isinstance(metric, Metrics):
                metric.update_all(*args, **kwargs)
            else:
                metric.update(*args, **kwargs)

    def compute(self) -> dict[str, Any]:
        """`{name: metric.compute()}` for every metric, in the order the metrics
        were given (nested collections give nested dicts)."""
        return {name: self.metrics[name].compute() for name in self.names}

    def merge(self, other: Any) -> Metrics:
        """Merge member by member with a collection of the same names (see
        [`eqx_state.metrics.Metric.merge`][]); returns a new value-mode collection."""
        if not isinstance(other, Metrics) or set(other.names) != set(self.names):
            theirs = list(other.names) if isinstance(other, Metrics) else other
            raise StateValueError(
                f"Metrics.merge: the collections hold different metrics "
                f"({list(self.names)} vs {theirs}); merge collections built alike."
            )
        return Metrics({k: self.metrics[k].merge(other.metrics[k]) for k in self.names})

    def reduce(self, axis_name: Hashable) -> Metrics:
        """Reduce every member over the named axis `axis_name` (see
        [`eqx_state.metrics.Metric.reduce`][]); returns a new value-mode collection."""
        return Metrics({k: self.metrics[k].reduce(axis_name) for k in self.names})
