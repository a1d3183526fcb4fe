"""What headrace finds by name: the registries (envs, schedulers, backends, config sections) and
the backend plugins' loading. Imports only ``core``, so every room above may use it."""
