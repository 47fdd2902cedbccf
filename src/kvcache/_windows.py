"""Which decoder layers attend through a sliding window, as transformers decides it.

One rule for :mod:`kvcache.runner` (which reads a ``config.json`` dict) and :mod:`kvcache.hf`
(which reads a transformers config object): :func:`layer_windows` accepts either.  A leaf
module: it imports nothing of kvcache.

The rule, read from transformers 5.24's config classes and modeling code:

- Llama has no sliding attention: no layer gets a window, whatever the config says.
- Mistral-style families (Mistral, Mixtral, Ministral 3, Phi-3, Starcoder2, OLMoE) apply the
  config's ``sliding_window`` on every layer; their modeling code never reads ``layer_types``
  (MistralConfig warns when it is given one and ignores it).
- Qwen-style configs (a ``use_sliding_window`` key): the window is off unless
  ``use_sliding_window`` is true; then, without ``layer_types``, layers ``i >=
  max_window_layers`` slide (28 when the key is missing, Qwen2Config's default) and the first
  ``max_window_layers`` layers attend fully.
- Otherwise ``layer_types`` decides: ``"sliding_attention"`` layers get the window, every
  other type none.  Without ``layer_types``, Gemma-2 slides on its even layers (0, 2, ...,
  Gemma2Config's default), Gemma 3 on every layer but each ``sliding_window_pattern``-th
  (layer i slides unless ``(i + 1) % pattern == 0``; 6 when the key is missing, as in
  Gemma3TextConfig) and any other family on every layer.

A layer typed ``"sliding_attention"`` whose config has no window (``sliding_window`` null, or
Qwen's ``use_sliding_window`` false) gets none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["EVERY_LAYER_FAMILIES", "NO_WINDOW_FAMILIES", "layer_windows"]

#: Families whose attention never slides (transformers' Llama ignores ``sliding_window``).
NO_WINDOW_FAMILIES = frozenset({"llama"})
#: Families that apply ``sliding_window`` on every layer and ignore ``layer_types``.
EVERY_LAYER_FAMILIES = frozenset({"mistral", "mixtral", "ministral3", "phi3", "starcoder2",
                                  "olmoe"})
#: Qwen2Config's ``max_window_layers`` when a config leaves it out.
QWEN_MAX_WINDOW_LAYERS = 28
#: Gemma3TextConfig's ``sliding_window_pattern`` when a config leaves it out.
GEMMA3_PATTERN = 6

_MISSING = object()


def _get(config: Mapping[str, object] | object, key: str, default: object = None) -> object:
    """``config[key]`` of a dict, or the attribute of a config object; ``default`` if absent."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _as_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"config: {name} must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"config: {name} must be an integer, got {value!r}") from None


def layer_windows(config: Mapping[str, object] | object, n_layers: int | None = None,
                  model_type: str | None = None) -> tuple[int | None, ...]:
    """Per decoder layer: its sliding window (an int) or None for full attention.

    Parameters
    ----------
    config : mapping or transformers config object
        A ``config.json`` dict (keys a file leaves out take the rule's defaults, see the module
        docstring) or a transformers ``PretrainedConfig`` (its text/decoder part).
    n_layers : int, optional
        Number of decoder layers; default ``num_hidden_layers`` of the config.
    model_type : str, optional
        Default: the config's ``model_type``.

    Returns
    -------
    tuple of (int or None), one per layer

    Raises
    ------
    ValueError
        ``layer_types`` does not have one entry per layer, or a count is not an integer.
    """
    family = model_type if model_type is not None else _get(config, "model_type")
    if n_layers is None:
        n_layers = _as_count("num_hidden_layers", _get(config, "num_hidden_layers"))
    if family in NO_WINDOW_FAMILIES:
        return (None,) * n_layers
    types = None if family in EVERY_LAYER_FAMILIES else _get(config, "layer_types")
    if types is not None and (not isinstance(types, Sequence) or isinstance(types, str)
                              or len(types) != n_layers):
        count = len(types) if isinstance(types, Sequence) else repr(types)
        raise ValueError(f"config: layer_types has {count} entries for {n_layers} layers")
    raw = _get(config, "sliding_window")
    window = None if raw is None else _as_count("sliding_window", raw)
    qwen_style = _get(config, "use_sliding_window", _MISSING) is not _MISSING
    if qwen_style and not _get(config, "use_sliding_window"):
        window = None
    if not window:                          # null or 0: no layer slides
        return (None,) * n_layers
    if types is not None:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if family in EVERY_LAYER_FAMILIES:
        return (window,) * n_layers
    if qwen_style:
        first = _get(config, "max_window_layers")
        first = QWEN_MAX_WINDOW_LAYERS if first is None else _as_count("max_window_layers", first)
        return tuple(window if i >= first else None for i in range(n_layers))
    if family == "gemma2":
        return tuple(window if i % 2 == 0 else None for i in range(n_layers))
    if family in ("gemma3_text", "gemma3"):
        pattern = _get(config, "sliding_window_pattern")
        pattern = GEMMA3_PATTERN if pattern is None else _as_count("sliding_window_pattern",
                                                                   pattern)
        if pattern < 1:
            raise ValueError(f"config: sliding_window_pattern must be >= 1, got {pattern}")
        return tuple(window if (i + 1) % pattern else None for i in range(n_layers))
    return (window,) * n_layers
