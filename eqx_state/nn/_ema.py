from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PyTree

from .._buffer import (
    AverageState,
    _is_param,
    _LayerBase,
    check_cell_dtype,
    is_state,
    params,
)
from .._errors import StateValueError, check_bool, check_dtype, check_int, check_real
from .._modes import model_path
from ._complex import refuse_complex
from ._counter import saturating_add
from ._flag import inference_flag
from ._kv_cache import KVCache


_Model = TypeVar("_Model")


class EMA(_LayerBase):
    r"""An exponential moving average (Polyak average) of a model's parameters, kept
    as state.

    The average and its update count live in [`eqx_state.AverageState`][] cells, so
    they are not parameters: [`eqx_state.params`][] leaves them out and no optimizer
    touches them, even when the `EMA` is stored inside the model it averages; and
    `es.reset(model, es.BatchStat)` (a BatchNorm recalibration) leaves them alone.
    Each `update(model)` (in training mode) does, with $t$ counting the updates
    after the warm-up,

    $$d_t = \begin{cases} 0 & t \le 0 \text{ (warm-up: copy the value)} \\
    \min(d, \tfrac{t}{t + 9}) & \text{with } \texttt{dynamic\_decay} \\
    d & \text{otherwise} \end{cases}, \qquad
    h \leftarrow d_t\, h + (1 - d_t)\, p,$$

    and the average is $h$, or $h / (1 - d^t)$ with `zero_debias=True`. This is
    Haiku's `ExponentialMovingAverage` (`zero_debias`, `warmup_length`: the first
    `warmup_length` updates copy the value) and TensorFlow's `num_updates` decay
    schedule (`dynamic_decay`: $\min(d, \frac{1 + n}{10 + n})$ with $n = t - 1$ the
    number of earlier updates). One difference from Haiku: without zero-debiasing
    the average starts at the parameters the `EMA` was built from, not at zero
    (which would pull averaged weights towards zero). The update is computed as
    `torch.lerp` computes it, $h + (1 - d_t)(p - h)$ (from the nearer end), with a
    multiply and an add: PyTorch's vectorised CPU kernel fuses them (one rounding)
    for most entries, so the two can differ in the last bit (about one ulp).

    **PyTorch.** `EMA(model, decay, warmup_length=1)` is
    `torch.optim.swa_utils.AveragedModel(model,
    multi_avg_fn=get_ema_multi_avg_fn(decay))`: PyTorch copies the parameters on
    its first `update_parameters` (the warm-up of one) and then averages with
    `torch._foreach_lerp_(avg, p, 1 - decay)`. (Without the warm-up the first
    update averages with the parameters the `EMA` was built from; the same numbers
    when the first update sees those parameters.) `AveragedModel`'s default,
    without `multi_avg_fn`, is the equal-weight average of stochastic weight
    averaging, $h + (p - h) / (n + 1)$, which `EMA` does not compute. The state
    dict is PyTorch's: `n_averaged` (the update count) and the averaged model
    under `module.` (named by the rules of the model the `EMA` was built from), so
    [`eqx_state.load_state_dict`][] continues a PyTorch run where it stopped. With
    `zero_debias=True`, `module.*` is the debiased average (the average PyTorch
    would hold); before the first update there is no average and it is zeros, where
    `AveragedModel` holds the copy of the model it was built from (which its first
    `update_parameters` overwrites): evaluate with `averaged(model)`, which returns
    `model` then.

    Read the result with `averaged(model)` (the model with averaged parameters,
    for evaluation: the functional form of PyTorch's swap) or `average` (just the
    averaged parameters). In evaluation
    ([`eqx.nn.inference_mode`](https://docs.kidger.site/equinox/api/nn/inference/)) `update` writes nothing.

    **Precision.** The average is kept and computed in `accumulation_dtype`: by
    default float32 for parameters of a narrower floating dtype (bfloat16,
    float16) and the parameter's own dtype otherwise. In bfloat16, `0.999` rounds to
    `1.0` and `1 - 0.999` to `0.00099945`, so an average kept in bfloat16 would
    never move; kept in float32 it moves by `(1 - d) (p - h)` at every update.
    `average` and `averaged` cast the result back to each parameter's dtype.

    **How often it updates.** Every `update` call is one averaging step. With
    `es.make_step(..., microbatches=k)` the loss runs once per slice, so an `update`
    inside the loss advances the average $k$ times per optimizer step, on the same
    parameters: the effective decay per optimizer step is $d^k$ and `warmup_length`
    counts slices. To average once per optimizer step, update outside the loss,
    after the step: `_, model = es.apply(lambda m: m.ema.update(m.net), model)`
    (or, in ref mode, `model.ema.update(model.net)`), or pass `decay ** (1 / k)`.

    **Arguments:**

    - `model`: the model (any pytree) whose parameters ([`eqx_state.params`][]:
        inexact arrays outside state cells) are averaged. Later `update` /
        `averaged` calls take a model of the same structure.
    - `decay`: the decay $d \in [0, 1)$; close to 1 averages over more steps.
    - `zero_debias`: start the average at zero and divide by $1 - d^t$ (Adam's bias
        correction), so that it is the exact weighted mean of the values seen.
    - `warmup_length`: the number of first updates that copy the value instead of
        averaging it (Haiku's `warmup_length`). Cannot be combined with
        `zero_debias`.
    - `dynamic_decay`: use $\min(d, \frac{1 + n}{10 + n})$ after $n$ earlier
        updates, so that early averages forget their start quickly. Cannot be
        combined with `zero_debias`.
    - `accumulation_dtype`: the dtype the average is kept and computed in (default:
        float32 for narrower floating parameters, else the parameter's dtype).
    - `inference`: start in evaluation mode (no updates).

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, optax
    import eqx_state as es

    class Model(eqx.Module):
        net: eqx.nn.Linear
        ema: es.nn.EMA

        def __init__(self, key):
            self.net = eqx.nn.Linear(2, 1, key=key)
            self.ema = es.nn.EMA(self.net, decay=0.9)

    def loss_fn(model, x, y):
        model.ema.update(model.net)  # averages the parameters the step starts from
        return jnp.mean((jax.vmap(model.net)(x)[:, 0] - y) ** 2)

    model = Model(jax.random.key(0))
    step = es.make_step(loss_fn, optax.sgd(0.1))
    opt_state = step.init(model)
    for _ in range(3):
        model, opt_state = step(model, opt_state, jnp.ones((4, 2)), jnp.zeros(4))
    eval_net = model.ema.averaged(model.net)  # the Linear with averaged weights
    ```
    """

    hidden: tuple[AverageState, ...]
    count: AverageState
    treedef: Any = eqx.field(static=True)
    dtypes: tuple[Any, ...] = eqx.field(static=True)
    # the dtypes the average is kept in (`accumulation_dtype`): a cell cast
    # narrower afterwards is refused at `update`
    accumulation: tuple[Any, ...] = eqx.field(static=True)
    decay: float = eqx.field(static=True)
    zero_debias: bool = eqx.field(static=True)
    warmup_length: int = eqx.field(static=True)
    dynamic_decay: bool = eqx.field(static=True)
    inference: bool

    def __init__(
        self,
        model: PyTree,
        decay: float = 0.999,
        *,
        zero_debias: bool = False,
        warmup_length: int = 0,
        dynamic_decay: bool = False,
        accumulation_dtype=None,
        inference: bool = False,
    ):
        decay = check_real("EMA", "decay", decay)
        zero_debias = check_bool("EMA", "zero_debias", zero_debias)
        dynamic_decay = check_bool("EMA", "dynamic_decay", dynamic_decay)
        inference = check_bool("EMA", "inference", inference)
        if not 0.0 <= decay < 1.0:
            raise StateValueError(f"EMA: decay must be in [0, 1), got {decay}.")
        warmup_length = check_int("EMA", "warmup_length", warmup_length, 0)
        if zero_debias and warmup_length:
            raise StateValueError(
                "EMA: zero_debias=True cannot be combined with warmup_length > 0: the "
                "warm-up copies the value into the average, so there is no zero start "
                "to correct (Haiku raises for the same reason). Drop one of them."
            )
        if zero_debias and dynamic_decay:
            raise StateValueError(
                "EMA: zero_debias=True cannot be combined with dynamic_decay=True: "
                "the correction 1 - decay**t assumes a constant decay. Drop one of "
                "them."
            )
        leaves, treedef = jax.tree_util.tree_flatten(params(model))
        if not leaves:
            raise StateValueError(
                "EMA: the model has no parameters to average (no inexact arrays "
                "outside state cells)."
            )
        if accumulation_dtype is not None:
            accumulation_dtype = check_dtype(
                "EMA", "accumulation_dtype", accumulation_dtype
            )
        if accumulation_dtype is not None and not jnp.issubdtype(
            accumulation_dtype, jnp.floating
        ):
            raise StateValueError(
                "EMA: accumulation_dtype must be a floating dtype, got "
                f"{accumulation_dtype}."
            )
        dtypes = tuple(jnp.dtype(x.dtype) for x in leaves)
        acc = [_accumulation_dtype(dt, accumulation_dtype) for dt in dtypes]
        if zero_debias:
            # Reset fill 0: the zero-debiased average starts at zero.
            self.hidden = tuple(
                AverageState(jnp.zeros(x.shape, dt), init=0)
                for x, dt in zip(leaves, acc)
            )
        else:
            # Starts at the parameters (no scalar fill: a reset keeps the current
            # average as the new start and restarts the count). Always a copy.
            self.hidden = tuple(
                AverageState(jnp.array(x, dtype=dt, copy=True))
                for x, dt in zip(leaves, acc)
            )
        self.count = AverageState(jnp.zeros((), jnp.int32), init=0)
        self.treedef = treedef
        self.dtypes = dtypes
        self.accumulation = tuple(acc)
        self.decay = float(decay)
        self.zero_debias = zero_debias
        self.warmup_length = int(warmup_length)
        self.dynamic_decay = dynamic_decay
        self.inference = inference

    def __reduce__(self) -> tuple:
        # `treedef` is a PyTreeDef, and copying one (`copy.deepcopy`, `pickle`)
        # copies Equinox's "missing" sentinel inside it, so the copy no longer equals
        # the structure of the model it averages. The copy rebuilds it instead, by
        # flattening a template of that structure (placeholders as leaves).
        state = {k: v for k, v in self.__dict__.items() if k != "treedef"}
        template = jax.tree_util.tree_unflatten(
            self.treedef, [0] * self.treedef.num_leaves
        )
        return (_rebuild_ema, (type(self), state, template))

    def _leaves(self, model: PyTree, what: str) -> list[Array]:
        leaves, treedef = jax.tree_util.tree_flatten(params(model))
        if treedef != self.treedef or any(
            x.shape != cell.shape for x, cell in zip(leaves, self.hidden)
        ):
            raise StateValueError(self._mismatch_message(model, what))
        return leaves

    def _mismatch_message(self, model: PyTree, what: str) -> str:
        """What differs between `model`'s parameters and the EMA's, by path."""
        expected = jax.tree_util.tree_unflatten(
            self.treedef,
            [
                jax.ShapeDtypeStruct(c.shape, d)
                for c, d in zip(self.hidden, self.dtypes)
            ],
        )
        found = _differences(expected, params(model), ())
        if found:
            more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
            differs = "; ".join(found[:5]) + more
        else:  # nothing found by the walk: show both structures
            differs = (
                f"\n  expected: {self.treedef}\n  got:      "
                f"{jax.tree_util.tree_structure(params(model))}\n"
            )
        return (
            f"EMA.{what} got a model whose parameters do not have the structure of "
            f"the model the EMA was built from: {differs}. Pass the same kind of "
            "model that was given to `EMA(...)` (e.g. `model.net`, not the module "
            f"that holds the EMA).{_kv_cache_hint(model, self.treedef)}"
        )

    @property
    def steps(self) -> Int[Array, ""]:  # noqa: F722
        """The number of updates made so far (warm-up included)."""
        return self.count[...]

    def _average_leaves(self) -> list[Array]:
        hidden = [cell[...] for cell in self.hidden]
        if not self.zero_debias:
            return hidden
        t = self.count[...]
        out = []
        for h in hidden:
            d = jnp.asarray(self.decay, h.dtype)
            correction = 1 - jnp.power(d, t.astype(h.dtype))
            # Before the first update there is nothing to correct (and 0 / 0).
            out.append(jnp.where(t > 0, h / jnp.where(t > 0, correction, 1), h))
        return out

    @property
    def average(self) -> PyTree:
        """The averaged parameters, in the layout of
        `es.params(model)` (parameters where the model has them, `None` elsewhere),
        each in its parameter's dtype. With `zero_debias=True` and no update yet,
        there is no average: zeros."""
        avg = [a.astype(dt) for a, dt in zip(self._average_leaves(), self.dtypes)]
        return jax.tree_util.tree_unflatten(self.treedef, avg)

    def update(self, model: PyTree) -> None:
        """Fold the current parameters of `model` into the average (nothing in
        evaluation mode). Works anywhere a state write works: inside a `loss_fn`
        run by [`eqx_state.make_step`][] (then it averages the parameters the step
        starts from, before the optimizer moves them), inside
        [`eqx_state.apply`][], or anywhere in ref mode.

        **Arguments:**

        - `model`: a model with the structure of the one given to `EMA(...)`
            (complex parameters where that model had real ones are refused: the
            average would drop their imaginary parts).

        **Returns:**

        Nothing; the cells are written.
        """
        leaves = self._leaves(model, "update")
        complex_ = jnp.complexfloating
        for i, (x, cell) in enumerate(zip(leaves, self.hidden)):
            # (the path is looked up only for the leaf refused)
            if jnp.issubdtype(x.dtype, complex_) and not jnp.issubdtype(
                cell.dtype, complex_
            ):
                path, _ = jax.tree_util.tree_flatten_with_path(params(model))[0][i]
                refuse_complex(
                    "EMA.update",
                    x.dtype,
                    f"the EMA keeps the average of `{model_path(path)}` "
                    f"in {jnp.dtype(cell.dtype).name} (the model it was built from "
                    "has real parameters there)",
                    "Build the EMA from a model with complex parameters (it then "
                    "keeps a complex average), or pass the model given to `EMA(...)`.",
                )
        if inference_flag(self):
            return
        # (an EMA pickled before `accumulation` existed: the default rule)
        kept = getattr(self, "accumulation", None) or tuple(
            _accumulation_dtype(dt, None) for dt in self.dtypes
        )
        for cell, built in zip(self.hidden, kept):
            # a cell cast narrower than the EMA keeps it (a model cast wholesale
            # to bfloat16): a decay of 0.999 rounds to 1 and the average stalls
            bits = jnp.finfo(built).bits
            if (
                not jnp.issubdtype(cell.dtype, jnp.inexact)
                or jnp.finfo(cell.dtype).bits < bits
            ):
                check_cell_dtype("EMA", self, cell, jnp.floating, bits)
        count = saturating_add(self.count[...], 1)
        self.count[...] = count
        t = count - self.warmup_length  # Haiku's counter: <= 0 during warm-up
        for cell, x in zip(self.hidden, leaves):
            h = cell[...]
            dtype = h.dtype  # the accumulation dtype
            if self.dynamic_decay:
                n = (t - 1).astype(dtype)
                d = jnp.minimum(jnp.asarray(self.decay, dtype), (1 + n) / (10 + n))
                w = 1 - d
            else:  # `1 - decay` in Python, as PyTorch's EMA computes it
                w = jnp.asarray(1.0 - self.decay, dtype)
            x = jax.lax.stop_gradient(x).astype(dtype)
            cell[...] = jnp.where(t <= 0, x, _lerp(h, x, w))

    def averaged(self, model: _Model) -> _Model:
        """`model` with its parameters replaced by their averages (state cells and
        everything else kept). Use it to evaluate with the averaged weights. With
        `zero_debias=True` and no update yet, `model` is returned unchanged.

        **Arguments:**

        - `model`: a model with the structure of the one given to `EMA(...)`.

        **Returns:**

        A model of the same structure holding the averaged parameters.
        """
        leaves = self._leaves(model, "averaged")
        avg = self._average_leaves()
        if self.zero_debias:
            started = self.count[...] > 0
            avg = [jnp.where(started, a, x) for a, x in zip(avg, leaves)]
        avg = [a.astype(x.dtype) for a, x in zip(avg, leaves)]
        _, rest = eqx.partition(model, _is_param, is_leaf=is_state)
        new = jax.tree_util.tree_unflatten(self.treedef, avg)
        return eqx.combine(new, rest, is_leaf=is_state)


