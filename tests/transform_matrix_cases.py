"""The transform-safety matrix: every stateful layer and metric x every JAX
transformation x both storage modes.

This module declares the matrix. It is shared by

* `tests/test_transform_matrix.py` (one test per cell, single device),
* `tests/multidevice/test_matrix_sharded.py` (the sharded-`jit` column, 4 devices),
* `tests/matrix_report.py` (writes `docs/transform-matrix.md` from the declared
  expectations; `test_transform_matrix.py` checks that the committed page agrees).

A *case* is one layer (or metric) at a tiny size: a factory, an input, and one
state-writing call in training mode whose output has the input's shape (so calls
can be chained: scan over layers, `lax.switch` with two calls). A *transform* runs
the case's call under one JAX transformation and returns the outputs, the model
after the call, and the reference: the same calls run eagerly without the
transformation (sequential calls in ref mode, `es.apply` in value mode). A cell
passes when state (and output) equal the reference, or when it is declared as an
error and raises that error with a message naming the fix. A silently lost or
doubled write is a failing cell.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_state as es


MODES = ("value", "ref")
T = 3  # calls in the scan / while_loop over time
E = 2  # ensemble members
L = 2  # stacked layers
AXIS = "batch"


# --------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One stateful layer or metric at a tiny size.

    - `make(key, axis_name)`: a value-mode model. With `axis_name` set, the variant
      used per example (under `vmap(..., axis_name=...)`).
    - `call(model, x)`: one training-mode call that writes state; returns an array
      of `x`'s shape.
    - `x_shape`: the shape of one input (its leading axis is the batch, except for
      sequence layers where it is the sequence; `per_example` says which).
    - `per_example`: whether the per-example call `call(model, x[i])` is meaningful
      (the leading axis is a batch). If not, the per-example columns map over a
      batch of whole inputs instead.
    """

    name: str
    make: Callable[..., Any]
    call: Callable[[Any, jax.Array], jax.Array]
    x_shape: tuple[int, ...]
    per_example: bool = True
    note: str = ""


def _labels(x: jax.Array) -> jax.Array:
    # deterministic labels in {0, 1, 2} derived from the input (so every call,
    # batched or per example, sees its own labels)
    return jnp.floor(jnp.abs(x[..., 0]) * 7.0).astype(jnp.int32) % 3


def _bn_make(key, axis_name=None):
    del key
    return es.nn.BatchNorm(3, channel_axis=-1, axis_name=axis_name)


def _counter_call(m, x):
    count = m.increment()
    return x * count.astype(x.dtype)


class _Averaged(eqx.Module):
    net: eqx.nn.Linear
    ema: es.nn.EMA

    def __init__(self, key):
        self.net = eqx.nn.Linear(3, 3, key=key)
        self.ema = es.nn.EMA(self.net, decay=0.5)


def _ema_call(m, x):
    m.ema.update(m.net)
    y = m.net(x) if x.ndim == 1 else jax.vmap(m.net)(x)
    return y + jnp.sum(m.ema.average.weight)


def _sn_make(key, axis_name=None):
    del axis_name
    k1, k2 = jax.random.split(key)
    return es.nn.SpectralNorm(eqx.nn.Linear(3, 3, key=k1), key=k2)


def _rn_make(key, axis_name=None):
    del key
    return es.nn.RunningNorm(3, axis_name=axis_name)


def _dropout_make(key, axis_name=None):
    del axis_name
    return es.nn.Dropout(0.5, key=key)


def _second_rng(pair):
    return pair[1].rng


def _first_rng(pair):
    return pair[0].rng


class _SharedStream(eqx.Module):
    """Two Dropouts drawing from one stream, declared with `eqx.nn.Shared`."""

    shared: eqx.nn.Shared

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        pair = (es.nn.Dropout(0.5, key=k1), es.nn.Dropout(0.5, key=k2))
        self.shared = eqx.nn.Shared(pair, _second_rng, _first_rng)

    def __call__(self, x):
        first, second = self.shared()
        return second(first(x))


def _kv_make(key, axis_name=None):
    del key, axis_name
    return es.nn.KVCache(max_len=16, num_heads=2, head_dim=2)


def _kv_call(m, x):
    _, keys, _ = m.append(x, 2.0 * x)
    return x + jnp.mean(keys)


def _attn_make(key, axis_name=None):
    del axis_name
    return es.nn.CausalSelfAttention(4, num_heads=2, max_len=16, key=key)


def _metric_case(name, make, update):
    def call(m, x):
        update(m, x)
        return x

    return Case(name, make, call, (4, 3))


