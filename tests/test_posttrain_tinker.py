"""``headrace sft`` / ``headrace dpo`` on ``--backend tinker`` through the real SDK against the
emulator (the tiny model, torch compute): what the emulator received."""

from __future__ import annotations

import json

import pytest
from posttrain_support import write_pairs, write_sft
from tinker_support import emulator, ops, tinker_env  # noqa: F401

from headrace.app.cli import main

pytestmark = [pytest.mark.tinker, pytest.mark.slow]


def _fbs(log, model=None):
    return [r for r in ops(log, "forward_backward", model)]


@pytest.mark.timeout(240)
def test_sft_on_tinker_sends_assistant_weights_scaled_to_a_mean(tmp_path):
    data = write_sft(tmp_path / "d.jsonl", n=12)
    run = tmp_path / "run"
    with emulator("torch", clock_cycle_s=0.02, follow_s=0) as emu:
        argv = ["sft", "--backend", "tinker", "--data", str(data), "--run-dir", str(run), "--steps", "3"]
        assert main([*argv, "--batch-tokens", "40", "--set", f"tinker.base_url={emu.url}"]) == 0
        log = emu.log()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    fbs = _fbs(log)
    assert len(fbs) == 3 and all(fb["loss_fn"] == "cross_entropy" for fb in fbs)
    # weights on the answer digit and EOS only, scaled by 1 / (the step's loss tokens): they sum to 1
    for fb, row in zip(fbs, rows, strict=True):
        assert fb["weights_sum"] == pytest.approx(1.0, rel=1e-5)
        assert fb["weights_nonzero"] == row["sft/loss_tokens"] == 2 * fb["datums"]
        assert fb["weights_negative"] == 0
    # the held-out loss is the service's forward, before the first step and after the last
    assert len(ops(log, "forward")) == 2
    assert rows[-1]["test/nll"] < rows[0]["test/start_nll"]
    # RUN_DIR/final: the last version's sampler weights, downloaded as a PEFT adapter
    final = json.loads((run / "final" / "adapter_config.json").read_text())
    assert final["peft_type"] == "LORA" and final["r"] == 32 and "lm_head" in final["target_modules"]
    assert (run / "final" / "adapter_model.safetensors").stat().st_size > 0


@pytest.mark.timeout(240)
def test_dpo_on_tinker_is_a_custom_loss_against_the_base_models_logprobs(tmp_path):
    data = write_pairs(tmp_path / "p.jsonl", n=12)
    run = tmp_path / "run"
    with emulator("torch", clock_cycle_s=0.02, follow_s=0) as emu:
        argv = ["dpo", "--backend", "tinker", "--data", str(data), "--run-dir", str(run), "--steps", "2"]
        assert main([*argv, "--batch-tokens", "60", "--lr", "1e-2", "--set", f"tinker.base_url={emu.url}"]) == 0
        log = emu.log()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["test/start_margin"] == pytest.approx(0.0, abs=1e-4)  # the base model scored the reference
    # the reference: a sampling session of the base model (the run samples nothing else), its
    # prompt logprobs (compute_logprobs), one request a reply, train and held-out
    scored = [r for r in log if r["event"] == "op" and r["op"] == "sample"]
    assert len(scored) == 2 * 12 and len({r["model_id"] for r in scored}) == 1
    # forward_backward_custom: a forward, then cross_entropy with weights = -dLoss/dlogprob, which
    # are negative on the rejected replies' tokens
    fbs = _fbs(log)
    assert len(fbs) == 2 and all(fb["loss_fn"] == "cross_entropy" and fb["weights_negative"] > 0 for fb in fbs)
    assert len(ops(log, "forward")) == 2 + 2  # one per step's custom loss, the held-out before and after
    assert rows[-1]["dpo/margin"] != 0.0


@pytest.mark.timeout(240)
def test_distillation_on_tinker_scores_the_samples_with_a_teacher_model(tmp_path):
    run = tmp_path / "run"
    with emulator("torch", clock_cycle_s=0.02, follow_s=0) as emu:
        argv = ["run", "--backend", "tinker", "--env", "arithmetic", "--teacher", "tiny", "--run-dir", str(run)]
        argv += ["--steps", "2", "--batch-size", "2", "--group-size", "4", "--no-progress"]
        assert main([*argv, "--set", f"tinker.base_url={emu.url}"]) == 0
        log = emu.log()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the teacher is a second model on the service; its forward scores each trained group
    teacher = {r["model_id"] for r in ops(log, "forward")}
    student = {r["model_id"] for r in ops(log, "optim_step")}
    assert len(teacher) == 1 and teacher.isdisjoint(student)
    assert len(ops(log, "forward")) == 2 * 2  # one a group
    # the student starts as the base model the teacher is: no gap at the first step
    assert abs(rows[0]["env/all/distill/reverse_kl"]) < 1e-3


@pytest.mark.timeout(240)
def test_sdft_on_tinker_asks_for_the_teachers_top_k_prompt_logprobs(tmp_path):
    data = write_sft(tmp_path / "d.jsonl", n=8)
    run = tmp_path / "run"
    with emulator("torch", clock_cycle_s=0.02, follow_s=0) as emu:
        argv = ["sdft", "--backend", "tinker", "--data", str(data), "--run-dir", str(run), "--steps", "2"]
        argv += ["--batch-tokens", "60", "--set", "sdft.top_k=3"]
        assert main([*argv, "--set", f"tinker.base_url={emu.url}"]) == 0
        log = emu.log()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    fbs = _fbs(log)
    assert len(fbs) == 2 and all(fb["loss_fn"] == "cross_entropy" for fb in fbs)
    # k copies of each sample, their weights one distribution a sampled position, the step's mean
    for fb, row in zip(fbs, rows, strict=True):
        assert fb["weights_sum"] == pytest.approx(1.0, rel=1e-4) and fb["weights_negative"] == 0
        assert fb["datums"] % 3 == 0
        assert row["sdft/sample_tokens"] > 0
