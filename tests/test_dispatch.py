"""The choice of instruction-set body per kernel family (kvcache._dispatch, docs/numerics.md
"Dispatch"), held against the real flag lines of eleven x86-64 and four aarch64 CPUs
(tests/data/cpu-flags).

Detection is replaced by each CPU's flags: features are a set, so an AVX-512 CPU without
AVX-VNNI (Zen 4, Cascade Lake, Ice Lake) must never be handed the AVX-VNNI body, and every body
chosen -- with or without a limit (KVCACHE_ISA / set_isa) -- needs only features the CPU has.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcache import _core
from kvcache import _dispatch as dispatch

FLAGS = Path(__file__).parent / "data" / "cpu-flags"

ALL_BUILT = {fam: dispatch.HELD[fam] for fam in dispatch.FAMILIES}

# file -> (features expected from the flags, the body per family with every body built)
AVX2 = {"f32": "avx2", "q8": "avx2", "prefill": "avx2", "mla": "avx2"}
NEON = {"f32": "neon", "q8": "neon", "prefill": "neon", "mla": "neon"}
NEONDOT = dict(NEON, q8="neondot", prefill="neondot")
AVX512 = {"f32": "avx512", "q8": "avx512", "prefill": "avx512", "mla": "avx512"}
BASE512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"}
TABLE = {
    "intel-haswell.txt": ({"avx2", "fma", "f16c"}, AVX2),
    "intel-skylake-x.txt": (BASE512, AVX2),                         # no AVX512-VNNI
    "intel-cascade-lake.txt": (BASE512 | {"avx512vnni"}, AVX512),
    "intel-ice-lake-server.txt": (BASE512 | {"avx512vnni"}, AVX512),
    "intel-alder-lake.txt": ({"avx2", "fma", "f16c", "avxvnni"}, dict(AVX2, q8="avxvnni", prefill="avxvnni")),
    "intel-sapphire-rapids.txt": (BASE512 | {"avx512vnni", "avx512bf16", "avxvnni"}, AVX512),
    "amd-zen2.txt": ({"avx2", "fma", "f16c"}, AVX2),
    "amd-zen3.txt": ({"avx2", "fma", "f16c"}, AVX2),
    "amd-epyc-zen4-vm.txt": (BASE512 | {"avx512vnni", "avx512bf16"}, AVX512),
    "amd-zen5.txt": (BASE512 | {"avx512vnni", "avx512bf16", "avxvnni"}, AVX512),
    "amd-epyc-zen5-vm.txt": (BASE512 | {"avx512vnni", "avx512bf16", "avxvnni"}, AVX512),
    "arm-cortex-a53-rpi3.txt": ({"neon"}, NEON),                   # no asimddp
    "arm-cortex-a72-graviton.txt": ({"neon"}, NEON),
    "arm-neoverse-n1-graviton2.txt": ({"neon", "dotprod"}, NEONDOT),
    "arm-neoverse-v2-grace.txt": ({"neon", "dotprod"}, NEONDOT),
}


def flags_of(name: str) -> str:
    lines = (FLAGS / name).read_text().splitlines()
    assert lines[0].startswith("#") and len(lines) == 2
    return lines[1]


def test_the_table_covers_every_flags_file():
    assert sorted(p.name for p in FLAGS.glob("*.txt")) == sorted(TABLE)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_features_of_real_cpus(name):
    want, _ = TABLE[name]
    assert dispatch.features_from_cpuinfo(flags_of(name)) == want


@pytest.mark.parametrize("name", sorted(TABLE))
def test_choice_for_real_cpus(name):
    features = dispatch.features_from_cpuinfo(flags_of(name))
    _, want = TABLE[name]
    got = dispatch.choose(features, ALL_BUILT)
    assert got == want
    # the property the table illustrates, for every limit the CPU accepts
    for cap in [None, *dispatch.runnable(features)]:
        chosen = dispatch.choose(features, ALL_BUILT, cap=cap)
        for fam, body in chosen.items():
            assert dispatch.BODY_NEEDS[body] <= features, (name, cap, fam, body)
            if cap is not None:
                assert dispatch.BODY_NEEDS[body] <= dispatch.BODY_NEEDS[cap]
    # a body the CPU cannot run is refused as a limit
    for cap in set(dispatch.BODIES) - set(dispatch.runnable(features)):
        with pytest.raises(ValueError, match="does not report"):
            dispatch.choose(features, ALL_BUILT, cap=cap)


def test_avx512_without_avx_vnni_never_gets_the_vex_body():
    """The SIGILL of issue 23: Zen 4 / Cascade Lake / Ice Lake were ranked above AVX-VNNI."""
    for name in ("amd-epyc-zen4-vm.txt", "intel-cascade-lake.txt", "intel-ice-lake-server.txt"):
        features = dispatch.features_from_cpuinfo(flags_of(name))
        assert "avxvnni" not in features
        assert "avxvnni" not in dispatch.runnable(features)
        for cap in dispatch.runnable(features):
            assert "avxvnni" not in dispatch.choose(features, ALL_BUILT, cap=cap).values()


def test_a_cpu_without_avx2_runs_the_portable_bodies():
    nehalem = "fpu vme de pse tsc msr pae mce cx8 sse sse2 ssse3 sse4_1 sse4_2 popcnt lm"
    features = dispatch.features_from_cpuinfo(nehalem)
    assert features == frozenset()
    assert set(dispatch.choose(features, ALL_BUILT).values()) == {"portable"}
    with pytest.raises(ValueError):
        dispatch.choose(features, ALL_BUILT, cap="avx2")


def test_avx2_without_f16c_runs_the_portable_bodies():
    """Every x86 body converts the 4-bit modes' float16 parameters with F16C: a CPU (or a
    virtual machine's CPU model) that reports AVX2 and FMA but hides F16C gets none of them."""
    haswell = flags_of("intel-haswell.txt").split()
    features = dispatch.features_from_cpuinfo(" ".join(f for f in haswell if f != "f16c"))
    assert features == {"avx2", "fma"}
    assert dispatch.runnable(features) == ["portable"]
    assert set(dispatch.choose(features, ALL_BUILT).values()) == {"portable"}
    with pytest.raises(ValueError, match="needs f16c"):
        dispatch.choose(features, ALL_BUILT, cap="avx2")


