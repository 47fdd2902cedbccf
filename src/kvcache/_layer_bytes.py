"""The byte formats of a :class:`kvcache.LayerKvCache`: :class:`LayerBytes`, the methods that
write a layer to bytes and read it back (``export_wire`` / ``import_wire``: the legacy layout;
``to_bytes`` / ``from_bytes`` / ``install_bytes``: kvcache's versioned, checksummed format;
docs/formats.md).

One name per idea, as on :class:`kvcache.KvCache`: ``to_bytes()`` writes, the classmethod
``from_bytes(buf)`` builds a new layer (as ``KvCache.from_bytes`` / ``KvCache.load`` build a
new cache), and ``install_bytes(buf)`` replaces what an existing layer holds (as
``install(state)`` does with a state).  ``layer.from_bytes(buf)`` on an instance, which
installed before 0.2.0, still installs for one release, with a DeprecationWarning.

A mixin over the layer's state protocol: :mod:`kvcache.wire` reads the layer through
``state()`` and a buffer is installed through ``install()``, so these methods never touch
the layer's fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol, TypeVar, Union, cast, overload

from . import _deprecated, wire

if TYPE_CHECKING:
    from ._state import LayerState
    from .layer import LayerKvCache

__all__ = ["LayerBytes"]

_L = TypeVar("_L", bound="LayerKvCache")
_L_co = TypeVar("_L_co", bound="LayerKvCache", covariant=True)


class _Build(Protocol[_L_co]):
    def __call__(self, buf: wire.BufferLike, *,
                 fingerprint: Optional[wire.Fingerprint] = None) -> _L_co: ...


class _Install(Protocol):
    def __call__(self, buf: wire.BufferLike, *,
                 fingerprint: Optional[wire.Fingerprint] = None) -> None: ...


class _FromBytes:
    """``from_bytes``: on the class, build a new layer from a buffer; on an instance
    (deprecated), install the buffer into it as ``install_bytes`` does."""

    @overload
    def __get__(self, obj: None, owner: type[_L]) -> _Build[_L]: ...

    @overload
    def __get__(self, obj: _L, owner: Optional[type[_L]] = None) -> _Install: ...

    def __get__(self, obj: Optional[LayerKvCache],
                owner: Optional[type[LayerKvCache]] = None) -> Union[_Build[Any], _Install]:
        if obj is None:
            assert owner is not None
            cls = owner

            def build(buf: wire.BufferLike, *,
                      fingerprint: Optional[wire.Fingerprint] = None) -> LayerKvCache:
                st = wire.read_layer(buf, fingerprint)
                layer = cls(st.num_kv_heads, st.head_dim, mode=st.mode)
                layer.install(st, any_scheme=True)        # the buffer's int8 scheme
                return layer

            build.__doc__ = _FROM_BYTES_DOC
            return build
        layer = obj

        def install(buf: wire.BufferLike, *,
                    fingerprint: Optional[wire.Fingerprint] = None) -> None:
            _deprecated.warn("kvcache.LayerKvCache.from_bytes() on an instance",
                             "install_bytes() (from_bytes is a classmethod that builds a new "
                             "layer)")
            layer.install_bytes(buf, fingerprint=fingerprint)

        install.__doc__ = "Deprecated: ``install_bytes`` (a DeprecationWarning)."
        return install


_FROM_BYTES_DOC = """A new layer built from a buffer made by :meth:`to_bytes` (a classmethod).

        The geometry (num_kv_heads, head_dim), the mode and its int8 scheme come from the
        buffer.  The digest, the format and, when given, the fingerprint are checked and the
        whole body validated first; every bad buffer raises kvcache.WireError.  Re-exporting
        the new layer gives the same bytes (``to_bytes`` with the same arguments).

        Parameters
        ----------
        buf : bytes-like
        fingerprint : bytes or str, optional
            Must equal the one the buffer was written with (not checked when None).

        Called on an instance (``layer.from_bytes(buf)``) it installs into that layer as
        :meth:`install_bytes` does, with a DeprecationWarning (the 0.1 meaning, kept for one
        release)."""


class LayerBytes:
    """The byte-format methods of :class:`kvcache.LayerKvCache` (module docstring)."""

    def install(self, state: LayerState, any_scheme: bool = False) -> None:
        raise NotImplementedError        # LayerKvCache.install

    def export_wire(self, f16: bool = False) -> bytes:
        """The layer in the legacy wire layout (byte layout: docs/formats.md, kvcache.wire).

        Parameters
        ----------
        f16 : bool
            Send K/V rows as IEEE binary16 (linear state and importance stay float32).

        Raises
        ------
        kvcache.WireError
            For what the layout cannot describe: int8 storage (the message says "F32"), O(1)
            state, frozen columns.  Use :meth:`to_bytes` for those.
        """
        return wire.export_wire(cast("LayerKvCache", self), f16)

    def import_wire(self, buf: wire.BufferLike) -> None:
        """Install a legacy-layout buffer (from :meth:`export_wire` or the upstream engine).

        Atomic: the buffer is parsed and validated completely (geometry, lengths, no trailing
        bytes) before anything changes; a bad buffer raises kvcache.WireError and leaves the
        layer untouched.  The layer becomes F32; columns and O(1) state are reset;
        ``linear_scratch`` is kept."""
        self.install(wire.import_wire(cast("LayerKvCache", self), buf))

    def to_bytes(self, *, f16: bool = False,
                 fingerprint: wire.Fingerprint | None = None) -> bytes:
        """The whole layer in kvcache's versioned, checksummed format (docs/formats.md).

        Carries everything the layer holds: f32 or int8 rows with their scales and frozen
        columns, dead heads, importance, linear state and scratch, O(1) state (collecting or
        sealed).

        Parameters
        ----------
        f16 : bool
            Store float32 K/V rows as binary16 (int8 rows, scales and state are unchanged).
        fingerprint : bytes or str, optional
            Identifies the model/configuration; :meth:`from_bytes` and :meth:`install_bytes`
            check it when given one.
        """
        return wire.layer_to_bytes(cast("LayerKvCache", self), f16, fingerprint)

    from_bytes = _FromBytes()

    def install_bytes(self, buf: wire.BufferLike, *,
                      fingerprint: wire.Fingerprint | None = None) -> None:
        """Install a buffer made by :meth:`to_bytes` into this layer, atomically.

        The digest, the format, the geometry (num_kv_heads and head_dim must match; the mode
        comes from the buffer) and, when given, the fingerprint are checked and the whole body
        validated before anything changes.  Every bad buffer raises kvcache.WireError.

        A layer that stores int8 rows keeps its int8 scheme: a buffer of int8 rows in the other
        scheme is refused (WireError, nothing changes).  A buffer of format version 1 (written
        before the scheme was recorded) holds scheme "cmf"; read it into a layer made with
        ``mode="q8:cmf"`` (or an F32 layer), or build a new layer with :meth:`from_bytes`.

        The classmethod :meth:`from_bytes` builds a new layer instead."""
        self.install(wire.layer_from_bytes(cast("LayerKvCache", self), buf, fingerprint))

