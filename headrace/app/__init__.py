"""The command line and what only it needs (live progress, plots)."""
