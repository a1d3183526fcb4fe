"""A second training state from a trainer's weights and Adam state (``headrace serve``'s candidates).

The twin shares what never trains (the frozen base under a LoRA adapter, the KL reference, the
device thread) and copies what does (the trainable tensors and their optimizer state), so a
candidate trained on it never changes the incumbent it came from, and a rejected one is dropped
by letting go of it.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from headrace.core.types import AdamParams

if TYPE_CHECKING:
    from .trainer import TorchTrainer


def twin(trainer: TorchTrainer) -> TorchTrainer:
    """Runs on the device thread, between calls: no gradient is pending there."""
    from .trainer import TorchTrainer

    frozen = {id(p): p for name, p in trainer.model.named_parameters() if name not in trainer.params}
    model = copy.deepcopy(trainer.model, frozen)
    params = {name: p for name, p in model.named_parameters() if name in trainer.params}
    out = TorchTrainer(
        model,
        params,
        trainer._device_thread,
        trainer.device,
        trainer.pad_token_id,
        AdamParams(),  # placeholders, as for the first trainer: each optim_step brings the settings
        trainer.checkpoint_dir,
        trainer._publisher,
        microbatch_size=trainer.microbatch_size,
        identity=trainer._identity,
        max_nonfinite_skips=trainer.max_nonfinite_skips,
    )
    # parameters are listed in the same order in both models, which is how Adam's state is keyed
    out.optimizer.load_state_dict(copy.deepcopy(trainer.optimizer.state_dict()))
    out.optim_steps = trainer.optim_steps
    out.extra_state, out.restore_extra = trainer.extra_state, trainer.restore_extra
    out.reference_model, out._reference = trainer.reference_model, trainer._reference
    return out
