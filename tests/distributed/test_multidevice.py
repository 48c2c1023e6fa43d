"""Runs tests/multidevice/ in a separate process on 4 (CPU) devices."""

import os
import pathlib
import subprocess
import sys


HERE = pathlib.Path(__file__).resolve().parents[1]


def test_multidevice_suite():
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
            str(HERE / "multidevice"),
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=HERE.parent,
    )
    print(result.stdout[-5000:], result.stderr[-3000:])
    assert result.returncode == 0, result.stdout[-5000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout
