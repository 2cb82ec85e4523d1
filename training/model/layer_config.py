"""A config attribute that may differ per layer (transformers' heterogeneous configs: Gemma 4's full-attention
layers have a head size of their own in `per_layer_config`, and reading `config.head_dim` on such a config raises
AmbiguousGlobalPerLayerAttributeError), or is a list of one per layer (Gemma 3n's intermediate_size)."""

from __future__ import annotations


def layer_values(config, name: str) -> list:
    """`config.name` for each decoder layer ([] where the config has no such attribute or it is None)."""
    try:
        value = getattr(config, name, None)
    except RuntimeError:  # per-layer on a heterogeneous config: each layer's own
        layers = config.per_layer_config
        values = [getattr(layers[i], name, None) for i in range(config.num_hidden_layers)]
        return [v for v in values if v is not None]
    if isinstance(value, list | tuple):  # Gemma 3n's intermediate_size: one per layer
        return [v for v in value if v is not None]
    return [] if value is None else [value] * max(int(getattr(config, "num_hidden_layers", 1) or 1), 1)


def largest(config, name: str):
    """The largest layer's value (memory plans: an upper bound), or None."""
    values = layer_values(config, name)
    return max(values) if values else None


def mean(config, name: str):
    """The layers' mean value, rounded (FLOP counts: the layers' sum over their number), or None."""
    values = layer_values(config, name)
    return round(sum(values) / len(values)) if values else None
