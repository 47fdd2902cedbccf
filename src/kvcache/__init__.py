"""kvcache: a Cython-accelerated CPU KV cache and grouped-query attention core.

The top level holds what a user of the caches names; everything else lives in its module
(``docs/architecture.md``, "Public API"):

- **caches** -- :class:`LayerKvCache` (one layer), :class:`KvCache` (a model's layers),
  :class:`StaticKvCache`, :class:`LatentKvCache` and its functional twin
  :class:`LazyLatentCache`: the objects a program builds.
- **modes** -- :class:`KvMode`: the storage precision every ``mode=`` takes.
- **policies** -- :class:`EvictionPolicy` (``KvCache(policy=...)``) and :class:`O1Rect`
  (``LayerKvCache.o1_begin(rect=...)``): the choices a program passes to a cache.
- **threads** -- :func:`threads`, :func:`thread_settings`, :class:`BlasGovernor`: how many
  threads the kernels and BLAS use.
- **errors** -- :class:`WireError` (every bad buffer) and :class:`RebindRefused` (a decode
  plan that cannot move to another cache): what a program catches.
- :func:`show_config` and ``__version__``.

Elsewhere: the re-bind machinery (``DecodePlan``, ``KvAllocId``, the source protocols) in
:mod:`kvcache.rebind`; the MLA maths (``mla_decode``, ``split_kv_b``, ...) in
:mod:`kvcache.mla`; the O(1) state's views and snapshots in :mod:`kvcache.o1`;
``LatentSlot`` in :mod:`kvcache.latent`; the byte formats in :mod:`kvcache.wire`.
:mod:`kvcache.reference`, the pure-NumPy twin of every compiled kernel (the test oracle and the
benchmark baseline), is a submodule imported on first use (``kvcache.reference`` or
``from kvcache import reference``), not by ``import kvcache``.

The names that used to be here (``kvcache.mla_decode``, ``kvcache.DecodePlan``, ...) still
work for one release, with a DeprecationWarning naming the new home (CHANGELOG.md).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

# first of kvcache's modules: libgomp's spin default while the compiled extension loads
from . import _omp  # noqa: F401
from ._version import __version__

from .modes import KvMode
from .layer import LayerKvCache
from .o1 import O1Rect
from .wire import WireError
from .eviction import EvictionPolicy
from .model import KvCache
from .latent import LatentKvCache, LazyLatentCache
from .static import StaticKvCache
from .rebind import RebindRefused
from ._config import show_config
from ._threads import BlasGovernor, thread_settings, threads
from . import _deprecated, mla, rebind          # the homes of names that moved (below)

if TYPE_CHECKING:
    from . import reference as reference

__all__ = [
    # caches
    "LayerKvCache", "KvCache", "StaticKvCache", "LatentKvCache", "LazyLatentCache",
    # modes
    "KvMode",
    # policies
    "EvictionPolicy", "O1Rect",
    # threads
    "threads", "thread_settings", "BlasGovernor",
    # errors
    "WireError", "RebindRefused",
    # introspection
    "show_config", "__version__",
]

#: submodules ``kvcache.X`` imports on first use, without a warning
_LAZY = frozenset({"reference"})

#: old top-level names -> their home (deprecated in 0.2.0, removed in the release after)
_MOVED = {
    **{n: f"kvcache.rebind.{n}" for n in ("DecodePlan", "KvAllocId", "KvPlanSource",
                                          "KvRebindSource", "PlanValidity", "RebindRefusal")},
    **{n: f"kvcache.mla.{n}" for n in ("mla_decode", "mla_softmax_scale", "split_kv_b",
                                       "yarn_get_mscale")},
    **{n: f"kvcache.o1.{n}" for n in ("O1DeviceView", "O1HeadView", "O1Snapshot")},
    "LatentSlot": "kvcache.latent.LatentSlot",
}


def _getattr(name: str) -> object:
    """``kvcache.reference`` (imported here on first use) and the deprecated names."""
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    return _deprecated.moved(__name__, _MOVED, name)


def _dir() -> list[str]:
    """The public names and the public submodules, not the deprecated names."""
    subs = {n for n, v in globals().items() if isinstance(v, ModuleType)
            and v.__name__ == f"{__name__}.{n}" and not n.startswith("_")}
    return sorted(set(__all__) | _LAZY | subs)


if not TYPE_CHECKING:
    # Bound only at run time: a type checker that saw a module ``__getattr__`` would accept
    # any attribute of kvcache (typos included); it sees ``reference`` above and no old names.
    __getattr__ = _getattr
    __dir__ = _dir
