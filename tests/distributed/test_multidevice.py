"""Runs tests/multidevice/ in a separate process on 4 (CPU) devices."""

import os
import pathlib
import subprocess
import sys

import pytest


HERE = pathlib.Path(__file__).resolve().parents[1]


# The step on a mesh (data and tensor parallel, layouts, refusals) in the default
# run; the sharded matrix, metrics and recorders with the slow cases (also in CI).
CORE = [
    "test_sharded_step.py",
    "test_batch_norm_sharded.py",
    "test_mesh_refusals.py",
    "test_layout.py",
]
REST = [
    "test_matrix_sharded.py",
    "test_metrics_sharded.py",
    "test_record_sharded.py",
]


def test_every_multidevice_file_runs_in_one_group():
    files = sorted(p.name for p in (HERE / "multidevice").glob("test_*.py"))
    assert files == sorted(CORE + REST)


@pytest.mark.parametrize(
    "files", [CORE, pytest.param(REST, marks=pytest.mark.slow)], ids=["core", "rest"]
)
def test_multidevice_suite(files):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",  # one process: it is one worker of the outer run already
            # every case of these files: the split into default and slow is by file,
            # here (the default `-m 'not slow'` of pyproject's addopts, and the
            # storage-mode split of tests/conftest.py, would leave cases out of both
            # runs)
            "-m",
            "",
            *(str(HERE / "multidevice" / f) for f in files),
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=HERE.parent,
    )
    print(result.stdout[-5000:], result.stderr[-3000:])
    assert result.returncode == 0, result.stdout[-5000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout
    assert "deselected" not in result.stdout, "a case of the 4-device files did not run"
