"""The torch learner never applies a non-finite update and never checkpoints non-finite weights
(issue 10, item 2): such a step is skipped and counted (``optim/skipped_nonfinite``), and
``torch.max_nonfinite_skips`` of them in a row stop the run."""

from __future__ import annotations

import json

import pytest
from helpers import run_argv

from tests.torch_helpers import DEVICE, config, datum

torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402

from headrace import Env, StepResult, StopCondition  # noqa: E402
from headrace.app.cli import main  # noqa: E402
from headrace.backends.torch import trainer as trainer_module  # noqa: E402
from headrace.core.advantages import NonFiniteError  # noqa: E402
from headrace.core.types import AdamParams, EnvGroupBuilder, LossSpec, RLDataset, SamplingParams  # noqa: E402
from headrace.plugins import registry  # noqa: E402
from headrace.run.backends import make_backend  # noqa: E402

pytestmark = pytest.mark.timeout(120)
ADAM = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
LOSS = LossSpec("importance_sampling")


async def datums(backend, advantage: float):
    """Sampled answers to two prompts; ``advantage`` 1e38 is finite and fits float32, but the
    summed loss overflows and the gradient is NaN: a crafted poison batch."""
    handle = backend.initial_handle()
    out = []
    for text in ("3+4=", "1+2="):
        prompt = backend.tokenizer.encode(text)
        for s in await backend.sampling.sample(handle, prompt, 4, SamplingParams(max_tokens=6, seed=1)):
            out.append(datum(prompt, s, advantage))
    return out


def weights(backend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.training.params.items()}


async def step(backend, batch):
    await backend.training.forward_backward(batch, LOSS)
    return (await backend.training.optim_step(ADAM)).metrics


async def test_a_non_finite_step_is_skipped_and_counted_and_never_reaches_a_checkpoint(tmp_path):
    async with make_backend(config(tmp_path)) as backend:
        good, poison = await datums(backend, 1.0), await datums(backend, 1e38)
        assert (await step(backend, good))["optim/skipped_nonfinite"] == 0.0
        before = weights(backend)
        metrics = await step(backend, poison)
        assert metrics["optim/skipped_nonfinite"] == 1.0
        after = weights(backend)
        assert all(torch.equal(before[n], after[n]) for n in before), "a skipped step changed the weights"
        assert (await step(backend, good))["optim/skipped_nonfinite"] == 0.0  # and training goes on
        path = await backend.training.save_state("step_000003")
    saved = load_file(f"{path}/weights.safetensors")
    assert saved and all(bool(torch.isfinite(t).all()) for t in saved.values())
    optimizer = torch.load(f"{path}/optimizer.pt")
    for state in optimizer["state"].values():
        assert all(bool(torch.isfinite(v).all()) for v in state.values() if isinstance(v, torch.Tensor))


async def test_a_non_finite_loss_with_a_finite_gradient_is_skipped_too(tmp_path, monkeypatch):
    real = trainer_module.get_loss

    def nan_valued(name):
        def loss(*args):
            total, stats = real(name)(*args)
            return total + float("nan") * total.detach(), stats  # NaN value, the real (finite) gradient

        return loss

    monkeypatch.setattr(trainer_module, "get_loss", nan_valued)
    async with make_backend(config(tmp_path)) as backend:
        before = weights(backend)
        metrics = await step(backend, await datums(backend, 1.0))
        assert metrics["optim/skipped_nonfinite"] == 1.0
        assert all(torch.equal(before[n], p) for n, p in weights(backend).items())


async def test_max_nonfinite_skips_in_a_row_stop_the_run_and_a_good_step_resets_the_count(tmp_path):
    async with make_backend(config(tmp_path, max_nonfinite_skips=2)) as backend:
        good, poison = await datums(backend, 1.0), await datums(backend, 1e38)
        await step(backend, poison)
        await step(backend, good)  # resets the count
        assert (await step(backend, poison))["optim/skipped_nonfinite"] == 1.0
        with pytest.raises(NonFiniteError, match="2 optimizer steps in a row .* torch.max_nonfinite_skips"):
            await step(backend, poison)
        assert backend.training.optim_steps == 1  # only the good step was applied


async def test_weights_holding_nan_are_never_checkpointed(tmp_path):
    async with make_backend(config(tmp_path)) as backend:
        with torch.no_grad():
            next(iter(backend.training.params.values())).view(-1)[0] = float("nan")
        with pytest.raises(NonFiniteError, match="refusing to save checkpoint 'step_000001'"):
            await backend.training.save_state("step_000001")
        assert not (tmp_path / "run" / "checkpoints" / "step_000001").exists()


class Overflowing(Env):
    """Rewards ±1e38: finite and within float32, but without normalize_std the summed loss
    overflows and the gradient is NaN. Batches not in ``poisoned`` score 0/1 as usual."""

    def __init__(self, member: int, poison: bool):
        self.member, self.poison = member, poison

    async def initial_observation(self):
        return [5, 6], StopCondition(4)

    async def step(self, action):
        sign = 1.0 if self.member % 2 else -1.0
        return StepResult(reward=sign * 1e38 if self.poison else float(self.member % 2), done=True)


class PoisonedDataset(RLDataset):
    def __init__(self, poisoned: set[int], steps: int):
        self.poisoned, self.steps = poisoned, steps

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        return [Members(Overflowing, {"poison": index in self.poisoned}, 4) for _ in range(2)]

    def __len__(self) -> int:
        return self.steps


class Members(EnvGroupBuilder):
    def __init__(self, env_cls, kwargs, size):
        self.env_cls, self.kwargs, self.size = env_cls, kwargs, size

    async def make_envs(self):
        return [self.env_cls(member=i, **self.kwargs) for i in range(self.size)]


@pytest.mark.parametrize(("poisoned", "code"), [({1}, 0), (set(range(6)), 1)])
def test_a_run_skips_overflowing_steps_stops_after_three_and_checkpoints_no_nan(tmp_path, capsys, poisoned, code):
    run_dir = tmp_path / "r"
    settings = {"advantages.normalize_std": "false", "torch.device": DEVICE}
    argv = run_argv(env="test_overflowing", backend="torch", steps=6, save_every=1, run_dir=run_dir, set=settings)
    with registry.envs.temporarily("test_overflowing", lambda ctx: PoisonedDataset(poisoned, ctx.steps)):
        assert main(argv) == code
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in rows if r.get("optim/skipped_nonfinite")]
    # logged on the device thread, into this run's log
    assert "nonfinite_update_skipped" in (run_dir / "log.jsonl").read_text()
    if code == 0:
        assert skipped == [1] and len(rows) == 6
    else:
        # steps 0-2 are skipped; the third stops the run before its row is written
        assert skipped == [0, 1] and "3 optimizer steps in a row" in capsys.readouterr().err
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*/weights.safetensors"))
    assert checkpoints
    for path in checkpoints:
        assert all(bool(torch.isfinite(t).all()) for t in load_file(str(path)).values()), path
