"""Stateful layers."""

from ._batch_norm import BatchNorm as BatchNorm
from ._counter import Counter as Counter
from ._ema import EMA as EMA
from ._running_norm import RunningNorm as RunningNorm
from ._spectral_norm import SpectralNorm as SpectralNorm