CASES: tuple[Case, ...] = (
    Case("BatchNorm", _bn_make, lambda m, x: m(x), (4, 3)),
    Case("Counter", lambda key, axis_name=None: es.nn.Counter(), _counter_call, (4, 3)),
    Case("EMA", lambda key, axis_name=None: _Averaged(key), _ema_call, (4, 3)),
    Case("SpectralNorm", _sn_make, lambda m, x: m(x), (4, 3)),
    Case("RunningNorm", _rn_make, lambda m, x: m(x), (4, 3)),
    Case("Dropout", _dropout_make, lambda m, x: m(x), (4, 3)),
    Case(
        "Dropout x2, one Rng",
        lambda key, axis_name=None: _SharedStream(key),
        lambda m, x: m(x),
        (4, 3),
        note="two Dropout layers sharing one `Rng` stream, declared with "
        "`eqx.nn.Shared`",
    ),
    Case("KVCache", _kv_make, _kv_call, (4, 2, 2), per_example=False),
    Case(
        "Record",
        lambda key, axis_name=None: es.nn.Record(
            "mean", "std", "max_abs", "dead_fraction", axis_name=axis_name
        ),
        lambda m, x: m(x),
        (4, 3),
    ),
    Case(
        "Capture",
        lambda key, axis_name=None: es.nn.Capture((4, 3), axis_name=axis_name),
        lambda m, x: m(x),
        (4, 3),
        note="per example: `axis_name` gathers the examples",
    ),
    Case(
        "CausalSelfAttention",
        _attn_make,
        lambda m, x: m(x),
        (4, 4),
        per_example=False,
        note="with a KVCache (decoding)",
    ),
    _metric_case(
        "metrics.Mean",
        lambda key, axis_name=None: es.metrics.Mean(axis_name=axis_name),
        lambda m, x: m.update(x),
    ),
    _metric_case(
        "metrics.Accuracy",
        lambda key, axis_name=None: es.metrics.Accuracy(axis_name=axis_name),
        lambda m, x: m.update(x, _labels(x)),
    ),
    _metric_case(
        "metrics.MeanStd",
        lambda key, axis_name=None: es.metrics.MeanStd(axis_name=axis_name),
        lambda m, x: m.update(x),
    ),
    _metric_case(
        "metrics.ConfusionMatrix",
        lambda key, axis_name=None: es.metrics.ConfusionMatrix(3, axis_name=axis_name),
        lambda m, x: m.update(x, _labels(x)),
    ),
)
CASE_BY_NAME = {c.name: c for c in CASES}


# ---------------------------------------------------------------------- utilities


def _is_ref(x: Any) -> bool:
    return isinstance(x, jax.Ref)


def _array_or_ref(x: Any) -> bool:
    return eqx.is_array(x) or _is_ref(x)


def state_of(model: Any) -> list[np.ndarray]:
    """The values of every state cell of `model` (either mode), in tree order."""
    cells = [x for x in jax.tree.leaves(model, is_leaf=es.is_state) if es.is_state(x)]
    return [np.asarray(c[...]) for c in cells]


def params_of(model: Any) -> list[np.ndarray]:
    return [np.asarray(p) for p in jax.tree.leaves(es.params(model))]


def split_params(model: Any) -> tuple[Any, Any]:
    """`(params, rest)`: the trainable parameters and everything else (cells,
    Python fields), so that `eqx.combine(params, rest, is_leaf=es.is_state)` is the
    model again."""
    p = es.params(model)
    rest = eqx.filter(model, lambda x: not eqx.is_inexact_array(x), is_leaf=es.is_state)
    return p, rest


def combine(p: Any, rest: Any) -> Any:
    return eqx.combine(p, rest, is_leaf=es.is_state)


PREPARED: list[tuple[Any, Any]] = []  # (value-mode source, ref-mode model) per cell


def prepare(model: Any, mode: str) -> Any:
    """The model in `mode`. Ref-mode models are remembered in `PREPARED`, so that a
    failing cell can check that the error left their state untouched."""
    if mode == "value":
        return model
    refs = es.to_refs(model)
    PREPARED.append((model, refs))
    return refs


def inputs(case: Case, n: int = T, seed: int = 1) -> jax.Array:
    """`n` inputs of the case's shape."""
    return jax.random.normal(jax.random.key(seed), (n, *case.x_shape))


@functools.cache
def model_key(i: int = 0) -> jax.Array:
    return jax.random.key(100 + i)


@functools.cache
def base_model(case_name: str, i: int = 0, axis_name: str | None = None) -> Any:
    """The value-mode model (cached: value-mode models are immutable, and no
    transform here donates)."""
    return CASE_BY_NAME[case_name].make(model_key(i), axis_name)


