"""The transform-safety matrix: every stateful layer and metric x every JAX
transformation x both storage modes (declared in `transform_matrix_cases.py`).

Each cell checks that the state after the transformed call equals the same calls
run eagerly (every write lands exactly once: no silent loss, no double count), or
that the call raises the documented error and writes nothing. Known defects are
strict xfails (silent ones fail with EQX_STATE_MATRIX_STRICT=1).
`docs/transform-matrix.md` is generated from the same declarations
(`python tests/matrix_report.py`) and checked here.
"""

import os
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transform_matrix_cases as M

import eqx_state as es


DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "transform-matrix.md"


# With EQX_STATE_MATRIX_STRICT=1 the silent known defects fail instead of xfailing.
STRICT = os.environ.get("EQX_STATE_MATRIX_STRICT") == "1"


def _params():
    out = []
    for case, column, mode in M.cells():
        exp = M.expectation(case, column, mode)
        marks = (
            [pytest.mark.xfail(strict=True, reason=exp.reason)]
            if isinstance(exp, M.Known) and not (STRICT and exp.silent)
            else []
        )
        out.append(pytest.param(case, column, mode, marks=marks))
    return out


# The default run checks an eighth of the (layer, transformation, mode) cases,
# chosen like a chessboard (every layer and every transformation meets both modes),
# and the slow run the rest: tests/conftest.py, `_split_cases`.
@pytest.mark.split(every=8)
@pytest.mark.parametrize("case, column, mode", _params())
def test_cell(case, column, mode):
    M.run_cell(case, column, mode)


@pytest.mark.parametrize("case", [c.name for c in M.CASES])
def test_references_agree_across_modes(case):
    # The two references (eager ref mode, eager `es.apply` in value mode) agree, so
    # the value- and ref-mode cells are checked against the same numbers.
    ref_out, ref_state = M.reference(case, 2)
    val_out, val_state = M.reference_value_mode(case, 2)
    for a, b in zip(ref_out + ref_state, val_out + val_state, strict=True):
        M._assert_equal(a, b, case)
    # and the reference really writes: the state after two calls differs from the
    # initial state
    initial = M.state_of(M.base_model(case))
    assert any(not np.array_equal(a, b) for a, b in zip(ref_state, initial))


def test_checker_catches_lost_and_doubled_writes():
    # A transform that drops the new state, or writes twice, fails the check.
    case = M.CASE_BY_NAME["Counter"]
    outs, st = M.reference("Counter", 1)
    model = M.base_model("Counter")
    x = M.inputs(case)[0]

    es.apply(case.call, model, x)  # the new model is dropped: the write is lost
    with pytest.raises(AssertionError, match="state cell 0"):
        M.check_result(M.Result([], model, None, st), case)

    def twice(m, x):
        case.call(m, x)
        return case.call(m, x)

    _, doubled = es.apply(twice, model, x)
    with pytest.raises(AssertionError, match="state cell 0"):
        M.check_result(M.Result([], doubled, None, st), case)
    _, once = es.apply(case.call, model, x)
    M.check_result(M.Result([], once, None, st), case)


def test_every_stateful_layer_is_covered():
    covered = {c.name for c in M.CASES}
    # Rng is covered through Dropout (which owns one); Batched holds no state of its
    # own (it maps a one-example layer over the batch)
    exempt = {"Rng", "Batched", "Recorder"}  # Recorder: the base of Record/Capture
    for name in dir(es.nn):
        obj = getattr(es.nn, name)
        if isinstance(obj, type) and issubclass(obj, eqx.Module):
            assert name in covered or name in exempt, f"es.nn.{name} has no case"
    for name in ("Mean", "Accuracy", "MeanStd", "ConfusionMatrix"):
        assert f"metrics.{name}" in covered


def test_every_declared_error_is_documented():
    # Each documented error names a fix that the test matches; a generic
    # `Exception` is allowed only for `eqx.error_if`'s runtime error.
    for case, column, mode in M.cells():
        exp = M.expectation(case, column, mode)
        if isinstance(exp, M.Raises):
            assert exp.match and exp.reason
            assert exp.exc is not Exception or "different values" in exp.match


def test_docs_agree_with_the_matrix():
    assert DOC.exists(), "run `python tests/matrix_report.py` to write the page"
    assert DOC.read_text() == M.render_markdown(), (
        "docs/transform-matrix.md is out of date: run `python tests/matrix_report.py`"
    )


def test_ref_mode_ensemble_with_filter_vmap_mapping_refs():
    # The working form of T10 in ref mode: `in_axes` that maps refs as well as
    # arrays (Equinox's default maps arrays only).
    case = M.CASE_BY_NAME["BatchNorm"]
    ens = es.to_refs(M.ensemble("BatchNorm"))
    outs, st, xs = M._ensemble_reference(case, M.E)

    def maps_refs(x):
        return 0 if eqx.is_array(x) or isinstance(x, jax.Ref) else None

    y = eqx.filter_vmap(case.call, in_axes=(maps_refs, 0))(ens, xs)
    M.check_result(M.Result([y], ens, outs, st), case)


def test_scan_over_layers_ref_views_need_traced_refs():
    # `ref.at[i]` exists on traced refs only: the stacked refs must be arguments of
    # the enclosing `jit` (as in column T14). Closed over by an eager `lax.scan`,
    # JAX raises a bare NotImplementedError (reported; see the matrix notes).
    stacked = es.to_refs(M.ensemble("BatchNorm", M.L))
    x = jnp.ones((4, 3))
    with pytest.raises(NotImplementedError):
        jax.lax.scan(
            lambda h, i: (M._layer_view(stacked, i)(h), None), x, jnp.arange(M.L)
        )
    assert int(stacked.num_batches_tracked[0][...]) == 0
