"""Load the repository's scripts (examples/, benchmarks/) as modules in tests."""

import importlib.util
import pathlib
import sys
from types import ModuleType


ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_script(
    folder: str, name: str, *, module_name: str | None = None
) -> ModuleType:
    """Execute `ROOT/folder/name.py` as a fresh module, registered in `sys.modules`
    (dataclasses such as `eqx.Module`s look their module up there)."""
    module_name = module_name or name
    spec = importlib.util.spec_from_file_location(
        module_name, ROOT / folder / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def cached_script(folder: str, name: str, module_name: str) -> ModuleType:
    """`load_script`, executed once per test session."""
    if module_name not in sys.modules:
        load_script(folder, name, module_name=module_name)
    return sys.modules[module_name]
