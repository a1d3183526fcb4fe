"""``fork()`` and ``close()`` of the tinker training backend, through the SDK against the emulator:
a candidate trained from the incumbent leaves the incumbent as it was, starts from its Adam
state, and a closed training (the original included) lets the backend exit cleanly."""

from __future__ import annotations

import pytest

pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker_support import backend_config, emulator, ops, step_datums, tinker_env  # noqa: F401

from headrace.backends.tinker import convert
from headrace.core.errors import BackendFailure
from headrace.core.types import AdamParams, LossSpec
from headrace.run.backends import make_backend

pytestmark = [pytest.mark.slow, pytest.mark.tinker, pytest.mark.timeout(120)]
ADAM = AdamParams(learning_rate=0.05)
LOSS = LossSpec("importance_sampling")
PROBE = [5, 6, 7, 8, 9, 10]  # a fixed prompt + completion, scored token by token


async def _step(training, k: int) -> None:
    """One training step on ``step_datums(k)`` (nonzero advantages)."""
    training.forward_backward(step_datums(k), LOSS)
    await training.optim_step(ADAM)


async def _sampler_logprobs(sampler) -> list[float]:
    return (await sampler.compute_logprobs(types.ModelInput.from_ints(PROBE)))[1:]


async def _trainer_logprobs(client) -> list[float]:
    """The training client's own forward on the probe: its weights on the service, no save."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROBE[:-1]),
        loss_fn_inputs={"target_tokens": PROBE[1:], "weights": [1.0] * (len(PROBE) - 1)},
    )
    return (await client.forward([datum], "cross_entropy")).loss_fn_outputs[0]["logprobs"].tolist()


async def test_training_a_candidate_leaves_the_incumbent_untouched(tmp_path):
    with emulator() as emu:
        async with make_backend(backend_config(emu.url, tmp_path, commit_every=0)) as backend:
            incumbent = backend.training
            await _step(incumbent, 0)
            published = await incumbent.publish(1)
            before = await _sampler_logprobs(published.ref)
            before_trainer = await _trainer_logprobs(incumbent.client)

            candidate = await incumbent.fork()
            assert emu.checkpoints()[candidate.loaded_path]["expires"]  # a fork's save is not kept forever
            assert candidate.client.model_id != incumbent.client.model_id
            assert candidate.steps_submitted == 1 and candidate.loaded_path == candidate.commit_path
            assert await _trainer_logprobs(candidate.client) == before_trainer  # starts from the incumbent's weights
            await _step(candidate, 1)
            candidate_published = await candidate.publish(2)

            # ``incumbent.publish`` would hand back the sampler it already has (no optim_step since):
            # a new save of its weights on the service is what shows they were not touched
            again = await incumbent.client.save_weights_and_get_sampling_client()
            assert await _sampler_logprobs(again) == before
            assert await _trainer_logprobs(incumbent.client) == before_trainer
            after = await _sampler_logprobs(candidate_published.ref)
            assert after != before
            await candidate.close()
        assert emu.models()[incumbent.client.model_id]["steps"] == 1


async def test_the_candidate_starts_from_the_incumbents_adam_state(tmp_path):
    """After one step the incumbent's Adam moments (and step count) are not zero. The same next
    step on the fork and on the incumbent itself (the state the fork copied, continuing without a
    break) must give the same weights. That check is not vacuous: the same step on a client
    restored from the fork's state *without* its optimizer state (fresh Adam, whose first update
    is about ``lr * sign(g)``) gives other weights, so a fork that lost its Adam state fails it."""
    with emulator() as emu:
        async with make_backend(backend_config(emu.url, tmp_path, commit_every=0)) as backend:
            incumbent = backend.training
            await _step(incumbent, 0)
            candidate = await incumbent.fork()
            await _step(candidate, 1)
            forked = await _trainer_logprobs(candidate.client)

            weights_only = await backend.service.create_training_client_from_state(candidate.loaded_path)
            data = [convert.to_datum(d, LOSS) for d in step_datums(1)]  # the request the step above sent
            fb = weights_only.forward_backward(data, LOSS.name, convert.loss_config(LOSS))
            await weights_only.optim_step(convert.adam(ADAM))
            await fb
            without_adam = await _trainer_logprobs(weights_only)

            await _step(incumbent, 1)  # only now: the incumbent trains on after the fork
            continued = await _trainer_logprobs(incumbent.client)
            await candidate.close()
    assert forked == continued
    assert without_adam != continued


async def test_close_twice_refuses_later_calls_and_the_backend_exits_cleanly(tmp_path):
    """The original closed by the caller (a fork took its place) and a fork closed twice: the
    backend's exit still drains and stops what is open, and its task group ends."""
    with emulator() as emu:
        async with make_backend(backend_config(emu.url, tmp_path, commit_every=1)) as backend:
            incumbent = backend.training
            await _step(incumbent, 0)
            await incumbent.drain()  # the commit after step 1 is confirmed
            saves = len(ops(emu.log(), "save_weights"))
            candidate = await incumbent.fork()  # the committed state is the current one: no new save
            assert candidate.loaded_path == incumbent.commit_path
            assert len(ops(emu.log(), "save_weights")) == saves
            rejected = await incumbent.fork()
            await rejected.close()
            await rejected.close()
            with pytest.raises(BackendFailure, match="closed"):
                rejected.optim_step(ADAM)
            await incumbent.close()  # the candidate is published: it becomes the incumbent
            await incumbent.close()
            assert backend.training.family() == [candidate]
            candidate.forward_backward(step_datums(1), LOSS)
            pending = candidate.optim_step(ADAM)  # left to the backend's exit to drain
        assert pending.done() and pending.exception() is None
        assert candidate._driver is not None and candidate._driver.done()
        assert emu.models()[candidate.client.model_id]["steps"] == 2  # the incumbent's step, then its own
