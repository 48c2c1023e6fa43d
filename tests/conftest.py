import os
import re
import sys


# Tests live in folders that mirror the package (core/, nn/, metrics/, io/, ...); the
# helpers they share (_scripts.py, _metric_run.py, ...) live here, in tests/.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# The tests compile thousands of small programs; on CI's 2 cores, most of their time is
# XLA's LLVM backend optimising code that runs for microseconds. JAX's config flag
# `jax_disable_most_optimizations` keeps XLA's own passes (fusion, layouts) and
# skips LLVM's optimisations (backend level 0, no expensive passes): the default
# suite ran in 5:40 instead of 7:26 on an idle 2-core machine (XLA_FLAGS'
# `--xla_backend_optimization_level=0` alone, used before, gave 7:26; 2026-12-04).
# Results are compared with tolerances, or against programs compiled the same way.
# Set JAX_DISABLE_MOST_OPTIMIZATIONS=0 to test with JAX's default optimisation;
# what users run (the examples and benchmarks outside the tests) keeps it. JAX
# reads the variable when it is imported; the tests' subprocesses inherit it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# Many tests compile the same small programs (a parametrised case, the value and ref
# modes of one model, the same example in two tests). JAX's persistent compilation
# cache, in a directory made for this run and shared by its workers (and by the
# 4-device pytest subprocess, which loads this file too; the variable is inherited),
# compiles each once: about 13% of the default suite's time. It caches XLA's
# compiled code, keyed by the program, the flags and the versions; tracing (what
# trace counts measure) still runs every time. The directory goes with the run: a
# clean checkout starts from nothing. An entry read while the other worker is still
# writing it is a miss (JAX warns and compiles): see pyproject's filterwarnings.
_CACHE_ENV = "EQX_STATE_TEST_COMPILATION_CACHE"
if _CACHE_ENV not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="eqx_state_xla_cache_")
    atexit.register(shutil.rmtree, os.environ[_CACHE_ENV], ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402


# (also here: a plugin may have imported JAX before this file set the variable)
jax.config.update(
    "jax_disable_most_optimizations",
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower()
    in ("1", "y", "yes", "t", "true", "on"),
)
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# Equinox's tests use strict dtype and rank promotion; Optax's optimizers (and
# ordinary user code that these tests mirror) rely on standard promotion, so the
# defaults stay. jaxtyping + beartype check the package (see pyproject addopts).


@pytest.fixture
def getkey():
    keys = iter(jax.random.split(jax.random.key(0), 10_000))
    return lambda: next(keys)


# tests/multidevice/ needs 4 devices set up before JAX starts: it runs in its own
# process from tests/distributed/test_multidevice.py.
collect_ignore = ["multidevice"]


def pytest_configure(config):
    """Tests picked by their node ids (`pytest tests/nn/test_ema.py::test_x`, only
    node ids and no `-m` of the command line's own) run even if slow: the default
    `-m 'not slow'` (pyproject's addopts) would deselect them and run nothing."""
    given = config.invocation_params.args  # what the command line says
    picked = [str(a) for a in config.args]
    if (
        config.option.markexpr == "not slow"
        and picked
        and all("::" in a for a in picked)
        and not any(str(a).startswith("-m") for a in given)
    ):
        config.option.markexpr = ""


# Two workers (`-n 2 --dist worksteal`: an idle worker takes tests from the other's
# queue, so neither ends alone; compiled programs are shared through the run's
# persistent compilation cache above). The files with the longest single tests
# (subprocesses on 4 devices or several processes) and the largest files start
# first.
_LONG_FIRST = (
    "test_multidevice.py",
    "test_multiprocess.py",
    "test_transform_matrix.py",
    "test_orbax.py",
    "test_kv_cache.py",
    "test_metrics.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return _LONG_FIRST.index(name) if name in _LONG_FIRST else len(_LONG_FIRST)

    _split_cases(items)
    _mark_long_cases(config, items)
    items.sort(key=rank)  # stable: the order within a file is kept


_MODES = ("value", "ref")  # the `mode` parameter of a storage-mode parametrisation


def _split_cases(items) -> None:
    """Which cases of a parametrised test run by default; the others run with the
    slow cases (`pytest -m slow`, also in CI), so that together they cover every
    case. Split are:

    * every test parametrised over the storage mode (`mode` in `_MODES`), unless
      marked `both_modes`: each case runs in one of the two modes by default. The
      two modes run the same compiled program (ref mode passes its refs' arrays
      through value mode's), so the second mode mostly repeats the first; the
      tests whose subject is the difference mark `both_modes` or compare the two
      modes inside one case;
    * a test marked `split`: a cross product of cases (layers x transformations,
      dtypes, optimizers) that a sample checks by default; `split(every=4)` runs a
      quarter of them (the transform matrix: an eighth).

    The split is a chessboard: a case runs by default when the index of its mode
    plus the index of the value of each other parameter (among that parameter's
    values in the test), plus the test's ordinal among the split tests of its file,
    is a multiple of `every` (2 unless the marker says otherwise). With `every=2`,
    by default every value of every parameter meets both modes (and, with two or
    more parameters, every value of each parameter runs), and a file's mode-only
    tests alternate between the modes; with a larger `every` a sample of the values
    runs by default (in the transform matrix, still every layer and every
    transformation in both modes). A parametrisation that is not a cross product (a
    diagonal) is not marked. `tests/multidevice` runs in a subprocess with every
    case (`tests/distributed/test_multidevice.py` splits it by file).
    """
    tests: dict = {}
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is None:
            continue
        by_mode = spec.params.get("mode") in _MODES
        if item.get_closest_marker("split") is None and (
            not by_mode or item.get_closest_marker("both_modes") is not None
        ):
            continue
        fn = (item.path, item.originalname)
        tests.setdefault(item.path, {}).setdefault(fn, []).append(item)
    for functions in tests.values():
        for ordinal, cases in enumerate(functions.values()):
            seen: dict[str, list] = {}
            marker = cases[0].get_closest_marker("split")
            every = 2
            if marker is not None:
                every = marker.kwargs.get("every", marker.args[0] if marker.args else 2)
            assert isinstance(every, int) and every >= 2, f"{cases[0].nodeid}: split"
            for item in cases:
                index = ordinal
                for param, value in item.callspec.params.items():
                    if param == "mode" and value in _MODES:
                        index += _MODES.index(value)
                        continue
                    values = seen.setdefault(param, [])
                    key = repr(value)
                    if key not in values:
                        values.append(key)
                    index += values.index(key)
                if index % every:
                    item.add_marker(pytest.mark.slow)


# Cases of the default run that run with the slow ones (`pytest -m slow`, also in CI)
# so that the default run stays short: tests/long_cases.txt lists them, with how they
# were picked (the longest cases, by hand; and, by rule, the long cases of
# parametrised tests beyond each test's fastest one).
def _read_long_cases() -> frozenset[str]:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "long_cases.txt")
    with open(path, encoding="utf-8") as f:
        lines = (re.split(r"(?:^|\s)#", line)[0].strip() for line in f)
        return frozenset("tests/" + i for i in lines if i)


_LONG_CASES = _read_long_cases()


def _mark_long_cases(config, items) -> None:
    seen = set()
    for item in items:
        if item.nodeid in _LONG_CASES:
            item.add_marker(pytest.mark.slow)
            seen.add(item.nodeid)
    if any("::" in str(a) for a in config.args):
        return  # single tests picked: the others are not collected
    files = {item.nodeid.split("::")[0] for item in items}
    stale = sorted(i for i in _LONG_CASES - seen if i.split("::")[0] in files)
    if stale:
        raise pytest.UsageError(
            "tests/long_cases.txt names cases that are not collected "
            f"(renamed or removed?): {', '.join(stale)}"
        )


# Every error eqx_state raises is an `es.EqxStateError` (issue 23). Each
# `pytest.raises` of the suite checks it: an exception raised in eqx_state's own code
# (the innermost frame of its traceback is in the package) must be one. So every
# error path the suite exercises is walked, without a list to keep up to date.
_PACKAGE = (
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eqx_state"
    )
    + os.sep
)
_raises = pytest.raises


