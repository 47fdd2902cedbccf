"""KvMode: the storage precision of a layer's K and V rows (``docs/numerics.md``, int8 storage;
``docs/kv4.md``, 4-bit storage).

K and V are each stored in float32, int8 or 4 bits, chosen independently.

Two int8 schemes (:data:`SCHEMES`):

* ``"rows"`` (the default): every K row in groups of 16 channels with one float32 scale per
  group, every V row with one scale; nothing depends on how many rows existed when, so a row's
  bytes depend only on its own values and rollback/replay is exact at every position;
* ``"cmf"`` (the legacy scheme, what kvcache stored before the choice existed): K in groups of
  32 channels over a per-channel column field frozen once 64 positions are held
  (:mod:`kvcache.quant`).

4-bit V (``docs/kv4.md``): each row in groups of 16 channels, asymmetric (a float16 minimum
and step per group), codes 0..15 packed two per byte; a row's bytes depend only on its own
values, like the int8 "rows" scheme.  4-bit K: per channel over blocks of 32 rows, the open
block (and the last 64 rows) kept in float32.

Names (``parse``, ``from_env``, the CLI): "f32" ("float32"), "q8", "q8k", "q8v" (scheme
"rows") and "q8:cmf", "q8k:cmf", "q8v:cmf" (scheme "cmf"); "q8:rows" and friends also parse;
"k8v4" (int8 K in scheme "rows", 4-bit V; "k8v4:cmf" in scheme "cmf"), "q4v" (float32 K,
4-bit V), "q4" (4-bit K and V), "q4k" (4-bit K, float32 V) and "k4v8" (4-bit K, int8 V).  The general form "k<bits>v<bits>" with bits 32 (float32), 8 or 4 names the same
modes ("k32v32" is "f32", "k8v8" is "q8").
"""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["KvMode", "SCHEMES", "DEFAULT_SCHEME", "MODE_NAMES"]

_ENV = "KVCACHE_KV"
SCHEMES = ("rows", "cmf")
"""The int8 storage schemes, the default first."""
DEFAULT_SCHEME = "rows"
MODE_NAMES = ("f32", "q8", "q8k", "q8v", "q8:cmf", "q8k:cmf", "q8v:cmf", "q4", "k8v4",
              "k8v4:cmf", "q4v", "q4k", "k4v8", "k4v8:cmf")
"""The names :meth:`KvMode.parse` documents (it also takes "float32", "<name>:rows" and the
general "k<bits>v<bits>")."""
K_BITS = (32, 8, 4)
"""The precisions K can be stored in: float32 (32), int8 (8) or 4 bits (4)."""
V_BITS = (32, 8, 4)
"""The precisions V can be stored in: float32 (32), int8 (8) or 4 bits (4)."""
_NAMES_TEXT = ", ".join(repr(n) for n in MODE_NAMES)
# name -> (K bits, V bits)
_COMPONENTS = {"q8": (8, 8), "q8_2f": (8, 8), "q8k": (8, 32), "q8v": (32, 8), "q4v": (32, 4),
               "q4": (4, 4), "q4k": (4, 32)}
_BITS_NAME = re.compile(r"k(32|8|4)v(32|8|4)")