def test_a_build_without_a_body_falls_back_to_the_next():
    features = dispatch.features_from_cpuinfo(flags_of("intel-sapphire-rapids.txt"))
    built = {"f32": ("portable",), "q8": ("portable", "avx2", "avxvnni"), "prefill": (),
             "mla": ("portable", "avx2")}
    assert dispatch.choose(features, built) == {"f32": "portable", "q8": "avxvnni",
                                                 "prefill": "portable", "mla": "avx2"}


def test_aarch64_features():
    line = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm asimddp"
    assert dispatch.features_from_cpuinfo(line) == {"neon", "dotprod"}
    assert dispatch.choose({"neon", "dotprod"}, ALL_BUILT) == {
        "f32": "neon", "q8": "neondot", "prefill": "neondot", "mla": "neon"}
    assert dispatch.choose({"neon"}, ALL_BUILT) == {           # Cortex-A53/A72: no sdot
        "f32": "neon", "q8": "neon", "prefill": "neon", "mla": "neon"}
    assert dispatch.choose({"neon", "dotprod"}, ALL_BUILT, cap="neon")["q8"] == "neon"


def test_preference_lists_only_held_bodies():
    for fam in dispatch.FAMILIES:
        assert set(dispatch.PREFERENCE[fam]) <= set(dispatch.HELD[fam])
        assert dispatch.PREFERENCE[fam][-1] == "portable"


def test_unknown_limit_is_refused():
    with pytest.raises(ValueError, match="expected one of"):
        dispatch.choose({"avx2", "fma"}, ALL_BUILT, cap="sse4")


def test_this_machine_runs_only_bodies_it_can():
    have = _core.cpu_features()
    for fam, body in _core.bodies().items():
        assert _core.body_needs(body) <= have, (fam, body)
        assert body in _core.built_bodies()[fam]
    assert _core.bodies() == dispatch.choose(have, _core.built_bodies(), cap=_core._isa_cap)


def test_detection_agrees_with_the_kernel_s_flags():
    """CPUID + XGETBV (kvc_cpu_features) against the flags Linux reports for this CPU (it lists
    a flag only when the OS supports it) -- on whatever machine runs the suite."""
    import platform
    cpuinfo = Path("/proc/cpuinfo")
    assert platform.system() != "Linux" or cpuinfo.exists()
    if not cpuinfo.exists():
        return
    key = "flags" if platform.machine() in ("x86_64", "AMD64") else "Features"
    lines = [ln for ln in cpuinfo.read_text().splitlines() if ln.split(":")[0].strip() == key]
    if not lines:                     # a CPU family whose flags line we do not read
        assert _core.cpu_features() <= {"neon", "dotprod"}
        return
    assert _core.cpu_features() == dispatch.features_from_cpuinfo(lines[0].split(":", 1)[1])
