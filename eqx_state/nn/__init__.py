"""Stateful layers."""

from ._attention import (
    CausalSelfAttention as CausalSelfAttention,
    kv_cache_axes as kv_cache_axes,
    truncate_kv_cache as truncate_kv_cache,
    with_kv_cache as with_kv_cache,
    without_kv_cache as without_kv_cache,
)
from ._batch_norm import BatchNorm as BatchNorm
from ._batched import Batched as Batched
from ._counter import Counter as Counter
from ._ema import EMA as EMA
from ._kv_cache import KVCache as KVCache
from ._record import Capture as Capture, Record as Record, Recorder as Recorder
from ._rng import Dropout as Dropout, Rng as Rng
from ._running_norm import RunningNorm as RunningNorm
from ._spectral_norm import SpectralNorm as SpectralNorm
