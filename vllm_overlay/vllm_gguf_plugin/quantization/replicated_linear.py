# SPDX-License-Identifier: Apache-2.0
"""GGUF linear method for layers without a v2 weight loader (ReplicatedLinear, e.g.
DeepSeek-V3.2's and GLM-5's indexer `wq_b`).

`GGUFLinearMethod` hands such a layer's own v1 loader to its parameters. Since vLLM
0.24 that loader copies into the parameter as it is, so a GGUF parameter, still empty
until its tensor arrives, refuses every tensor ("Tried to load weights of size ... to a
parameter of size [0]"). Here a whole (unsharded) tensor goes to the parameter's own
store, as the v2 loaders of the parallel layers do.
"""

import torch

from .linear import GGUFLinearMethod


def whole_weight_loader(layer_weight_loader):
    """The layer's loader, with whole tensors stored by the GGUF parameter itself."""

    def weight_loader(param, loaded_weight, *args, **kwargs):
        if hasattr(param, "_store") and not args and not kwargs:
            param._store(loaded_weight)
            return None
        return layer_weight_loader(param, loaded_weight, *args, **kwargs)

    return weight_loader


class GGUFReplicatedLinearMethod(GGUFLinearMethod):
    """`GGUFLinearMethod` for a layer without `weight_loader_v2`."""

    def create_weights(self, layer: torch.nn.Module, *args, **kwargs):
        super().create_weights(layer, *args, **kwargs)
        # the weight types already take whole tensors (_resolve_gguf_weight_type_loader)
        layer.qweight.weight_loader = whole_weight_loader(layer.qweight.weight_loader)
