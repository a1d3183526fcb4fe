"""Agents as envs: any program that speaks the OpenAI API trains through an endpoint headrace serves.

``agent_env(ctx, agent, problems)`` (``env.py``) makes the dataset; each episode's agent gets an
:class:`AgentEpisode` with a ``base_url`` of its own on the run's loopback endpoint
(``endpoint.py``), where every chat completion or Responses call is rendered by the run's renderer,
sampled by the run's sampler and recorded as a turn of the episode (``bridge.py``).
``command_agent(argv)`` runs a program as the agent.
"""

from headrace.agents.command import command_agent
from headrace.agents.env import AgentDataset, AgentEpisode, AgentResult, agent_env

__all__ = ["AgentDataset", "AgentEpisode", "AgentResult", "agent_env", "command_agent"]
