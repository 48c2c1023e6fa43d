import os
import sys


# Tests live in folders that mirror the package (core/, nn/, metrics/, io/, ...); the
# helpers they share (_scripts.py, _metric_run.py, ...) live here, in tests/.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# The tests compile thousands of small programs; on CI's 2 cores, most of their time is
# XLA's LLVM backend optimising code that runs for microseconds. Level 0 keeps XLA's
# own passes (fusion, layouts) and skips LLVM's optimisations: the suite runs ~25%
# faster. Results are compared with tolerances, or against programs compiled the same
# way. Set XLA_FLAGS yourself to test at another level; what users run (the examples
# and benchmarks outside the tests) keeps JAX's default. XLA reads the flag when JAX
# starts its backend, after this file is imported; the tests' subprocesses inherit it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

import jax  # noqa: E402
import pytest  # noqa: E402


# Equinox's tests use strict dtype and rank promotion; Optax's optimizers (and
# ordinary user code that these tests mirror) rely on standard promotion, so the
# defaults stay. jaxtyping + beartype check the package (see pyproject addopts).


@pytest.fixture
def getkey():
    keys = iter(jax.random.split(jax.random.key(0), 10_000))
    return lambda: next(keys)


# tests/multidevice/ needs 4 devices set up before JAX starts: it runs in its own
# process from tests/test_multidevice.py.
collect_ignore = ["multidevice"]


# Two workers (`-n 2 --dist loadfile`: a file's tests share one process, and so
# its compiled programs and module fixtures). The files with the longest single
# tests (subprocesses on 4 devices or several processes) and the largest files
# start first, so that the workers do not end with one of them running alone.
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

    items.sort(key=rank)  # stable: the order within a file is kept
