"""The benchmark behind ``python -m kvcache bench``.

One module per section of the run, each declaring and registering its :class:`Section`
(``attention``: decode attention against the NumPy reference and torch; ``append``; ``o1``;
``wire``; ``mla``; ``sync``; ``runner``; ``store``; ``prefill``; ``contention``;
``realmodel``), plus the shared pieces: ``registry`` (sections, their options, the run's
context), ``geometry`` (model shapes and random rows), ``timing`` (timers, thread limits, the
bandwidth probe), ``machine`` (what the machine is and whether it was busy), ``tables`` (number
formats and text tables), ``report`` (the printed report, the JSON file, the charts) and
``cli`` (the command line built from the registry, :func:`main`).  A new section is one new
module in this package.

What each section times and how is written down in ``docs/benchmark-method.md``.  The workload
classes re-exported here are shared with the asv-style suite in ``benchmarks/``, so both measure
the same thing.
"""

from __future__ import annotations

from .._progress import progress_bar
from .append import AppendFill
from .attention import DEFAULT_WORKING_SET, KvcacheDecode, ReferenceDecode, TorchDecode
from .cli import main
from .geometry import GEOMETRIES, MODE_NAMES, Geometry, GiB, MiB
from .machine import available_cpus
from .mla import MLA_WORKING_SET, MlaDecode, mla_cache_bytes_per_token, mla_summary
from .o1 import O1Decode, SyntheticStream
from .sync import MirrorSync
from .timing import measure_bandwidth
from .wire import WIRE_SAVE_LAYERS, WIRE_VARIANTS, WireLayers, wire_digest_functions

__all__ = [
    "DEFAULT_WORKING_SET",
    "GEOMETRIES",
    "MLA_WORKING_SET",
    "MODE_NAMES",
    "WIRE_SAVE_LAYERS",
    "WIRE_VARIANTS",
    "AppendFill",
    "Geometry",
    "GiB",
    "KvcacheDecode",
    "MiB",
    "MirrorSync",
    "MlaDecode",
    "O1Decode",
    "ReferenceDecode",
    "SyntheticStream",
    "TorchDecode",
    "WireLayers",
    "available_cpus",
    "main",
    "measure_bandwidth",
    "mla_cache_bytes_per_token",
    "mla_summary",
    "progress_bar",
    "wire_digest_functions",
]
