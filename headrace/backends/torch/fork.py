"""A second training state from a trainer's weights (``TorchTrainer.fork``, ``headrace serve``'s candidates).

The copy shares what never trains (the frozen base under a LoRA adapter) and copies what does
(the trainable tensors), so a candidate trained on it never changes the incumbent it came from,
and a rejected one is dropped by letting go of it.
"""

from __future__ import annotations

import copy

from torch import nn


def trainable_copy(model: nn.Module, params: dict[str, nn.Parameter]) -> tuple[nn.Module, dict[str, nn.Parameter]]:
    """``model`` copied except the parameters not in ``params`` (shared), and the copy's ``params``."""
    frozen = {id(p): p for name, p in model.named_parameters() if name not in params}
    twin = copy.deepcopy(model, frozen)
    return twin, {name: p for name, p in twin.named_parameters() if name in params}
