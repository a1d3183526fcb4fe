"""A run's config with its model's defaults filled in where the user set none."""

from __future__ import annotations

from typing import Any

from headrace.models.registry import model_spec
from headrace.plugins.backends import get_plugin
from headrace.run.config import RunConfig


def apply_model_defaults(config: RunConfig) -> RunConfig:
    """``config`` with the model's defaults where the user set nothing: ``sampling.max_tokens``,
    ``optim.learning_rate``, and what the run's backends take from the model (their plugins'
    ``model_defaults``: the torch backend's ``torch.lora_rank``, None = the model's default). What
    the user set (a TOML file, a flag, ``--set``, a resumed run's saved config) is kept."""
    spec = model_spec(config.model)
    update: dict[str, Any] = {}
    if "max_tokens" not in config.sampling.model_fields_set:
        sampled_by = get_plugin(config.sampler or config.backend)
        max_tokens = spec.max_tokens + sampled_by.extra_sample_tokens
        update["sampling"] = config.sampling.model_copy(update={"max_tokens": max_tokens})
    if "learning_rate" not in config.optim.model_fields_set:
        update["optim"] = config.optim.model_copy(update={"learning_rate": spec.learning_rate})
    for name in filter(None, (config.backend, config.sampler)):
        plugin = get_plugin(name)
        if plugin.model_defaults is not None:
            section = config.section(plugin.name)
            if (filled := plugin.model_defaults(section, config.model)) is not section:
                update[plugin.name] = filled
    return config.model_copy(update=update) if update else config
