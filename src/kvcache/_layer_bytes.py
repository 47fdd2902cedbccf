"""The byte formats of a :class:`kvcache.LayerKvCache`: :class:`LayerBytes`, the methods that
write a layer to bytes and read it back (``export_wire`` / ``import_wire``: the legacy layout;
``to_bytes`` / ``from_bytes``: kvcache's versioned, checksummed format; docs/formats.md).

A mixin over the layer's state protocol: :mod:`kvcache.wire` reads the layer through
``state()`` and a buffer is installed through ``install()``, so these methods never touch
the layer's fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from . import wire

if TYPE_CHECKING:
    from ._state import LayerState
    from .layer import LayerKvCache

__all__ = ["LayerBytes"]


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
            Identifies the model/configuration; :meth:`from_bytes` checks it when given one.
        """
        return wire.layer_to_bytes(cast("LayerKvCache", self), f16, fingerprint)

    def from_bytes(self, buf: wire.BufferLike, *,
                   fingerprint: wire.Fingerprint | None = None) -> None:
        """Install a buffer made by :meth:`to_bytes` into this layer, atomically.

        The digest, the format, the geometry (num_kv_heads and head_dim must match; the mode
        comes from the buffer) and, when given, the fingerprint are checked and the whole body
        validated before anything changes.  Every bad buffer raises kvcache.WireError.

        A layer that stores int8 rows keeps its int8 scheme: a buffer of int8 rows in the other
        scheme is refused (WireError, nothing changes).  A buffer of format version 1 (written
        before the scheme was recorded) holds scheme "cmf"; read it into a layer made with
        ``mode="q8:cmf"`` (or an F32 layer), or with ``KvCache.load``."""
        self.install(wire.layer_from_bytes(cast("LayerKvCache", self), buf, fingerprint))

