"""The runnable examples in the docstrings of the layers (`eqx_state.nn`) run, and
the outputs they promise in `# comments` after a `print` are printed."""

import contextlib
import inspect
import io
import re

import pytest

import eqx_state as es


BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _documented():
    for name in sorted(dir(es.nn)):
        obj = getattr(es.nn, name)
        if name.startswith("_") or not (
            inspect.isclass(obj) or inspect.isfunction(obj)
        ):
            continue
        docs = [(name, inspect.getdoc(obj) or "")]
        if inspect.isclass(obj):
            for meth, fn in vars(obj).items():
                if not meth.startswith("_") and inspect.isfunction(fn):
                    docs.append((f"{name}.{meth}", inspect.getdoc(fn) or ""))
        for where, doc in docs:
            for i, block in enumerate(BLOCK.findall(doc)):
                yield pytest.param(block, id=f"{where}[{i}]")


@pytest.mark.parametrize("block", list(_documented()))
def test_docstring_example_runs(block):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "<docstring>", "exec"), {"__name__": "docstring"})
    for line in block.splitlines():
        m = re.match(r"\s*print\(.*\)\s+# (\S.*)$", line)
        if m:
            assert m.group(1).strip() in out.getvalue(), (line, out.getvalue())