@functools.cache
def reference(
    case_name: str, n: int, i: int = 0, seed: int = 1
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The reference run: `n` eager calls, in ref mode, on inputs `inputs(case)[:n]`
    of a fresh model `i`. Returns `(outputs, state)`."""
    case = CASE_BY_NAME[case_name]
    model = es.to_refs(base_model(case_name, i))
    xs = inputs(case, seed=seed)
    outs = [np.asarray(case.call(model, xs[t])) for t in range(n)]
    return outs, state_of(model)


@functools.cache
def reference_value_mode(case_name: str, n: int) -> tuple[list, list]:
    """The reference run in value mode: `n` eager `es.apply` calls."""
    case = CASE_BY_NAME[case_name]
    model = base_model(case_name)
    xs = inputs(case)
    outs = []
    for t in range(n):
        y, model = es.apply(case.call, model, xs[t])
        outs.append(np.asarray(y))
    return outs, state_of(model)


def _loss(y: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(y))


@functools.cache
def reference_grads(case_name: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """Gradients of `sum(call(model, x) ** 2)` with respect to `(params, x)`,
    computed with `es.apply` *inside* the differentiated function (a different
    path from the cells, which differentiate inside `es.apply` / in ref mode)."""
    case = CASE_BY_NAME[case_name]
    p, rest = split_params(base_model(case_name))
    x = inputs(case)[0]

    def loss(p, x):
        y, _ = es.apply(case.call, combine(p, rest), x)
        return _loss(y)

    gp, gx = jax.grad(loss, argnums=(0, 1))(p, x)
    return np.asarray(gx), [np.asarray(g) for g in jax.tree.leaves(gp)]


# --------------------------------------------------------------------- transforms


@dataclasses.dataclass
class Result:
    """What a transform cell produced, and what it must equal."""

    outputs: list[Any]
    model: Any  # the model after the call(s); read its state with `state_of`
    ref_outputs: list[Any] | None
    ref_state: list[np.ndarray]
    ref_params: list[np.ndarray] | None = None
    grads: tuple[Any, Any] | None = None  # (d/dx, d/dparams leaves)
    loss: Any = None


def _single_ref(case: Case, n: int) -> tuple[list, list]:
    return reference(case.name, n)


def _params0(case: Case) -> list[np.ndarray]:
    return params_of(base_model(case.name))


def t_jit(case: Case, mode: str) -> Result:
    """`jax.jit` over a partitioned model: arrays as arguments, the rest (Python
    fields; in ref mode also the refs, which Equinox does not count as arrays)
    closed over. Two calls through one compiled function."""
    model = prepare(base_model(case.name), mode)
    arrays, static = eqx.partition(model, eqx.is_array)
    xs = inputs(case)

    if mode == "value":

        @jax.jit
        def f(arrays, x):
            y, new = es.apply(case.call, eqx.combine(arrays, static), x)
            return y, eqx.filter(new, eqx.is_array)

        ys = []
        for t in range(2):
            y, arrays = f(arrays, xs[t])
            ys.append(y)
        model = eqx.combine(arrays, static)
    else:

        @jax.jit
        def g(arrays, x):
            return case.call(eqx.combine(arrays, static), x)

        ys = [g(arrays, xs[t]) for t in range(2)]
    outs, st = _single_ref(case, 2)
    return Result(ys, model, outs, st, _params0(case))


def t_filter_jit(case: Case, mode: str) -> Result:
    """`eqx.filter_jit` of `es.apply` (value mode) or of the call (ref mode); two
    calls."""
    model = prepare(base_model(case.name), mode)
    xs = inputs(case)
    ys = []
    if mode == "value":
        f = eqx.filter_jit(lambda m, x: es.apply(case.call, m, x))
        for t in range(2):
            y, model = f(model, xs[t])
            ys.append(y)
    else:
        g = eqx.filter_jit(case.call)
        ys = [g(model, xs[t]) for t in range(2)]
    outs, st = _single_ref(case, 2)
    return Result(ys, model, outs, st, _params0(case))


def t_make_step(case: Case, mode: str) -> Result:
    """`es.make_step` with a zero learning rate (parameters must not move; state is
    written once per step); two steps."""
    model = prepare(base_model(case.name), mode)
    xs = inputs(case)
    step = es.make_step(
        lambda m, x: jnp.mean(jnp.square(case.call(m, x))),
        optax.sgd(0.0),
        donate=False,
    )
    opt_state = step.init(model)
    for t in range(2):
        model, opt_state = step(model, opt_state, xs[t])
    assert step.trace_count == 1
    _, st = _single_ref(case, 2)
    return Result([], model, None, st, _params0(case))


def t_make_apply(case: Case, mode: str) -> Result:
    """`es.make_apply` (the compiled `es.apply`, donating the state cells it
    replaces); two calls."""
    # a freshly built model: the call consumes the cells of the model passed in
    model = prepare(case.make(model_key(0), None), mode)
    xs = inputs(case)
    f = es.make_apply(case.call)
    ys = []
    for t in range(2):
        y, model = f(model, xs[t])
        ys.append(y)
    outs, st = _single_ref(case, 2)
    return Result(ys, model, outs, st, _params0(case))


def _grad_fn(case: Case, wrap: Callable[[Callable], Callable] | None = None):
    """`(params, x) -> (loss, (d/dparams, d/dx))` of `sum(call(model, x) ** 2)`;
    `wrap` (e.g. `jax.checkpoint`) wraps `(params, x) -> output`."""

    def fn(model, x):
        p, rest = split_params(model)

        def out(p, x):
            return case.call(combine(p, rest), x)

        f = out if wrap is None else wrap(out)
        return jax.value_and_grad(lambda p, x: _loss(f(p, x)), argnums=(0, 1))(p, x)

    return fn


def _grad_result(case: Case, mode: str, fn: Callable) -> Result:
    model = prepare(base_model(case.name), mode)
    x = inputs(case)[0]
    if mode == "value":
        (loss, (gp, gx)), model = es.apply(fn, model, x)
    else:
        loss, (gp, gx) = fn(model, x)
    outs, st = _single_ref(case, 1)
    return Result(
        [],
        model,
        None,
        st,
        _params0(case),
        grads=(gx, jax.tree.leaves(gp)),
        loss=(loss, _loss(jnp.asarray(outs[0]))),
    )


def t_grad(case: Case, mode: str) -> Result:
    """`jax.value_and_grad` of a loss of the layer output, with respect to the
    parameters and the input (inside `es.apply` in value mode)."""
    return _grad_result(case, mode, _grad_fn(case))


def t_remat(case: Case, mode: str) -> Result:
    """`jax.checkpoint` of the call, without differentiation."""
    model = prepare(base_model(case.name), mode)
    x = inputs(case)[0]

    def fn(model, x):
        p, rest = split_params(model)
        return jax.checkpoint(lambda p, x: case.call(combine(p, rest), x))(p, x)

    if mode == "value":
        y, model = es.apply(fn, model, x)
    else:
        y = fn(model, x)
    outs, st = _single_ref(case, 1)
    return Result([y], model, outs, st, _params0(case))


def t_remat_grad(case: Case, mode: str) -> Result:
    """`jax.value_and_grad` through `jax.checkpoint` (remat replays the forward
    pass: the write must still land once)."""
    return _grad_result(case, mode, _grad_fn(case, jax.checkpoint))


def t_filter_remat(case: Case, mode: str) -> Result:
    """`eqx.filter_checkpoint` of the call on the whole model, without
    differentiation."""
    model = prepare(base_model(case.name), mode)
    x = inputs(case)[0]
    f = eqx.filter_checkpoint(case.call)
    if mode == "value":
        y, model = es.apply(f, model, x)
    else:
        y = f(model, x)
    outs, st = _single_ref(case, 1)
    return Result([y], model, outs, st, _params0(case))


def t_filter_remat_grad(case: Case, mode: str) -> Result:
    """`jax.value_and_grad` through `eqx.filter_checkpoint`."""
    return _grad_result(case, mode, _grad_fn(case, eqx.filter_checkpoint))


@functools.cache
def ensemble(case_name: str, n: int = E) -> Any:
    """`n` independent models stacked on a leading axis (built with
    `eqx.filter_vmap`); member `i` equals `base_model(case_name, i)`."""
    case = CASE_BY_NAME[case_name]
    keys = jnp.stack([model_key(i) for i in range(n)])
    return eqx.filter_vmap(lambda k: case.make(k, None))(keys)


def _ensemble_reference(case: Case, n_members: int, chain: bool = False):
    """Member `i` run eagerly on input `i` (or, with `chain`, the output of member
    `i - 1`), states stacked."""
    xs = inputs(case, n=n_members, seed=2)
    outs, states = [], []
    h = xs[0]
    for i in range(n_members):
        m = es.to_refs(base_model(case.name, i))
        y = case.call(m, h if chain else xs[i])
        outs.append(np.asarray(y))
        states.append(state_of(m))
        h = y
    stacked = [np.stack(s) for s in zip(*states)]
    return (outs[-1:] if chain else [np.stack(outs)]), stacked, xs


def t_vmap_ensemble(case: Case, mode: str) -> Result:
    """`jax.vmap` over an ensemble of models with batched state: arrays (and, in ref
    mode, the batched refs) mapped on axis 0, everything else closed over. Value
    mode runs `es.apply` per member."""
    ens = prepare(ensemble(case.name), mode)
    outs, st, xs = _ensemble_reference(case, E)
    if mode == "value":
        arrays, static = eqx.partition(ens, eqx.is_array)

        def member(a, x):
            y, new = es.apply(case.call, eqx.combine(a, static), x)
            return y, eqx.filter(new, eqx.is_array)

        y, arrays = jax.vmap(member)(arrays, xs)
        ens = eqx.combine(arrays, static)
    else:
        dyn, static = eqx.partition(ens, _array_or_ref, is_leaf=_is_ref)
        y = jax.vmap(lambda d, x: case.call(eqx.combine(d, static), x))(dyn, xs)
    return Result([y], ens, outs, st)


def t_filter_vmap(case: Case, mode: str) -> Result:
    """`eqx.filter_vmap` over an ensemble with its default `in_axes` (arrays mapped;
    refs are not arrays to Equinox, so in ref mode they are passed unmapped)."""
    ens = prepare(ensemble(case.name), mode)
    outs, st, xs = _ensemble_reference(case, E)
    if mode == "value":
        y, ens = eqx.filter_vmap(lambda m, x: es.apply(case.call, m, x))(ens, xs)
    else:
        y = eqx.filter_vmap(case.call)(ens, xs)
    return Result([y], ens, outs, st)


def _per_example_setup(case: Case, mode: str):
    """The per-example model (built with `axis_name`), the batch to map over, and
    the batched reference."""
    model = prepare(base_model(case.name, 0, AXIS), mode)
    x = inputs(case)[0]
    if case.per_example:
        batch = x
        outs, st = reference(case.name, 1)
    else:  # map over a batch of two whole inputs
        batch = jnp.stack([x, x + 1.0])
        outs, st = None, []
    return model, batch, outs, st


def t_vmap_per_example(case: Case, mode: str) -> Result:
    """Plain `jax.vmap(..., axis_name=...)` of per-example calls (Equinox's
    BatchNorm style) of one unbatched model."""
    model, batch, outs, st = _per_example_setup(case, mode)

    def fn(m, x):
        return jax.vmap(lambda xi: case.call(m, xi), axis_name=AXIS)(x)

    if mode == "value":
        y, model = es.apply(fn, model, batch)
    else:
        y = fn(model, batch)
    return Result([y], model, outs, st)


def t_es_vmap(case: Case, mode: str) -> Result:
    """`es.vmap(..., axis_name=...)` of per-example calls: layers that reduce over
    the axis (or write the same value from every example) write once."""
    model, batch, outs, st = _per_example_setup(case, mode)

    def fn(m, x):
        return es.vmap(case.call, in_axes=(None, 0), axis_name=AXIS)(m, x)

    if mode == "value":
        y, model = es.apply(fn, model, batch)
    else:
        y = fn(model, batch)
    return Result([y], model, outs, st)


def t_scan_time(case: Case, mode: str) -> Result:
    """`lax.scan` over `T` inputs, one call per iteration: inside `es.apply`
    (value mode) or under `eqx.filter_jit` (ref mode)."""
    model = prepare(base_model(case.name), mode)
    xs = inputs(case)

    def fn(m, xs):
        return jax.lax.scan(lambda c, x: (c, case.call(m, x)), None, xs)[1]

    if mode == "value":
        y, model = es.apply(fn, model, xs)
    else:
        y = eqx.filter_jit(fn)(model, xs)
    outs, st = _single_ref(case, T)
    return Result([y], model, [np.stack(outs)], st, _params0(case))


def _layer_view(stacked: Any, i: Any) -> Any:
    """Layer `i` of a stacked ref-mode model inside a trace: parameters sliced,
    cells holding ref views `ref.at[i]`."""

    def one(x):
        if es.is_state(x):
            return type(x)(x.value.at[i])
        if eqx.is_array(x):
            return x[i]
        return x

    return jax.tree.map(one, stacked, is_leaf=es.is_state)


def t_scan_layers(case: Case, mode: str) -> Result:
    """`lax.scan` over a stack of `L` layers (scan-over-layers), each layer's output
    the next one's input. Value mode: scan over the stacked arrays with `es.apply`
    in the body, returning each layer's new state as the scan output. Ref mode:
    the stacked refs are passed to `jax.jit` and each layer reads and writes ref
    views `ref.at[i]`."""
    stacked = prepare(ensemble(case.name, L), mode)
    outs, st, xs = _ensemble_reference(case, L, chain=True)
    x = xs[0]
    if mode == "value":
        arrays, static = eqx.partition(stacked, eqx.is_array)

        def body(h, a):
            y, new = es.apply(case.call, eqx.combine(a, static), h)
            return y, eqx.filter(new, eqx.is_array)

        y, arrays = jax.lax.scan(body, x, arrays)
        stacked = eqx.combine(arrays, static)
    else:
        dyn, static = eqx.partition(stacked, _array_or_ref, is_leaf=_is_ref)

        @jax.jit
        def run(dyn, x):
            m = eqx.combine(dyn, static)
            body = lambda h, i: (case.call(_layer_view(m, i), h), None)  # noqa: E731
            return jax.lax.scan(body, x, jnp.arange(L))[0]

        y = run(dyn, x)
    return Result([y], stacked, outs, st)


def _scan_partitioned(case: Case, mode: str, filter_spec: Callable) -> Result:
    stacked = prepare(ensemble(case.name, L), mode)
    outs, st, xs = _ensemble_reference(case, L, chain=True)

    def fn(m, x):
        dynamic, static = eqx.partition(m, filter_spec)

        def body(h, layer):
            return case.call(eqx.combine(layer, static), h), None

        return jax.lax.scan(body, x, dynamic)[0]

    if mode == "value":
        y, stacked = es.apply(fn, stacked, xs[0])
    else:
        y = fn(stacked, xs[0])  # eagerly: `lax.scan` slices the concrete refs
    return Result([y], stacked, outs, st)


def t_scan_layers_eqx(case: Case, mode: str) -> Result:
    """Scan over layers with Equinox's idiom verbatim: `dynamic, static =
    eqx.partition(stack, eqx.is_array)`, `lax.scan` over `dynamic`,
    `eqx.combine(layer, static)` in the body (inside `es.apply` in value mode,
    eagerly in ref mode). Refs are not arrays to Equinox: they stay whole in the
    static half."""
    return _scan_partitioned(case, mode, eqx.is_array)


def t_scan_layers_es(case: Case, mode: str) -> Result:
    """The same idiom with `eqx.partition(stack, es.is_array_or_ref)`: refs count as
    arrays, so `lax.scan` gives each layer its own slice of every state ref."""
    return _scan_partitioned(case, mode, es.is_array_or_ref)


def _jit_in_mode(fn: Callable, mode: str) -> Callable:
    """`eqx.filter_jit` of `es.apply(fn, ...)` (value mode) or of `fn` (ref mode):
    `(model, *args) -> (out, model)`."""
    if mode == "value":
        return eqx.filter_jit(lambda m, *a: es.apply(fn, m, *a))
    g = eqx.filter_jit(fn)
    return lambda m, *a: (g(m, *a), m)


def t_cond(case: Case, mode: str) -> Result:
    """`lax.cond`: the call in the true branch only. Run with `True` (one write),
    then `False` (no write), through one compiled function."""
    model = prepare(base_model(case.name), mode)
    xs = inputs(case)

    def fn(m, x, pred):
        return jax.lax.cond(pred, lambda x: case.call(m, x), lambda x: x, x)

    f = _jit_in_mode(fn, mode)
    y1, model = f(model, xs[0], jnp.array(True))
    y2, model = f(model, xs[1], jnp.array(False))
    outs, st = _single_ref(case, 1)
    return Result([y1, y2], model, [outs[0], xs[1]], st, _params0(case))


def t_vmap_cond(case: Case, mode: str) -> Result:
    """`lax.cond` under `jax.vmap` over an ensemble whose members take different
    branches (a batched predicate): the call in the true branch only, inside
    `es.apply` in both modes."""
    ens = prepare(ensemble(case.name), mode)
    outs, st, xs = _ensemble_reference(case, E)
    dyn, static = eqx.partition(ens, es.is_array_or_ref)
    preds = jnp.arange(E) % 2 == 0

    def fn(d, xs, preds):
        def member(d, x, pred):
            m = eqx.combine(d, static)
            return jax.lax.cond(pred, lambda x: case.call(m, x), lambda x: x, x)

        return jax.vmap(member)(d, xs, preds)

    y, dyn = es.apply(fn, dyn, xs, preds)
    return Result([y], eqx.combine(dyn, static), outs, st)


def t_switch(case: Case, mode: str) -> Result:
    """`lax.switch` over three branches (no call, one call, two calls). Run with
    index 0 (no write), then 2 (two writes)."""
    model = prepare(base_model(case.name), mode)
    xs = inputs(case)

    def fn(m, x0, x1, index):
        branches = [
            lambda x0, x1: x1,
            lambda x0, x1: case.call(m, x0),
            lambda x0, x1: (case.call(m, x0), case.call(m, x1))[1],
        ]
        return jax.lax.switch(index, branches, x0, x1)

    f = _jit_in_mode(fn, mode)
    y1, model = f(model, xs[0], xs[1], jnp.array(0))
    y2, model = f(model, xs[0], xs[1], jnp.array(2))
    outs, st = _single_ref(case, 2)
    return Result([y1, y2], model, [xs[1], outs[1]], st, _params0(case))


def t_while_loop(case: Case, mode: str) -> Result:
    """`lax.while_loop` with `T` iterations, one call each (on input `t`)."""
    model = prepare(base_model(case.name), mode)
    xs = inputs(case)

    def fn(m, xs):
        def body(carry):
            t, _ = carry
            return t + 1, case.call(m, xs[t])

        return jax.lax.while_loop(lambda c: c[0] < T, body, (0, xs[0]))[1]

    y, model = _jit_in_mode(fn, mode)(model, xs)
    outs, st = _single_ref(case, T)
    return Result([y], model, [outs[-1]], st, _params0(case))


TRANSFORMS: dict[str, Callable[[Case, str], Result]] = {
    "jit": t_jit,
    "filter_jit": t_filter_jit,
    "make_step": t_make_step,
    "make_apply": t_make_apply,
    "grad": t_grad,
    "checkpoint": t_remat,
    "checkpoint+grad": t_remat_grad,
    "filter_checkpoint": t_filter_remat,
    "filter_checkpoint+grad": t_filter_remat_grad,
    "vmap (ensemble)": t_vmap_ensemble,
    "filter_vmap (ensemble)": t_filter_vmap,
    "vmap (per example)": t_vmap_per_example,
    "es.vmap (per example)": t_es_vmap,
    "scan (time)": t_scan_time,
    "scan (layers)": t_scan_layers,
    "scan (layers, eqx.is_array)": t_scan_layers_eqx,
    "scan (layers, es.is_array_or_ref)": t_scan_layers_es,
    "cond": t_cond,
    "vmap of cond": t_vmap_cond,
    "switch": t_switch,
    "while_loop": t_while_loop,
}
SHARDED = "sharded jit (4 devices)"
COLUMNS = (*TRANSFORMS, SHARDED)


# ------------------------------------------------------------------- expectations


@dataclasses.dataclass(frozen=True)
class Raises:
    """A documented error: the exception type, a regex its message must match (the
    part that names the fix), and a short reason for the docs."""

    exc: type[BaseException]
    match: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Known:
    """A known defect, found by this matrix and reported: the cell fails today (a
    strict `xfail`, so it turns into a failure the day it is fixed, and the
    expectation must then be updated). `reason` says what goes wrong."""

    reason: str
    silent: bool = False  # wrong state or outputs without an error


OK = None

_PLAIN_VMAP = Raises(
    es.StateWriteError,
    r"eqx_state\.vmap",
    "JAX cannot write inside `jax.vmap` into an unbatched cell; the error names "
    "`es.vmap`",
)
_PLAIN_VMAP_RNG = Raises(
    es.StateWriteError,
    r"call the layer on the whole batch",
    "one stream cannot give every example its own key; the error says to call "
    "Dropout on the whole batch (or to use an ensemble, or explicit keys)",
)
_DIFFERENT_ROWS = Raises(
    Exception,  # `eqx.error_if`'s runtime error
    r"wrote different values into one state cell",
    "every sequence writes its own keys into the one cache; the error says to "
    "keep per-example state in a batched cell (an ensemble of caches)",
)
_UNSLICED_REF = Raises(
    es.StateError,
    r"eqx\.partition\(model, es\.is_array_or_ref\)",
    "Equinox treats refs as static (`eqx.is_array` is False for a `jax.Ref`), so "
    "the transformation slices the model's arrays but hands every layer the whole "
    "stacked ref; the cell's shape witness (an array, sliced with the others) "
    "catches the mismatch at the first read or write and the error names "
    "`eqx.partition(model, es.is_array_or_ref)` ([[scan (layers, es.is_array_or_ref)]])",
)
_VMAP_COND = Raises(
    NotImplementedError,
    r"jnp\.where\(pred, new, cell\[\.\.\.\]\)",
    "JAX cannot `vmap` a `lax.cond` whose predicate is batched when a branch writes "
    "state; the error (JAX's, with a note added inside `es.apply` and steps) says to "
    "compute both values and write once with `jnp.where`",
)
_ES_VMAP_RNG = Raises(
    es.StateWriteError,
    r"inside `es.vmap` without `axis_name`",
    "every example would draw the same key from the one stream (the same mask); "
    "the error says to map with `es.vmap(..., axis_name=name)` and build the "
    "layer with `axis_name=name`, or to call it on the whole batch",
)


def expectation(case_name: str, column: str, mode: str) -> Raises | Known | None:
    """The declared outcome of one cell: `OK` (state equals the reference), a
    documented error (`Raises`), or a known defect (`Known`)."""
    case = CASE_BY_NAME[case_name]
    if column == "scan (layers, eqx.is_array)":
        return _UNSLICED_REF
    if column == "vmap of cond":
        return _VMAP_COND
    if column == "vmap (per example)":
        # JAX refuses any write into an unbatched ref inside `jax.vmap`, even of a
        # value that does not depend on the example (a counter increment).
        return _PLAIN_VMAP_RNG if "Dropout" in case_name else _PLAIN_VMAP
    if column == "es.vmap (per example)":
        if not case.per_example:
            return _DIFFERENT_ROWS
        if "Dropout" in case_name:
            return _ES_VMAP_RNG
        return OK
    if column == "filter_vmap (ensemble)" and mode == "ref":
        return _UNSLICED_REF
    return OK


def cells() -> list[tuple[str, str, str]]:
    """Every single-device cell `(case, column, mode)`."""
    return [(c.name, t, m) for c in CASES for t in TRANSFORMS for m in MODES]


# ---------------------------------------------------------------------- checking


def _assert_equal(got: Any, want: Any, what: str, rtol: float = 2e-5) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if np.issubdtype(want.dtype, np.inexact):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-5, err_msg=what)
    else:  # counts, cursors, keys: exactly
        np.testing.assert_array_equal(got, want, err_msg=what)


def check_result(res: Result, case: Case) -> None:
    """State (and outputs, parameters, gradients) equal the reference."""
    got = state_of(res.model)
    assert len(got) == len(res.ref_state), "the model lost or gained state cells"
    for k, (g, w) in enumerate(zip(got, res.ref_state)):
        _assert_equal(g, w, f"{case.name}: state cell {k}")
    if res.ref_outputs is not None:
        assert len(res.outputs) == len(res.ref_outputs)
        for k, (g, w) in enumerate(zip(res.outputs, res.ref_outputs)):
            _assert_equal(g, w, f"{case.name}: output {k}")
    if res.ref_params is not None:
        for k, (g, w) in enumerate(zip(params_of(res.model), res.ref_params)):
            _assert_equal(g, w, f"{case.name}: parameter {k}")
    if res.grads is not None:
        gx, gp = res.grads
        want_gx, want_gp = reference_grads(case.name)
        _assert_equal(gx, want_gx, f"{case.name}: d loss / d x", rtol=1e-4)
        assert len(gp) == len(want_gp)
        for k, (g, w) in enumerate(zip(gp, want_gp)):
            _assert_equal(g, w, f"{case.name}: d loss / d param {k}", rtol=1e-4)
    if res.loss is not None:
        _assert_equal(res.loss[0], res.loss[1], f"{case.name}: loss")


def run_cell(case_name: str, column: str, mode: str) -> None:
    """Run one single-device cell and check it against its declared expectation:
    equal to the reference, or the documented error, raised before any state
    changed (ref mode: the refs still hold their initial values)."""
    import pytest

    case = CASE_BY_NAME[case_name]
    exp = expectation(case_name, column, mode)
    transform = TRANSFORMS[column]
    PREPARED.clear()
    if not isinstance(exp, Raises):  # OK, or a known defect (a strict xfail)
        check_result(transform(case, mode), case)
        return
    with pytest.raises(exp.exc, match=exp.match):
        transform(case, mode)
    for source, refs in PREPARED:
        for k, (g, w) in enumerate(zip(state_of(refs), state_of(source))):
            _assert_equal(g, w, f"{case_name}: state cell {k} after the error")


# ------------------------------------------------------------------------- report


def _first_paragraph(fn: Callable) -> str:
    doc = (fn.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in doc.splitlines())


def _sharded_doc() -> str:
    return (
        "`jit` on a 4-device CPU mesh (`tests/multidevice/test_matrix_sharded.py`, "
        "run in a subprocess by `tests/test_multidevice.py`): the model replicated "
        "and the batch sharded over the devices, two calls, equal to the same "
        "calls on one device, with the state replicated. Sequence layers: one "
        "call of an ensemble of one cache per sequence, state and inputs sharded "
        "over the members."
    )


def _labels_of_columns() -> dict[str, str]:
    return {c: f"T{k + 1}" for k, c in enumerate(COLUMNS)}


def _link_columns(text: str) -> str:
    """Replace `[[column name]]` by the column's label (`T9`)."""
    for column, label in _labels_of_columns().items():
        text = text.replace(f"[[{column}]]", label)
    assert "[[" not in text, text
    return text


_PATTERNS = (
    "**Equinox's filters and refs.** `eqx.is_array` is False for a `jax.Ref`, so "
    "Equinox's idioms that partition a model put state refs in the static half: "
    "scan-over-layers with `eqx.partition(stack, eqx.is_array)` "
    "([[scan (layers, eqx.is_array)]]) and `eqx.filter_vmap` with its default "
    "`in_axes` over a ref-mode ensemble ([[filter_vmap (ensemble)]]). Every such "
    "use raises, naming the fix: partition with `es.is_array_or_ref` (arrays and refs), "
    "which makes the idiom exact ([[scan (layers, es.is_array_or_ref)]]); for "
    "`eqx.filter_vmap`, `in_axes=(lambda x: 0 if es.is_array_or_ref(x) else None, 0)`, "
    "or `jax.vmap` over the partitioned model ([[vmap (ensemble)]]); a function "
    "that returns the model (a step) needs the latter, since `eqx.filter_vmap` "
    "cannot return refs (reading a model it returned says so). In value mode "
    "outside a step, cells hold arrays and every Equinox idiom works as usual.",
    "**Per-example calls** (Equinox's BatchNorm style): `es.vmap(..., "
    "axis_name=...)` with layers that reduce over the axis "
    "([[es.vmap (per example)]]). A plain `jax.vmap` cannot write any state "
    "([[vmap (per example)]]).",
    "**Scan over layers**: `eqx.partition(stack, es.is_array_or_ref)` and `lax.scan` over "
    "the dynamic half, in either mode, eagerly or under `jit` "
    "([[scan (layers, es.is_array_or_ref)]]). Indexing ref views `ref.at[i]` by hand also "
    "works ([[scan (layers)]]).",
    "**Caches are per sequence.** A batch of sequences decodes with a batch of "
    "caches (an ensemble: [[vmap (ensemble)]], [[sharded jit (4 devices)]]), not "
    "with one cache under `vmap` ([[vmap (per example)]], "
    "[[es.vmap (per example)]]).",
    "**Gradients and remat** ([[grad]] to [[filter_checkpoint+grad]]): writes "
    "carry no gradient, and `jax.checkpoint` under `grad` does not replay them: a "
    "counter counts one call once.",
    "**Shared state is declared.** A cell object placed at two positions of a "
    "model is two states (arrays are values, as in Equinox), under every way of "
    "running the model. One state used by several layers is declared with "
    "`eqx.nn.Shared` (the `Dropout x2, one Rng` row): its pytree holds the cell "
    "once, so every transformation sees one state.",
)


def render_markdown() -> str:
    """`docs/transform-matrix.md`, generated from the declared expectations (which
    the tests enforce cell by cell)."""
    labels = _labels_of_columns()
    found: list[Raises | Known] = []  # in order of first appearance
    grid = []
    counts = {m: {"ok": 0, "error": 0, "known": 0, "silent": 0} for m in MODES}
    for case in CASES:
        row = []
        for column in COLUMNS:
            pair = []
            for mode in MODES:
                exp = expectation(case.name, column, mode)
                if exp is OK:
                    counts[mode]["ok"] += 1
                elif isinstance(exp, Raises):
                    counts[mode]["error"] += 1
                else:
                    counts[mode]["known"] += 1
                    counts[mode]["silent"] += exp.silent
                if exp is not OK and exp not in found:
                    found.append(exp)
                pair.append(exp)
            row.append(pair)
        grid.append(row)
    # footnotes: documented errors first, then defects
    errors = [e for e in found if isinstance(e, Raises)]
    defects = [e for e in found if isinstance(e, Known)]
    notes = {e: f"E{k + 1}" for k, e in enumerate(errors)}
    notes.update({e: f"✗{k + 1}" for k, e in enumerate(defects)})

    def mark(exp: Raises | Known | None) -> str:
        return "✓" if exp is OK else notes[exp]

    rows = []
    for case, row in zip(CASES, grid):
        marks = []
        for value_exp, ref_exp in row:
            a, b = mark(value_exp), mark(ref_exp)
            marks.append(a if a == b else f"{a} / {b}")
        rows.append(f"| {case.name} | " + " | ".join(marks) + " |")
    total = {
        k: sum(counts[m][k] for m in MODES) for k in ("ok", "error", "known", "silent")
    }
    n_cells = total["ok"] + total["error"] + total["known"]
    silent_labels = ", ".join(notes[e] for e in defects if e.silent)

    out = [
        "# Transform-safety matrix",
        "",
        "<!-- Generated by `python tests/matrix_report.py` from the expectations "
        "declared in `tests/transform_matrix_cases.py`; do not edit by hand. "
        "`tests/core/test_transform_matrix.py` runs every cell (with the slow "
        "cases) and checks that this page agrees with them. -->",
        "",
        "Every stateful layer and metric, under every JAX transformation, in both "
        "storage modes (value mode: cells hold arrays, written inside `es.apply` / "
        "`es.make_step`; ref mode: `es.to_refs`). Each cell runs one small "
        "state-writing training call under the transformation and compares the "
        "state (and the outputs, parameters and gradients) with the same calls "
        "run eagerly without it. A cell is one of:",
        "",
        "* **✓**: the state equals the reference; every write lands exactly once.",
        "* **E*n***: a documented error; the call raises an error whose message "
        "names the fix (the test matches it), and nothing is written.",
        "* **✗*n***: a known defect found by this matrix (the test is a strict "
        "`xfail`, so it fails the day the defect is fixed); see the notes.",
        "",
        "A cell shows one mark when both modes agree, else `value / ref`.",
        "",
        "## Summary",
        "",
        "| | ✓ state exact | documented error | known defect | of which silent "
        "| cells |",
        "|---|---|---|---|---|---|",
    ]
    for m in MODES:
        c = counts[m]
        out.append(
            f"| {m} mode | {c['ok']} | {c['error']} | {c['known']} | {c['silent']} "
            f"| {c['ok'] + c['error'] + c['known']} |"
        )
    out.append(
        f"| **total** | **{total['ok']}** | **{total['error']}** | "
        f"**{total['known']}** | **{total['silent']}** | **{n_cells}** |"
    )
    out += [
        "",
        (
            f"Silent cells (wrong state or outputs, no error): {total['silent']}, "
            f"all known defects ({silent_labels}); every other cell either equals "
            "the reference or raises."
            if total["silent"]
            else "No cell loses or doubles a write silently."
        ),
        "",
        "## Matrix",
        "",
        "| layer | " + " | ".join(labels[c] for c in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
        *rows,
        "",
        "## Transformations",
        "",
        "| | transformation | what the cell runs |",
        "|---|---|---|",
    ]
    for column in COLUMNS:
        doc = (
            _sharded_doc()
            if column == SHARDED
            else _first_paragraph(TRANSFORMS[column])
        )
        out.append(f"| {labels[column]} | {column} | {doc} |")
    out += ["", "## Errors and defects", ""]
    for exp in errors:
        out.append(
            f"* **{notes[exp]}** (`{exp.exc.__name__}`, message matches "
            f"`{exp.match}`): {_link_columns(exp.reason)}."
        )
    for exp in defects:
        kind = "silent defect" if exp.silent else "defect"
        out.append(f"* **{notes[exp]}** ({kind}): {_link_columns(exp.reason)}.")
    out += ["", "## Patterns", ""]
    out += [f"* {_link_columns(p)}" for p in _PATTERNS]
    out += [
        "",
        "## Layers",
        "",
        "| layer | call | input |",
        "|---|---|---|",
    ]
    for case in CASES:
        what = case.note or "one training-mode call"
        out.append(f"| {case.name} | {what} | `{list(case.x_shape)}` |")
    out.append("")
    return "\n".join(out)
