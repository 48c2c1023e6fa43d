"""Import torchmetrics (the reference for the metrics' options) without torchvision.

torchmetrics imports torchvision's image models when the package is installed; a
torchvision built for another torch release fails at import time (`operator
torchvision::nms does not exist`). The metrics compared here need no torchvision,
so it is hidden from torchmetrics before the import."""

import importlib.metadata
import sys


def _hide_torchvision() -> None:
    if "torchmetrics" in sys.modules:
        return
    import lightning_utilities.core.imports as imports

    version = imports._version

    def _version(name: str) -> str:
        if name == "torchvision":
            raise importlib.metadata.PackageNotFoundError(name)
        return version(name)

    imports._version = _version
    sys.modules.setdefault("torchvision", None)  # pyright: ignore


_hide_torchvision()

import torch  # noqa: E402
import torchmetrics  # noqa: E402
from torchmetrics import aggregation, classification  # noqa: E402


__all__ = ["aggregation", "classification", "torch", "torchmetrics"]