def _differences(expected: Any, got: Any, path: tuple) -> list[str]:
    """Where `got` (a model's `es.params`) differs from `expected` (the EMA's
    template: `jax.ShapeDtypeStruct` leaves), by path: a parameter's shape, a
    static field (e.g. a `Linear`'s `out_features`), a type, or a missing field."""
    where = f"`{model_path(path)}`"
    exp_leaf = isinstance(expected, jax.ShapeDtypeStruct)
    got_leaf = _is_param(got)
    if exp_leaf and got_leaf:
        if tuple(got.shape) == tuple(expected.shape):
            return []
        return [
            f"{where} has shape {tuple(got.shape)}, where the EMA keeps an average "
            f"of shape {tuple(expected.shape)}"
        ]
    if exp_leaf or got_leaf or type(got) is not type(expected):
        return [f"{where} is {_what(got)}, where the EMA's model had {_what(expected)}"]
    out = []
    if dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            if not f.metadata.get("static", False):
                continue
            a, b = getattr(expected, f.name, None), getattr(got, f.name, None)
            if not _same(a, b):
                out.append(
                    f"`{model_path(path)}.{f.name}` is {b!r}, where "
                    f"the EMA's model had {a!r}"
                )
    mine, theirs = _children(expected), _children(got)
    if [k for k, _ in mine] != [k for k, _ in theirs]:
        keys = [jax.tree_util.keystr(k) for k, _ in theirs]
        want = [jax.tree_util.keystr(k) for k, _ in mine]
        return [
            *out,
            f"{where} holds {', '.join(keys) or 'nothing'}, where the EMA's model "
            f"held {', '.join(want) or 'nothing'}",
        ]
    for (key, e), (_, g) in zip(mine, theirs):
        out += _differences(e, g, (*path, *key))
    return out


