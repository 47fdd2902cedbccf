"""kvcache: a Cython-accelerated CPU KV cache and grouped-query attention core.

The public names are those of spec/API.md.  ``kvcache.reference`` holds the pure-NumPy twin of
every compiled kernel (the test oracle and the benchmark baseline).
"""

from __future__ import annotations

__version__ = "0.1.0"

import os as _os

# OpenMP threads that spin-wait between parallel regions, next to BLAS (or other OpenMP) threads
# that do the same, deschedule each other on machines with few cores: on 2 cores a decode
# attention call that takes 0.3 ms alone took 20-100 ms after a NumPy matrix product.  kvcache's
# OpenMP runtime is therefore started with OMP_WAIT_POLICY=PASSIVE (idle threads sleep), unless
# the caller chose a policy (OMP_WAIT_POLICY or GOMP_SPINCOUNT).  libgomp reads it once, when
# it is loaded, so it is set only while the compiled module loads: OpenMP runtimes loaded later
# (torch's own, say) see the environment as it was.
_KEEP_POLICY = "OMP_WAIT_POLICY" in _os.environ or "GOMP_SPINCOUNT" in _os.environ
if not _KEEP_POLICY:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
try:
    from . import _core  # noqa: F401
except ImportError:      # not built: kvcache.layer explains how to build it
    pass
finally:
    if not _KEEP_POLICY:
        del _os.environ["OMP_WAIT_POLICY"]

from .modes import KvMode
from .layer import LayerKvCache
from .o1 import O1DeviceView, O1HeadView, O1Rect, O1Snapshot
from .wire import WireError
from .model import EvictionPolicy, KvCache
from .latent import KvAllocId, LatentKvCache, LatentSlot, LazyLatentCache, StaticKvCache
from .rebind import (DecodePlan, KvPlanSource, KvRebindSource, PlanValidity, RebindRefusal,
                     RebindRefused)
from .mla import mla_decode, mla_softmax_scale, split_kv_b, yarn_get_mscale
from . import reference
from ._config import show_config

__all__ = ["KvMode", "LayerKvCache", "KvCache", "EvictionPolicy", "O1Rect", "O1DeviceView",
           "O1HeadView", "O1Snapshot", "WireError", "reference", "show_config", "__version__",
           "KvAllocId", "LatentSlot", "LatentKvCache", "StaticKvCache", "LazyLatentCache",
           "KvRebindSource", "KvPlanSource", "DecodePlan", "PlanValidity", "RebindRefusal",
           "RebindRefused", "mla_decode", "mla_softmax_scale", "split_kv_b", "yarn_get_mscale"]
