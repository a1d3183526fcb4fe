"""A training run: its config, registries, run directory, metrics and the actor graph that wires the core."""
