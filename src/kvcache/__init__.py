"""kvcache: a Cython-accelerated CPU KV cache and grouped-query attention core.

The public names are listed in ``__all__`` and described in ``docs/architecture.md``.
``kvcache.reference`` holds the pure-NumPy twin of every compiled kernel (the test oracle and
the benchmark baseline).
"""

from __future__ import annotations

from ._version import __version__

from .modes import KvMode
from .layer import LayerKvCache
from .o1 import O1DeviceView, O1HeadView, O1Rect, O1Snapshot
from .wire import WireError
from .eviction import EvictionPolicy
from .model import KvCache
from ._slots import KvAllocId, LatentSlot
from .latent import LatentKvCache, LazyLatentCache
from .static import StaticKvCache
from .rebind import (DecodePlan, KvPlanSource, KvRebindSource, PlanValidity, RebindRefusal,
                     RebindRefused)
from .mla import mla_decode, mla_softmax_scale, split_kv_b, yarn_get_mscale
from . import reference
from ._config import show_config
from ._threads import BlasGovernor, thread_settings, threads

__all__ = ["KvMode", "LayerKvCache", "KvCache", "EvictionPolicy", "O1Rect", "O1DeviceView",
           "O1HeadView", "O1Snapshot", "WireError", "reference", "show_config", "__version__",
           "KvAllocId", "LatentSlot", "LatentKvCache", "StaticKvCache", "LazyLatentCache",
           "KvRebindSource", "KvPlanSource", "DecodePlan", "PlanValidity", "RebindRefusal",
           "RebindRefused", "mla_decode", "mla_softmax_scale", "split_kv_b", "yarn_get_mscale",
           "threads", "thread_settings", "BlasGovernor"]
