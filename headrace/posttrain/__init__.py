"""Post-training beside RL on the same learner: supervised fine-tuning (``headrace sft``) and
direct preference optimisation (``headrace dpo``), through a backend's protocols only."""
