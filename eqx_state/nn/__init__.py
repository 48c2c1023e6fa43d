"""Stateful layers."""

from ._batch_norm import BatchNorm as BatchNorm
from ._counter import Counter as Counter
