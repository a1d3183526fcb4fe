"""``inflight``: ``async`` with two differences, and nothing else.

- Admission by samples, not batches: the gate admits the next group whenever the staleness bound
  allows it, so a finished group's slot is refilled at once and the sampler stays saturated;
  finished groups train in order of deadline and arrival, not in the dataset's batches, so a step
  does not wait for the slowest group of a batch (``core/admission.py``'s ``InflightGate``).
- The sampler takes new weights *during* a generation: tokens after the swap come from the new
  version, and each token carries the version that made it.

``max_steps_off_policy`` bounds the oldest token of every trained sample. No group is dropped
for being slow: when a running group would pass its bound, the learner waits for it (``hold``,
the default, chosen from the measurements in ``benchmarks/RESULTS.md``, "In-flight updates"); the
alternative, restarting it with current weights (``regenerate``), is ``InflightRegenerate``.

Needs a sampler that can swap weights mid-generation (``SwapsWeightsInFlight``, ``core/protocols.py``):
today ``sim`` and ``torch``; ``--cluster ray``'s replicas refuse it when the backend is made.
"""

from headrace.core.errors import ConfigError
from headrace.core.protocols import swaps_in_flight
from headrace.schedulers.base import Scheduler

# backends whose sampler takes new weights during a generation (kept in step with each
# backend's own ``inflight_swap`` capability, which is what is checked)
SWAP_BACKENDS = ("sim", "torch")


class InflightScheduler(Scheduler):
    """Async, admitting group by group, with new weights swapped into running generations (sim, torch)."""

    name = "inflight"
    overdue = "hold"

    def lag(self) -> int:
        return self.options.max_steps_off_policy

    def admission(self) -> str:
        return "sample"

    def swap_in_flight(self) -> bool:
        return True

    def check_backend(self, sampling: object) -> None:
        if swaps_in_flight(sampling):
            return
        name = self.options.sampler
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
