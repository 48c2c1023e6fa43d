"""Every Python block of the docs runs; every public name has an API entry."""

import contextlib
import io
import pathlib
import re
import types

import pytest

import eqx_state as es


DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md")) + [DOCS.parent / "README.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


# Pages whose blocks train a model end to end, or that take over ~5 s of CPU: the
# slow run executes them (also in CI). The example language-model.md walks through
# runs by default in its own test, tests/examples/test_lm.py; what the long pages
# show is tested by default in tests/io (pytorch.md), tests/nn/test_record.py
# (diagnostics.md), tests/metrics (metrics.md) and tests/core (equinox.md).
SLOW_PAGES = {
    "language-model.md",
    "pytorch.md",
    "diagnostics.md",
    "metrics.md",
    "equinox.md",
}


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_PAGES else p
        for p in PAGES
    ],
    ids=lambda p: p.name,
)
def test_code_blocks_run(page):
    blocks = BLOCK.findall(page.read_text())
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i, block in enumerate(blocks):
            try:
                exec(compile(block, f"{page.name}[block {i}]", "exec"), namespace)
            except Exception as e:  # pragma: no cover - the message is the point
                raise AssertionError(f"{page.name}, block {i} failed:\n{block}") from e
    # outputs promised in comments (`# [1, 2, 3]`) appear in what the blocks printed
    printed = out.getvalue()
    for block in blocks:
        for line in block.splitlines():
            m = re.match(r"\s*print\(.*\)\s+# (.+)$", line)
            if m:
                assert m.group(1).strip() in printed, (page.name, line, printed)


def _public_names():
    def names_of(module, prefix):
        return {
            f"{prefix}.{n}"
            for n, v in vars(module).items()
            if not n.startswith("_") and not isinstance(v, types.ModuleType)
        }

    return (
        names_of(es, "eqx_state")
        | names_of(es.nn, "eqx_state.nn")
        | names_of(es.metrics, "eqx_state.metrics")
    )


def test_every_public_name_is_in_the_api_reference():
    api = "\n".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    documented = set(re.findall(r"^::: (\S+)", api, re.M))
    missing = sorted(_public_names() - documented)
    assert not missing, f"add these to docs/api/: {missing}"
