"""Networking shared by the servers headrace runs: the Tinker emulator and ``headrace serve``."""