def _raised_by_the_library(e: BaseException) -> bool:
    """Whether eqx_state's own code made `e`: a built-in exception type raised by
    a `raise SomeError(...)` statement in the package (not an error of JAX or
    Equinox passed on, nor a bare re-raise)."""
    import builtins
    import linecache

    tb = e.__traceback__
    if tb is None or getattr(builtins, type(e).__name__, None) is not type(e):
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    line = linecache.getline(filename, tb.tb_lineno).strip()
    return filename.startswith(_PACKAGE) and line.startswith("raise ")


class _CheckedRaises:
    def __init__(self, inner):
        self._inner = inner

    def __enter__(self):
        self._info = self._inner.__enter__()
        return self._info

    def __exit__(self, *exc):
        out = self._inner.__exit__(*exc)
        e = exc[1]
        if e is not None and _raised_by_the_library(e):
            from eqx_state import EqxStateError

            assert isinstance(e, EqxStateError), (
                f"eqx_state raised {type(e).__name__} ({e}), which is not an "
                "es.EqxStateError: raise one of eqx_state/_errors.py's types"
            )
        return out

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _checked_raises(*args, **kwargs):
    if len(args) > 1 or "func" in kwargs:  # the call form: pytest.raises(E, f, *a)
        info = _raises(*args, **kwargs)
        if _raised_by_the_library(info.value):
            from eqx_state import EqxStateError

            assert isinstance(info.value, EqxStateError), type(info.value)
        return info
    return _CheckedRaises(_raises(*args, **kwargs))


pytest.raises = _checked_raises
