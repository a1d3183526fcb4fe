"""The task library: graders, generated and loaded datasets, and a sandbox for tool calls.

The env-independent core lives here (``grading``, ``word_math``, ``datasets``, ``sandbox``); the
envs built on it are registered by name like every other env.
"""
