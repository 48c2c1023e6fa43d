"""Import torchmetrics (the reference for the metrics' options).

torchmetrics imports torchvision when it is installed, and the torchvision wheel on
PyPI (a CUDA build) fails to import beside the CPU torch used here ("operator
torchvision::nms does not exist"). torchvision is imported first through the shim of
`examples/port_torchvision_resnet.py` (its models are pure Python), so that
torchmetrics, and any later test, sees a working torchvision."""

import sys

from _scripts import cached_script


if "torchvision" not in sys.modules:
    cached_script(
        "examples", "port_torchvision_resnet", "port_resnet_example"
    ).import_torchvision()

import torch  # noqa: E402
import torchmetrics  # noqa: E402
from torchmetrics import aggregation, classification  # noqa: E402


__all__ = ["aggregation", "classification", "torch", "torchmetrics"]
