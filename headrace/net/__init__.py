"""Networking shared by the servers headrace runs: the Tinker emulator, ``headrace serve`` and the
agents' OpenAI-compatible endpoint (``headrace/agents``)."""
