"""The engine's core: the types, the actors and the channels between them; no backend, no config file, no CLI."""
