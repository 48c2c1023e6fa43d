"""Write docs/transform-matrix.md from the transform-safety matrix.

    python tests/matrix_report.py          # write the page
    python tests/matrix_report.py --check  # exit 1 if the committed page is stale
    python tests/matrix_report.py --run    # run the matrix tests first

The page is generated from the expectations declared in
`tests/transform_matrix_cases.py`; `tests/core/test_transform_matrix.py` runs every cell
against them (and `tests/multidevice/test_matrix_sharded.py` the sharded column),
and checks that the committed page equals what this script writes.
"""

import argparse
import os
import pathlib
import subprocess
import sys


HERE = pathlib.Path(__file__).resolve().parent
DOC = HERE.parent / "docs" / "transform-matrix.md"
sys.path.insert(0, str(HERE))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare")
    parser.add_argument("--run", action="store_true", help="run the tests first")
    args = parser.parse_args()
    if args.run:
        env = dict(os.environ)
        # every cell (`-m ""`: the default run checks a sample, tests/conftest.py)
        tests = [str(HERE / "core" / "test_transform_matrix.py")]
        code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "", *tests])
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
        ).strip()
        sharded = [str(HERE / "multidevice" / "test_matrix_sharded.py")]
        code |= subprocess.call(
            [sys.executable, "-m", "pytest", "-q", "-m", "", "-n", "0", *sharded],
            env=env,
        )
        if code:
            print("matrix tests failed: the page was not written", file=sys.stderr)
            return code
    import transform_matrix_cases as matrix

    text = matrix.render_markdown()
    if args.check:
        ok = DOC.exists() and DOC.read_text() == text
        print("up to date" if ok else f"{DOC} is stale: rerun without --check")
        return 0 if ok else 1
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
