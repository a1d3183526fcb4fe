"""The schedulers, picked by name: the same actors, wired differently."""
