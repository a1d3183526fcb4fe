"""The core: types, actors, channels, learner pipeline, retry, checkpoints, metrics, registry, CLI."""
