"""``headrace sft`` on the tiny model (torch): the rendering, the data forms, the loop, resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from posttrain_support import write_copy, write_pairs, write_sft

from headrace.app.cli import main
from headrace.core.errors import ConfigError
from headrace.posttrain.data import conversation, load_records, preference, split
from headrace.posttrain.render import render, to_datum, token_batches
from headrace.posttrain.steps import schedule
from headrace.renderers import get_renderer
from headrace.tokenizers.char import CharTokenizer


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_only_assistant_tokens_carry_weight():
    tok = CharTokenizer()
    renderer = get_renderer("tiny", tok)
    messages = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
    ]
    tokens, weights = render(renderer, tok, messages)
    assert tok.decode(tokens) == "u:1+1=a:2u:2+2=a:4"  # EOS decodes to nothing
    trained = [t for t, w in zip(tokens, weights, strict=True) if w]
    assert trained == [*tok.encode("2"), tok.eos_token_id, *tok.encode("4"), tok.eos_token_id]
    # the rendering is the one an episode sees: the prompt as build_generation_prompt makes it
    assert tokens[: len(renderer.build_generation_prompt(messages[:1]))] == renderer.build_generation_prompt(
        messages[:1]
    )
    _, last = render(renderer, tok, messages, train_on="last_assistant")
    assert [t for t, w in zip(tokens, last, strict=True) if w] == [*tok.encode("4"), tok.eos_token_id]
    datum = to_datum(tokens, weights, 2048)
    assert datum.target_tokens == tokens[1:] and datum.mask == weights[1:]


def test_data_forms_and_their_errors(tmp_path):
    path = write_sft(tmp_path / "d.jsonl", n=4)
    records = load_records(path)
    assert [conversation(r, "x")[-1]["role"] for r in records] == ["assistant"] * 4
    assert conversation({"prompt": "a", "completion": "b"}, "x") == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]
    user = {"role": "user", "content": "q"}
    prompt, chosen, rejected = preference(
        {
            "chosen": [user, {"role": "assistant", "content": "y"}],
            "rejected": [user, {"role": "assistant", "content": "n"}],
        },
        "x",
    )
    assert prompt == [user] and chosen[0]["content"] == "y" and rejected[0]["content"] == "n"
    with pytest.raises(ConfigError, match="needs 'messages'"):
        conversation({"text": "hi"}, "example 3")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\nnot json\n')
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        load_records(bad)
    with pytest.raises(ConfigError, match="names no format"):
        load_records(_touch(tmp_path / "d.csv"))
    train, test = split(list(range(10)), 0.2, seed=3)  # type: ignore[arg-type]
    assert len(test) == 2 and sorted(train + test) == list(range(10))


def _touch(p: Path) -> Path:
    p.write_text("x")
    return p


def test_parquet_loads_through_datasets(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"messages": [[{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]] * 3})
    pq.write_table(table, tmp_path / "d.parquet")
    records = load_records(tmp_path / "d.parquet")
    assert len(records) == 3 and conversation(records[0], "x")[1] == {"role": "assistant", "content": "3"}


def test_token_budget_batches_and_a_schedule_that_resumes():
    assert token_batches([5, 5, 5, 20, 1], 10, [0, 1, 2, 3, 4]) == [[0, 1], [2], [3], [4]]
    plan = schedule([4] * 10, 8, epochs=2.0, max_steps=100, seed=0)
    assert len(plan) == 10 and sorted(i for b in plan[:5] for i in b) == list(range(10))
    assert schedule([4] * 10, 8, epochs=2.0, max_steps=100, seed=0) == plan  # the same on resume
    assert len(schedule([4] * 10, 8, epochs=2.0, max_steps=3, seed=0)) == 3


def test_sft_learns_holds_out_and_resumes(tmp_path, capsys):
    data = write_sft(tmp_path / "d.jsonl")
    run = tmp_path / "run"
    argv = ["sft", "--data", str(data), "--run-dir", str(run), "--batch-tokens", "64", "--set", "sft.epochs=9"]
    assert main([*argv, "--steps", "6", "--save-every", "3", "--set", "sft.eval_every=3"]) == 0
    first = rows(run)
    assert [r["step"] for r in first] == list(range(6))
    assert "test/start_nll" in first[0] and "test/nll" in first[2] and "test/nll" in first[5]
    assert first[5]["test/nll"] < first[0]["test/start_nll"]  # the held-out loss fell
    assert first[5]["sft/train_nll"] < first[0]["sft/train_nll"]
    assert all(r["sft/loss_tokens"] == 2 * r["sft/examples"] for r in first)  # the digit and EOS, no prompt token
    assert "test/nll" in capsys.readouterr().out
    # --steps extends a resumed run: the steps after the last checkpoint, the same batches
    assert main(["sft", "--run-dir", str(run), "--resume", "--steps", "9"]) == 0
    again = rows(run)
    assert [r["step"] for r in again] == list(range(9))
    assert again[:6] == first


def test_sft_with_an_env_measures_its_accuracy(tmp_path):
    data = write_sft(tmp_path / "d.jsonl", n=16)
    run = tmp_path / "run"
    argv = ["sft", "--data", str(data), "--run-dir", str(run), "--steps", "2", "--env", "arithmetic"]
    assert main([*argv, "--set", "eval.problems=4"]) == 0
    got = rows(run)
    assert "eval/arithmetic/start_accuracy" in got[0] and "eval/arithmetic/accuracy" in got[-1]


def test_sft_refuses_missing_data_in_one_paragraph(tmp_path, capsys):
    assert main(["sft", "--run-dir", str(tmp_path / "run")]) == 2
    assert "needs --data" in capsys.readouterr().err


def test_dpo_starts_at_the_reference_and_separates_the_pairs(tmp_path):
    data = write_pairs(tmp_path / "p.jsonl")
    run = tmp_path / "run"
    argv = ["dpo", "--data", str(data), "--run-dir", str(run), "--steps", "8", "--batch-tokens", "64", "--lr", "1e-3"]
    assert main([*argv, "--set", "dpo.epochs=5", "--set", "dpo.beta=0.1"]) == 0
    got = rows(run)
    # the reference is the starting weights: every implicit reward is 0 before the first update
    assert got[0]["test/start_margin"] == pytest.approx(0.0, abs=1e-4)
    assert got[0]["dpo/loss"] == pytest.approx(0.6931, abs=1e-3)  # -log sigmoid(0)
    last = got[-1]
    assert last["dpo/margin"] > 1.0 and last["dpo/accuracy"] > 0.5
    assert last["dpo/chosen_reward"] > 0 > last["dpo/rejected_reward"]
    assert last["test/loss"] < got[0]["test/start_loss"]


def test_dpo_refuses_a_pair_without_rejected(tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "1+1=", "chosen": "2"}\n{"prompt": "1+2=", "chosen": "3", "rejected": "4"}\n')
    assert main(["dpo", "--data", str(bad), "--run-dir", str(tmp_path / "run")]) == 2
    assert "lacks rejected" in capsys.readouterr().err


def test_sdft_trains_toward_the_teachers_top_k(tmp_path):
    from headrace.posttrain.sdft import teacher_messages, topk_datums

    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "1+1="}]
    assert teacher_messages(prompt, "2", "{prompt} e.g. {demonstration}")[1]["content"] == "1+1= e.g. 2"
    top = [[(7, math.log(0.6)), (9, math.log(0.2))], [(4, math.log(0.5)), (5, math.log(0.5))]]
    datums, entropy = topk_datums([1, 2, 3], [7, 4], top, scale=0.5)
    assert len(datums) == 2 and datums[0].model_input == [1, 2, 3, 7]
    assert [d.target_tokens[2:] for d in datums] == [[7, 4], [9, 5]]  # position 2 predicts the first sampled token
    assert [d.mask[2] for d in datums] == pytest.approx([0.75 * 0.5, 0.25 * 0.5])  # renormalised over the k
    assert sum(d.mask[3] for d in datums) == pytest.approx(0.5) and all(d.mask[0] == 0 for d in datums)
    assert entropy == pytest.approx((-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) + math.log(2)) / 2)
    data = write_sft(tmp_path / "d.jsonl", n=16)
    run = tmp_path / "run"
    argv = ["sdft", "--data", str(data), "--run-dir", str(run), "--steps", "3", "--batch-tokens", "48"]
    assert main([*argv, "--set", "sdft.top_k=4", "--set", "sdft.teacher_sync_every=2"]) == 0
    got = rows(run)
    assert [r["step"] for r in got] == [0, 1, 2] and all(r["sdft/sample_tokens"] > 0 for r in got)
    assert [r["sdft/teacher_version"] for r in got] == [0, 0, 2]  # re-taken every 2 steps
    assert all(r["sdft/topk_ce"] > 0 for r in got) and "test/nll" in got[-1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sdft_with_a_teacher_that_is_right_lowers_the_students_loss(tmp_path):
    """The teacher copies the digit before '=' (SFT first), and its prompt is the demonstration
    then '=': it is right. SDFT must bring the student, who sees "a+b=" alone, to the sums. The
    defect this guards against: a teacher re-taken from the trained weights every step (the model
    trained toward itself, which on SmolLM2 forgot a second task) drifts from the copying it was
    right by, and took the held-out loss only 3.7 -> 2.4 here where the frozen one takes it to 0.4."""
    copy = tmp_path / "copy"
    sft = ["sft", "--data", str(write_copy(tmp_path / "c.jsonl")), "--run-dir", str(copy), "--renderer", "plain_text"]
    assert main([*sft, "--steps", "15", "--batch-tokens", "256", "--lr", "3e-3", "--set", "sft.epochs=100"]) == 0
    assert rows(copy)[-1]["test/nll"] < 0.05
    run = tmp_path / "sdft"
    argv = ["sdft", "--data", str(write_sft(tmp_path / "sums.jsonl", n=64)), "--run-dir", str(run), "--steps", "8"]
    argv += ["--model", str(copy / "final"), "--renderer", "plain_text", "--set", "torch.lora_rank=0"]
    argv += ["--max-tokens", "2", "--lr", "1e-3", "--batch-tokens", "128", "--set", "sdft.epochs=100"]
    assert main([*argv, "--set", "sdft.top_k=4", "--set", "sdft.teacher_template={demonstration}="]) == 0
    got = rows(run)
    assert got[0]["sdft/teacher_entropy"] < 0.05  # the copying teacher is sure of the sum
    assert all(r["sdft/teacher_version"] == 0 for r in got)  # and stays the starting weights
    assert got[-1]["test/nll"] < 0.3 * got[0]["test/start_nll"]  # the held-out sums' loss fell (3.7 -> 0.4)


def test_the_final_adapter_loads_in_peft_and_scores_as_the_run_did(tmp_path):
    import asyncio

    import peft
    import torch
    import transformers

    from headrace.app.cli import run_config_from_args
    from headrace.run.backends import make_backend

    data, held = write_sft(tmp_path / "d.jsonl", n=16), tmp_path / "held.jsonl"
    held.write_text(
        json.dumps({"messages": [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]})
    )
    run = tmp_path / "run"
    argv = ["sft", "--data", str(data), "--test-data", str(held), "--run-dir", str(run), "--steps", "4"]
    assert main([*argv, "--lr", "1e-2", "--set", "torch.lora_rank=4"]) == 0
    final = run / "final"
    assert (final / "adapter_model.safetensors").is_file() and (final / "adapter_config.json").is_file()

    async def base_dir() -> str:
        config = run_config_from_args(
            ["--model", "tiny", "--set", "torch.lora_rank=4", "--run-dir", str(tmp_path / "b")]
        )
        async with make_backend(config) as backend:
            return backend.export_base_model(tmp_path / "base")

    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(asyncio.run(base_dir())), str(final)
    )
    tok = CharTokenizer()
    tokens, weights = render(get_renderer("tiny", tok), tok, json.loads(held.read_text())["messages"])
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([tokens[:-1]])).logits[0].log_softmax(-1)
    lp = logp.gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)
    nll = float(-(lp * torch.tensor(weights[1:])).sum() / sum(weights[1:]))
    assert nll == pytest.approx(rows(run)[-1]["test/nll"], abs=1e-3)
    assert nll < rows(run)[0]["test/start_nll"]
