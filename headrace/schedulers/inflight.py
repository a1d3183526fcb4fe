"""``inflight``: ``async`` with two differences, and nothing else.

- Admission by samples, not batches: the gate admits the next group whenever the staleness bound
  allows it, so a finished group's slot is refilled at once and the sampler stays saturated;
  finished groups train in order of deadline and arrival, not in the dataset's batches, so a step
  does not wait for the slowest group of a batch (``core/gate.py``'s ``InflightGate``).
- The sampler takes new weights *during* a generation: tokens after the swap come from the new
  version, and each token carries the version that made it.

``max_steps_off_policy`` bounds the oldest token of every trained sample. No group is dropped
for being slow: when a running group would pass its bound, the learner waits for it (``hold``,
the default, chosen from the measurements in ``benchmarks/RESULTS.md``, "In-flight updates"); the
alternative, restarting it with current weights (``regenerate``), is ``InflightRegenerate``.

Needs a sampler that can swap weights mid-generation (``inflight_swap``): today ``sim`` and ``torch``.
"""

from headrace.core.sampler import supports_inflight_swap
from headrace.run.config import ConfigError
from headrace.schedulers.base import Scheduler

# backends whose sampler takes new weights during a generation (kept in step with each
# backend's own ``inflight_swap`` attribute, which is what is checked)
SWAP_BACKENDS = ("sim", "torch")


class InflightScheduler(Scheduler):
    """Async, admitting group by group, with new weights swapped into running generations (sim, torch)."""

    name = "inflight"
    overdue = "hold"

    def check(self) -> None:
        if self.config.cluster.kind == "ray":
            raise ConfigError(
                "the inflight scheduler swaps weights into generations that are running, which --cluster ray's "
                "sampler replicas do not do yet (a request is served by one version there). Use --scheduler async "
                "on the cluster (the same staleness bound, weights swapped between calls), or inflight in one "
                "process (--cluster none)."
            )

    def lag(self) -> int:
        return self.config.max_steps_off_policy

    def admission(self) -> str:
        return "sample"

    def swap_in_flight(self) -> bool:
        return True

    def check_backend(self, sampling: object) -> None:
        if supports_inflight_swap(sampling):
            return
        name = self.config.sampler or self.config.backend
        raise ConfigError(
            f"the inflight scheduler swaps weights into generations that are running, and the '{name}' "
            f"sampler cannot ({type(sampling).__name__} has no in-flight weight swap): its tokens after "
            "an update would be labelled with weights that did not make them. Use --scheduler async "
            f"(the same staleness bound, weights swapped between calls), or a backend that can: "
            f"{', '.join(SWAP_BACKENDS)}."
        )


class InflightRegenerate(InflightScheduler):
    """``inflight`` that restarts an overdue group instead of holding the learner (measured in
    RESULTS.md; not registered by default: ``registry.schedulers.register("inflight_regenerate", ...)``)."""

    name = "inflight_regenerate"
    overdue = "regenerate"
