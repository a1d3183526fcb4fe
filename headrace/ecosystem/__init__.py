"""Environments from the ecosystem as headrace envs: ``openenv`` (an OpenEnv server, driven
through ``openenv-core``'s client) and ``verifiers`` (a verifiers environment, its own rollouts run
through the agents' endpoint). Each imports its package only when it is used."""
