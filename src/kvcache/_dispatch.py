"""Which compiled body each kernel family runs: instruction-set features as sets.

A CPU reports a *set* of features (:data:`FEATURES`); features are never a ladder -- an
AVX-512 server need not have AVX-VNNI (AMD Zen 4, Intel Ice Lake and Cascade Lake have
AVX512-VNNI but not the VEX AVX-VNNI) and an AVX-VNNI laptop need not have AVX-512 (Alder
Lake).  Each body declares the features it may execute (:data:`BODY_NEEDS`, the same sets as
``kvc_body_needs`` in ``_isa.h``), and each family holds some of the bodies (which ones depends
on the build: ``_core.built_bodies()``).  :func:`choose` picks per family the first body of
:data:`PREFERENCE` that is built and whose every need the CPU has, so it can never pick an
instruction the CPU lacks.  Every body computes the portable twin's bits (docs/numerics.md),
so the choice changes speed, never results.

This module is pure Python and imports nothing of kvcache: the table test
(tests/test_dispatch.py) runs :func:`choose` over the flags of real CPUs.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

__all__ = ["BODIES", "BODY_NEEDS", "CPUINFO_FLAGS", "FAMILIES", "FEATURES", "HELD",
           "MOST_CAPABLE", "PREFERENCE", "choose", "features_from_cpuinfo", "runnable"]

FEATURES = ("avx2", "fma", "avxvnni", "avx512f", "avx512bw", "avx512dq", "avx512vl",
            "avx512vnni", "avx512bf16", "neon", "dotprod", "f16c")
"""The features kvcache detects, in the order of their bits in ``_isa.h`` (``KVC_F_*``)."""

BODIES = ("portable", "avx2", "avxvnni", "avx512", "neon", "neondot")
"""Body names, in the order of their ids in ``_isa.h`` (``KVC_ISA_*``): one compiled unit each
(``_dispatch.h``)."""

_AVX2 = frozenset({"avx2", "fma", "f16c"})
BODY_NEEDS: dict[str, frozenset[str]] = {
    "portable": frozenset(),
    "avx2": _AVX2,
    "avxvnni": _AVX2 | {"avxvnni"},
    "avx512": _AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vnni"},
    "neon": frozenset({"neon"}),
    "neondot": frozenset({"neon", "dotprod"}),
}
"""The features each body may execute (its compile target)."""

FAMILIES = ("f32", "q8", "prefill", "mla")
"""Kernel families, in the order of ``KVC_FAM_*`` (``_dispatch.h``): float32 decode attention
with the softmax and the O(1) step; q8 scoring of int8 keys and the int8 quantisers; prompt
attention; MLA decode."""

HELD: dict[str, tuple[str, ...]] = {
    "f32": ("portable", "avx2", "avx512", "neon"),
    "q8": BODIES,
    "prefill": BODIES,
    "mla": ("portable", "avx2", "avx512", "neon"),
}
"""Per family, the bodies that are its own where their unit is built (a unit whose code for the
family is another unit's, e.g. the float32 kernels of ``avxvnni``, which are ``avx2``'s, is not
listed): what ``set_bodies`` accepts."""

PREFERENCE: dict[str, tuple[str, ...]] = {
    "f32": ("avx512", "avx2", "neon", "portable"),
    "q8": ("avx512", "avxvnni", "avx2", "neondot", "neon", "portable"),
    "prefill": ("avx512", "avxvnni", "avx2", "neondot", "neon", "portable"),
    "mla": ("avx512", "avx2", "neon", "portable"),
}
"""Per family, the bodies :func:`choose` takes, best first.  The float32 decode family's
``avx512`` body is its 8-float code on EVEX registers: 32 of them hold the value pass's 16
accumulators of a quad of queries where AVX2's 16 spill, which an interleaved measurement on an
AVX-512 machine found worth 7-10% (q8) and 9-17% (4-bit modes) of a decode step, float32 rows
unchanged (docs/numerics.md, "Dispatch")."""

MOST_CAPABLE = ("avx512", "avxvnni", "avx2", "neondot", "neon", "portable")
"""Body names from the most to the least capable, for display (``_core.isa_detected``)."""

CPUINFO_FLAGS = {
    "avx2": "avx2", "fma": "fma", "avx_vnni": "avxvnni", "avx512f": "avx512f",
    "avx512bw": "avx512bw", "avx512dq": "avx512dq", "avx512vl": "avx512vl",
    "avx512_vnni": "avx512vnni", "avx512_bf16": "avx512bf16", "asimd": "neon",
    "asimddp": "dotprod", "f16c": "f16c",
}
"""Linux ``/proc/cpuinfo`` flag (x86 ``flags``, aarch64 ``Features``) -> feature name."""


def features_from_cpuinfo(flags: str) -> frozenset[str]:
    """The features named by a ``/proc/cpuinfo`` flags line (the kernel lists a flag only when
    the CPU has it and the OS saves its register state)."""
    return frozenset(CPUINFO_FLAGS[f] for f in flags.split() if f in CPUINFO_FLAGS)


def runnable(features: Iterable[str]) -> list[str]:
    """The bodies whose every need is in ``features``, in :data:`BODIES` order."""
    have = frozenset(features)
    return [b for b in BODIES if BODY_NEEDS[b] <= have]


def choose(features: Iterable[str], built: Mapping[str, Iterable[str]],
           cap: Optional[str] = None) -> dict[str, str]:
    """The body of every family for a CPU with ``features``.

    Parameters
    ----------
    features : iterable of str
        What the CPU (and OS) support, names of :data:`FEATURES`.
    built : mapping
        Family -> the bodies the build holds for it (``_core.built_bodies()``).
    cap : str, optional
        A body name: only bodies whose needs are a subset of its needs are taken (how
        ``KVCACHE_ISA`` and ``_core.set_isa`` choose a slower path).  It must itself be one
        the CPU runs.

    Returns
    -------
    dict
        Family -> body: the first of :data:`PREFERENCE` that is built, whose needs the CPU
        has (and, with ``cap``, that the cap's needs cover); ``"portable"`` is always built.

    Raises
    ------
    ValueError
        ``cap`` not a body name, or a body the CPU cannot run.
    """
    have = frozenset(features)
    allowed = have
    if cap is not None:
        if cap not in BODY_NEEDS:
            raise ValueError(f"isa: expected one of {sorted(BODY_NEEDS)}, got {cap!r}")
        missing = BODY_NEEDS[cap] - have
        if missing:
            raise ValueError(f"isa: {cap!r} needs {', '.join(sorted(missing))}, which this CPU "
                             f"does not report")
        allowed = have & BODY_NEEDS[cap]
    out = {}
    for fam in FAMILIES:
        have_built = set(built.get(fam, ())) | {"portable"}
        out[fam] = next(b for b in PREFERENCE[fam]
                        if b in have_built and BODY_NEEDS[b] <= allowed)
    return out
