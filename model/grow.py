"""Deeper encoders from a trained checkpoint: each new encoder layer starts as a copy of a trained one.

Training a deeper model from a trained shallower one reaches its quality in a fraction of the steps a
from-scratch run needs (progressive stacking, Gong et al., ICML 2019). Only the encoder grows: it runs
once per request, while every decoder layer runs at every generated token, so encoder depth is the
cheap kind of capacity for a serving model (Kasai et al., "Deep Encoder, Shallow Decoder", ICLR 2021).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import Tensor

ENCODER_LAYER = re.compile(r"^encoder_layers\.(\d+)\.(.+)$")
# `cycle`: the trained stack twice over, bottom to top (0,1,2,0,1,2), as progressive stacking does;
# `repeat`: each trained layer twice in place (0,0,1,1,2,2).
STACK_ORDERS = ("cycle", "repeat")


def source_layer_order(source_layers: int, target_layers: int, order: str) -> list[int]:
    """Which trained layer each of the `target_layers` new layers copies."""
    if order not in STACK_ORDERS:
        raise ValueError(f"stack order {order!r}: use one of {', '.join(STACK_ORDERS)}")
    if target_layers < source_layers:
        raise ValueError(f"encoder layers: {target_layers} is fewer than the checkpoint's {source_layers}; layers are only added")
    if order == "cycle":
        return [index % source_layers for index in range(target_layers)]
    return [index * source_layers // target_layers for index in range(target_layers)]


def grow_encoder(state: Mapping[str, Tensor], source_layers: int, target_layers: int, order: str = "cycle") -> dict[str, Tensor]:
    """`state` with `target_layers` encoder layers, each a copy (not a view) of the trained layer the order names."""
    grown = {name: tensor for name, tensor in state.items() if not ENCODER_LAYER.match(name)}
    by_layer: dict[int, dict[str, Tensor]] = {}
    for name, tensor in state.items():
        match = ENCODER_LAYER.match(name)
        if match:
            by_layer.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    if sorted(by_layer) != list(range(source_layers)):
        raise ValueError(f"checkpoint holds encoder layers {sorted(by_layer)}, its config says {source_layers}")
    for target, source in enumerate(source_layer_order(source_layers, target_layers, order)):
        for suffix, tensor in by_layer[source].items():
            grown[f"encoder_layers.{target}.{suffix}"] = tensor.clone()
    return grown
