"""``--cluster ray``: the same schedulers, with their parts in Ray actors. A backend plugin of kind
``cluster`` (``plugin.py``): it gets its ``[ray]`` section (``config.py``), the run's
``BackendContext`` and the training and sampler backends it places (their names and sections),
which it builds in its own processes; never the run's config.

- ``workers.py``: rollout workers, processes that build and step the envs (the driver keeps each
  episode's loop and sends every env call to the worker holding the env);
- ``replicas.py``: sampler replicas, each holding the weights, and the router that sends a request
  to the replica with the fewest outstanding;
- ``learner.py``: the learner as K data-parallel processes (torch.distributed over gloo);
- ``backend.py``: the three assembled as one ``Backend``, so the actor graph runs unchanged;
- ``runtime.py``: starting (or joining) Ray with no outbound network.
"""
