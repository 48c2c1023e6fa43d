"""Metrics kept as state: mergeable sufficient statistics updated inside the step.

A metric is a stateful layer (an `eqx.Module`) whose [`eqx_state.MetricState`][]
cells hold sufficient statistics — sums and counts, extremes, moments, a confusion
matrix. It is updated where the value is computed:

* in the loss function during [`eqx_state.make_step`][] (train metrics; the step
  still compiles once, and no gradient flows into metric state);
* in an evaluation loop, through [`eqx_state.apply`][] (value mode, jit-able, also
  inside `lax.scan`) or in place in ref mode ([`eqx_state.to_refs`][]).

`update(...)` writes, `compute()` reads, `a.merge(b)` combines two metrics into a new
one (pure, associative), `metric.reduce(axis_name)` combines them over a named axis
(`vmap` / `shard_map` / `pmap`), and [`eqx_state.reset`][] starts every metric in a model over without touching
other state.

Your own metric declares its statistics with [`eqx_state.metrics.statistic`][] and
defines `update` and `compute` (see [`eqx_state.metrics.Metric`][]).

Metrics have no `inference` flag and keep updating under
[`eqx.nn.inference_mode`](https://docs.kidger.site/equinox/api/nn/inference/): evaluation is where they are
used most.

Masks and sample weights: every `update` takes `mask=` (entries where it is false
contribute nothing, even NaN ones: use it for padded batches); all but `Min`, `Max`
and `LastValue` take `sample_weight=`. Both may have the values' shape or a prefix of
it (e.g. `[batch]` for per-token values `[batch, time]`).

No data, or only masked-out data, never raises and never computes NaN (so metrics
work under `jax.debug_nans`): `Mean`, `MeanStd`, `LastValue`, `Accuracy` and `Sum`
compute 0, `ConfusionMatrix` a zero matrix, `Min` / `Max` +inf / -inf (the identity
of the reduction, as torchmetrics); `Precision`, `Recall` and `F1` compute
`zero_division` (default 0, as scikit-learn) for any undefined ratio. Where that value
could be mistaken for a result, a statistic tells "no data" apart: `Mean.weight`,
`Accuracy.total`, `MeanStd.count`, and `count` of `Min`, `Max` and `LastValue`.
"""

from ._accuracy import Accuracy as Accuracy
from ._base import Metric as Metric, Statistic as Statistic, statistic as statistic
from ._classification import (
    F1 as F1,
    ConfusionMatrix as ConfusionMatrix,
    Precision as Precision,
    Recall as Recall,
)
from ._collection import Metrics as Metrics
from ._extrema import Max as Max, Min as Min
from ._histogram import Histogram as Histogram
from ._last_value import LastValue as LastValue
from ._mean import Mean as Mean, Sum as Sum
from ._mean_std import MeanStd as MeanStd


def __getattr__(name: str) -> object:
    """`reset` is kept for one release with a `DeprecationWarning`."""
    if name == "reset":
        from .._errors import warn_deprecated
        from .._reset import reset

        warn_deprecated(
            "eqx_state.metrics.reset", "`eqx_state.reset` (the same function)"
        )
        return reset
    raise AttributeError(f"module 'eqx_state.metrics' has no attribute {name!r}")