def _children(x: Any) -> list[tuple[tuple, Any]]:
    """`x`'s children with their keys (one level of the pytree)."""
    if x is None:
        return []
    return jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 -- an `==` that is not a bool
        return False


def _what(x: Any) -> str:
    if x is None:
        return "None (no parameter)"
    if isinstance(x, jax.ShapeDtypeStruct) or _is_param(x):
        return f"a parameter of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def _kv_cache_hint(model: Any, treedef: Any) -> str:
    """The fix when the parameters match in number and the model holds KV caches
    (added by `with_kv_cache` after the EMA was built)."""
    if jax.tree_util.tree_structure(params(model)).num_leaves != treedef.num_leaves:
        return ""
    leaves = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, KVCache))
    if any(isinstance(x, KVCache) for x in leaves):
        return (
            " The parameters match, but this model holds KV caches (added by "
            "`es.nn.with_kv_cache`) where the EMA's model held none: average the "
            "model without them and add them after, e.g. `es.nn.with_kv_cache("
            "ema.averaged(es.nn.without_kv_cache(model)), max_len)`."
        )
    return ""


def _lerp(h: Array, x: Array, w: Array) -> Array:
    """`h + w (x - h)`, computed as `torch.lerp` does (from the nearer end)."""
    return jnp.where(w < 0.5, h + w * (x - h), x - (x - h) * (1 - w))


def _accumulation_dtype(param_dtype: Any, requested: Any) -> Any:
    if requested is not None:
        return jnp.dtype(requested)
    if jnp.issubdtype(param_dtype, jnp.floating) and jnp.finfo(param_dtype).bits < 32:
        return jnp.dtype(jnp.float32)
    return jnp.dtype(param_dtype)


def _rebuild_ema(cls: type, state: dict, template: Any) -> Any:
    """An `EMA` from its fields and a template of its structure (`EMA.__reduce__`)."""
    new = object.__new__(cls)
    for name, value in state.items():
        object.__setattr__(new, name, value)
    object.__setattr__(new, "treedef", jax.tree_util.tree_structure(template))
    return new