class KvMode:
    """Storage precision of a cache: float32, int8 or 4-bit rows for K and V.

    Use the constructors, not the class: ``KvMode.F32``, ``KvMode.Q8(k=True, v=True)``,
    ``KvMode.of(k_bits=8, v_bits=4)``, ``KvMode.parse("k8v4")``, ``KvMode.from_env()``.  Modes
    are immutable, hashable and equal by value.

    Attributes
    ----------
    k_bits, v_bits : int
        32 (float32), 8 (int8) or 4 (4-bit codes).
    quant_k, quant_v : bool
        Whether K (resp. V) rows are stored as **int8** (``k_bits == 8``).
    scheme : str
        The int8 scheme, "rows" or "cmf" (module docstring), when a component is int8; ""
        otherwise (a mode with no int8 component is one mode whatever scheme is asked for).
    """

    __slots__ = ("_k_bits", "_v_bits", "_scheme")
    _k_bits: int
    _v_bits: int
    _scheme: str

    F32: KvMode  # set below

    def __init__(self, quant_k: bool = False, quant_v: bool = False,
                 scheme: str = DEFAULT_SCHEME, v_bits: int | None = None,
                 k_bits: int | None = None) -> None:
        scheme = _check_scheme(scheme)
        kb = (8 if quant_k else 32) if k_bits is None else k_bits
        vb = (8 if quant_v else 32) if v_bits is None else v_bits
        if vb not in V_BITS or (quant_v and vb != 8):
            raise ValueError(f"v_bits: expected one of {V_BITS} (8 exactly when quant_v), got "
                             f"{v_bits!r}")
        if kb not in K_BITS or (quant_k and kb != 8):
            raise ValueError(f"k_bits: expected one of {K_BITS} (8 exactly when quant_k), got "
                             f"{k_bits!r}")
        object.__setattr__(self, "_k_bits", kb)
        object.__setattr__(self, "_v_bits", vb)
        object.__setattr__(self, "_scheme", scheme if 8 in (kb, vb) else "")

    @classmethod
    def Q8(cls, k: bool = True, v: bool = True, scheme: str = DEFAULT_SCHEME) -> KvMode:
        """int8 storage for K (``k``) and/or V (``v``); at least one must be set.

        ``scheme``: "rows" (default: per-row scales only, exact rollback at every position) or
        "cmf" (the legacy column-freeze scheme); ValueError for another value."""
        scheme = _check_scheme(scheme)
        if not (k or v):
            raise ValueError("KvMode.Q8 needs k or v set: Q8(k=False, v=False) stores nothing as "
                             "int8; use KvMode.F32")
        return cls(bool(k), bool(v), scheme)

    @classmethod
    def of(cls, k_bits: int = 32, v_bits: int = 32, scheme: str = DEFAULT_SCHEME) -> KvMode:
        """The mode storing K in ``k_bits`` (one of :data:`K_BITS`) and V in ``v_bits`` (one of
        :data:`V_BITS`); ``scheme`` is the int8 scheme of an int8 component.  ValueError (naming
        the argument) for another precision, TypeError for a non-integer."""
        for name, val, allowed in (("k_bits", k_bits, K_BITS), ("v_bits", v_bits, V_BITS)):
            if isinstance(val, bool) or not isinstance(val, int):
                raise TypeError(f"{name}: expected one of {allowed}, got {type(val).__name__}")
            if val not in allowed:
                raise ValueError(f"{name}: expected one of {allowed}, got {val}")
        return cls(k_bits == 8, v_bits == 8, scheme, v_bits, k_bits)

    @classmethod
    def from_env(cls) -> KvMode:
        """Read ``KVCACHE_KV``: a mode name as :meth:`parse` takes it ("f32", the default when
        unset or empty, "q8", "k8v4", ...)."""
        raw = os.environ.get(_ENV, "")
        mode = cls._named(raw)
        if mode is None:
            raise ValueError(f"{_ENV} must be one of {_NAMES_TEXT}, got {raw!r}")
        return mode

    @classmethod
    def parse(cls, value: object, name: str = "mode") -> KvMode:
        """``value`` itself when it is a KvMode, else the mode a name stands for: "f32"
        ("float32"), "q8" (int8 K and V), "q8k" (int8 K), "q8v" (int8 V), each in scheme
        "rows"; with the suffix ":cmf" (e.g. "q8:cmf") in the legacy scheme "cmf" (":rows" is
        also accepted); "q4" (4-bit K and V), "k8v4" (int8 K, 4-bit V), "q4v" (4-bit V),
        "q4k" (4-bit K), "k4v8" (4-bit K, int8 V); the general
        "k<bits>v<bits>" (bits 32, 8, 4 as :meth:`of` takes them); case-insensitive.

        ValueError for another name, TypeError for another type, both naming ``name``."""
        if isinstance(value, KvMode):
            return value
        if not isinstance(value, str):
            raise TypeError(f"{name}: expected a KvMode or a mode name, got "
                            f"{type(value).__name__}")
        mode = cls._named(value) if value.strip() else None
        if mode is None:
            raise ValueError(f"{name}: expected one of {_NAMES_TEXT} (or a KvMode), got "
                             f"{value!r}")
        return mode

    @classmethod
    def _named(cls, text: str) -> KvMode | None:
        """The mode named by ``text`` (the one table of names; "" is f32), or None."""
        val = text.strip().lower()
        if val in ("", "f32", "float32"):
            return cls.F32
        base, sep, scheme = val.partition(":")
        base = base.strip()
        bits = _COMPONENTS.get(base)
        if bits is None:
            m = _BITS_NAME.fullmatch(base)
            bits = (int(m.group(1)), int(m.group(2))) if m else None
        scheme = scheme.strip() if sep else DEFAULT_SCHEME
        if bits is None or scheme not in SCHEMES:
            return None
        return cls.of(bits[0], bits[1], scheme)

    @property
    def k_bits(self) -> int:
        """K's precision: 32 (float32), 8 (int8) or 4 (4-bit codes)."""
        return self._k_bits

    @property
    def k4(self) -> bool:
        """Whether K rows are 4-bit codes."""
        return self._k_bits == 4

    @property
    def v_bits(self) -> int:
        """V's precision: 32 (float32), 8 (int8) or 4 (4-bit codes)."""
        return self._v_bits

    @property
    def quant_k(self) -> bool:
        """Whether K rows are int8 (4-bit K is :attr:`k4`)."""
        return self._k_bits == 8

    @property
    def quant_v(self) -> bool:
        """Whether V rows are int8 (4-bit V is :attr:`v4`)."""
        return self._v_bits == 8

    @property
    def v4(self) -> bool:
        """Whether V rows are 4-bit codes."""
        return self._v_bits == 4

    @property
    def scheme(self) -> str:
        """The int8 scheme: "rows" or "cmf" when a component is int8, "" otherwise (module
        docstring)."""
        return self._scheme

    @property
    def is_f32(self) -> bool:
        """Whether K and V are both float32."""
        return self._k_bits == 32 and self._v_bits == 32

    @property
    def freezes_columns(self) -> bool:
        """Whether a cache in this mode freezes a column field (q8 in scheme "cmf")."""
        return self._scheme == "cmf"

    @property
    def name(self) -> str:
        """The name :meth:`parse` maps to this mode: "f32", "q8", "q8k", "q8v", "q4", "k8v4",
        "q4v", "q4k", "k4v8", or one of those with ":cmf"."""
        kb, vb = self._k_bits, self._v_bits
        if self.is_f32:
            return "f32"
        base = {(8, 8): "q8", (8, 32): "q8k", (32, 8): "q8v", (8, 4): "k8v4",
                (32, 4): "q4v", (4, 4): "q4", (4, 32): "q4k", (4, 8): "k4v8"}[(kb, vb)]
        return base if self._scheme in ("", DEFAULT_SCHEME) else f"{base}:{self._scheme}"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("KvMode is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KvMode):
            return NotImplemented
        return ((self._k_bits, self._v_bits, self._scheme)
                == (other._k_bits, other._v_bits, other._scheme))

    def __hash__(self) -> int:
        if 4 not in (self._k_bits, self._v_bits):   # int8/float32 modes: as it always was
            return hash(("KvMode", self.quant_k, self.quant_v, self._scheme))
        return hash(("KvMode", self._k_bits, self._v_bits, self._scheme))

    def __repr__(self) -> str:
        if self.is_f32:
            return "KvMode.F32"
        extra = "" if self._scheme in ("", DEFAULT_SCHEME) else f", scheme={self._scheme!r}"
        if 4 in (self._k_bits, self._v_bits):
            return f"KvMode.of(k_bits={self._k_bits}, v_bits={self._v_bits}{extra})"
        return f"KvMode.Q8(k={self.quant_k}, v={self.quant_v}{extra})"

    def __reduce__(self) -> tuple[type[KvMode], tuple[Any, ...]]:
        args: tuple[Any, ...] = (self.quant_k, self.quant_v, self._scheme or DEFAULT_SCHEME)
        if 4 in (self._k_bits, self._v_bits):
            args += (self._v_bits, self._k_bits)
        return (KvMode, args)


def _check_scheme(scheme: object) -> str:
    """``scheme`` when it is one of :data:`SCHEMES`, else ValueError (TypeError for a
    non-string) naming it."""
    if not isinstance(scheme, str):
        raise TypeError(f"scheme: expected one of {', '.join(map(repr, SCHEMES))}, got "
                        f"{type(scheme).__name__}")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {', '.join(map(repr, SCHEMES))}, got "
                         f"{scheme!r}")
    return scheme


KvMode.F32 = KvMode(False, False)
