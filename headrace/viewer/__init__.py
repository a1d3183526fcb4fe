"""See what the model does: sampled rollouts per step (``samples``) and a static HTML page to browse
them (``page``, ``headrace view RUN_DIR``)."""

from headrace.viewer.samples import RolloutSampleWriter, SampleGroup

__all__ = ["RolloutSampleWriter", "SampleGroup"]
