"""The sharded-`jit` column of the transform-safety matrix (see
tests/transform_matrix_cases.py): every stateful layer and metric, in both modes,
called under `jit` with its batch sharded over a 4-device mesh, leaves the same
state (and outputs) as the same calls on one device, and the state is replicated.

Sequence layers (KVCache, cached attention) take one sequence per call, so their
data-parallel form is a batch of sequences with one cache each: an ensemble whose
stacked state and inputs are sharded over the members."""

import pathlib
import sys

import equinox as eqx
import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import transform_matrix_cases as M  # noqa: E402

import eqx_state as es  # noqa: E402


def _put(tree, sharding):
    # arrays only: Python fields (`inference`) stay Python values; an array reachable
    # twice (a tied cell) is placed once, so that it stays one array (a plain
    # `jax.tree.map(jax.device_put, ...)` would untie it)
    memo = {}

    def put(x):
        if not eqx.is_array(x):
            return x
        if id(x) not in memo:
            memo[id(x)] = (x, jax.device_put(x, sharding))
        return memo[id(x)][1]

    return jax.tree.map(put, tree)


def _batch_sharded(case, mode, replicated, batch):
    xs = M.inputs(case)
    model = M.prepare(_put(M.base_model(case.name), replicated), mode)
    ys = []
    if mode == "value":
        f = eqx.filter_jit(lambda m, x: es.apply(case.call, m, x))
        for t in range(2):
            y, model = f(model, jax.device_put(xs[t], batch))
            ys.append(y)
    else:
        g = eqx.filter_jit(case.call)
        ys = [g(model, jax.device_put(xs[t], batch)) for t in range(2)]
    assert len(ys[0].sharding.device_set) == 4
    outs, st = M.reference(case.name, 2)
    return M.Result(ys, model, outs, st, M.params_of(M.base_model(case.name)))


def _ensemble_sharded(case, mode, batch):
    n = 4
    ens = M.prepare(_put(M.ensemble(case.name, n), batch), mode)
    outs, st, xs = M._ensemble_reference(case, n)
    xs = jax.device_put(xs, batch)
    if mode == "value":
        arrays, static = eqx.partition(ens, eqx.is_array)

        @jax.jit
        def f(arrays, xs):
            def member(a, x):
                y, new = es.apply(case.call, eqx.combine(a, static), x)
                return y, eqx.filter(new, eqx.is_array)

            return jax.vmap(member)(arrays, xs)

        y, arrays = f(arrays, xs)
        ens = eqx.combine(arrays, static)
    else:
        dyn, static = eqx.partition(ens, M._array_or_ref, is_leaf=M._is_ref)

        @jax.jit
        def g(dyn, xs):
            return jax.vmap(lambda d, x: case.call(eqx.combine(d, static), x))(dyn, xs)

        y = g(dyn, xs)
    assert y.sharding.spec[0] == "data"
    return M.Result([y], ens, outs, st)


def _params():
    out = []
    for case in M.CASES:
        for mode in M.MODES:
            exp = M.expectation(case.name, M.SHARDED, mode)
            assert not isinstance(exp, M.Raises)  # no documented error in this column
            marks = (
                [pytest.mark.xfail(strict=True, reason=exp.reason)]
                if isinstance(exp, M.Known)
                else []
            )
            out.append(pytest.param(case.name, mode, marks=marks))
    return out


@pytest.mark.parametrize("case, mode", _params())
def test_sharded_jit_equals_single_device(mesh, case, mode):
    c = M.CASE_BY_NAME[case]
    replicated = NamedSharding(mesh, PartitionSpec())
    batch = NamedSharding(mesh, PartitionSpec("data"))
    if c.per_example:
        res = _batch_sharded(c, mode, replicated, batch)
        # every device holds the global statistics
        for leaf in jax.tree.leaves(es.freeze(res.model)):
            if isinstance(leaf, jax.Array):
                assert leaf.sharding.is_fully_replicated
    else:
        res = _ensemble_sharded(c, mode, batch)
    M.check_result(res, c)
