"""A training run: its config, backend, scheduler, run directory, metrics, and the actor graph wiring the core."""
