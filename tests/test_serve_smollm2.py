"""`headrace serve --model smollm2-135m`: a real pretrained chat model behind the endpoint, its
prompt rendered with the model's own chat template (the renderer the envs use)."""

from __future__ import annotations

import json

import pytest

from headrace.models import ModelLoadError, model_dir
from tests.serve_support import serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_chat_model_answers_in_its_template_and_a_candidate_publishes(tmp_path):
    pytest.importorskip("gguf")
    try:
        directory = model_dir("smollm2-135m")
    except ModelLoadError as e:
        pytest.skip(str(e))
    flags = ["--batch-size", "2", "--max-tokens", "8", "--set", "torch.num_threads=1"]
    with serving(tmp_path / "d", *flags, model="smollm2-135m") as server:
        first, version = server.chat("What is 2+2? Answer with the number only.", temperature=0.0)
        assert version == 0 and first.choices[0].message.content.strip()
        second, _ = server.chat("Name a colour.")
        server.post("/v1/feedback", [{"id": first.id, "reward": 1.0}, {"id": second.id, "reward": 0.0}])
        line = server.wait_for_line(1, timeout_s=300)
        assert line["outcome"] == "published" and server.chat("Hello!")[1] == 1
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(directory))
    record = json.loads((tmp_path / "d" / "completions.jsonl").read_text().splitlines()[0])
    messages = [{"role": "user", "content": "What is 2+2? Answer with the number only."}]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected  # newer transformers: an encoding
    assert record["prompt_tokens"] == list(expected)
    answer = hf.decode(record["completion_tokens"], skip_special_tokens=True)
    assert answer.strip() == first.choices[0].message.content.strip()
