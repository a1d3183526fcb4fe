"""The emulator against the official SDK: every endpoint the training and sampling flows use,
protobuf results, the request log, lock-step cycles and the fault knobs (real HTTP, loopback)."""

from __future__ import annotations

import asyncio

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker_support import emulator, ops, tinker_env  # noqa: E402, F401 - fixture

pytestmark = [pytest.mark.tinker, pytest.mark.timeout(90)]


def _datum(k: int) -> types.Datum:
    toks = [5 + k, 6, 7, 8]
    return types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0, 1.0, 1.0]},
    )


async def _train(url: str, steps: int, lr: float = 0.1) -> tuple[tinker.ServiceClient, object, list[float]]:
    service = tinker.ServiceClient(base_url=url, api_key="tml-test")
    client = await service.create_lora_training_client(base_model="tiny", rank=4, seed=0)
    losses = []
    for k in range(steps):
        fb = client.forward_backward([_datum(k)], "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=lr))
        out = await fb
        await opt
        assert len(out.loss_fn_outputs) == 1 and out.loss_fn_outputs[0]["logprobs"].shape == [3]
        losses.append(out.metrics["loss:sum"])
    return service, client, losses


async def test_sdk_flow_train_save_load_sample():
    with emulator() as emu:
        service, client, losses = await _train(emu.url, 3)
        assert client.model_id.endswith(":train:0")
        saved = await client.save_state("ckpt")
        assert saved.path == f"tinker://{client.model_id}/weights/ckpt"
        sampler_path = (await client.save_weights_for_sampler("s1")).path
        assert "/sampler_weights/" in sampler_path

        sampler = await client.save_weights_and_get_sampling_client()
        out = await sampler.sample(
            types.ModelInput.from_ints([5, 6]),
            num_samples=4,
            sampling_params=types.SamplingParams(max_tokens=5, seed=1),
        )
        assert len(out.sequences) == 4
        for seq in out.sequences:
            assert len(seq.tokens) == len(seq.logprobs) <= 5 and seq.stop_reason in ("stop", "length")
            assert seq.sequence_id

        restored = await service.create_training_client_from_state_with_optimizer(saved.path)
        assert restored.model_id != client.model_id
        by_path = await service.create_sampling_client(model_path=sampler_path)
        assert (
            len(
                (await by_path.sample(types.ModelInput.from_ints([5]), 2, types.SamplingParams(max_tokens=3))).sequences
            )
            == 2
        )
        await service.close("success")

        log = emu.log()
        assert [r["seq_id"] for r in ops(log, "forward_backward", client.model_id)] == [1, 3, 5]
        assert [r["seq_id"] for r in ops(log, "optim_step", client.model_id)] == [2, 4, 6]
        for r in ops(log, "optim_step"):
            assert r["submit_t"] <= r["start_t"] <= r["complete_t"] <= r["fetch_t"]
        models = emu.models()
        assert models[restored.model_id]["lineage"] == models[client.model_id]["lineage"]
        assert models[restored.model_id]["parent"] == saved.path


async def test_training_is_real_and_lossy_steps_go_down():
    with emulator() as emu:
        service = tinker.ServiceClient(base_url=emu.url, api_key="tml-test")
        client = await service.create_lora_training_client(base_model="tiny", rank=4, seed=0)
        losses = []
        for _ in range(5):
            fb = client.forward_backward([_datum(0)], "cross_entropy")
            client.optim_step(types.AdamParams(learning_rate=0.2))
            losses.append((await fb).metrics["loss:sum"])
        assert losses[-1] < losses[0] - 1.0
        await service.close("success")


@pytest.mark.slow
async def test_faults_try_again_5xx_and_dropped_responses_apply_each_call_once():
    knobs = dict(try_again_polls=2, http_5xx_every=3, http_5xx_burst=2, drop_every=2, drop_fetch_every=3)
    with emulator(**knobs) as emu:
        service, client, _ = await _train(emu.url, 4)
        await service.close("success")
        log = emu.log()
    kinds = {r.get("kind") for r in log if r["event"] == "fault"}
    assert {"http_503", "drop_response", "drop_fetch"} <= kinds
    assert sum(r["event"] == "try_again" for r in log) >= 2 * 8
    assert any(r["event"] == "dedup" for r in log)  # a retried submission got its first future back
    steps = ops(log, "optim_step", client.model_id)
    assert len(steps) == 4 and [r["step"] for r in steps] == [1, 2, 3, 4]
    assert len(ops(log, "forward_backward", client.model_id)) == 4


async def test_a_follow_window_puts_back_to_back_calls_in_one_cycle():
    """``--follow-s``: a model's op arriving within the window of its previous one joins that
    op's cycle, though the boundary has passed (off by default: see test_emulator_clock.py)."""
    with emulator(clock_cycle_s=0.2, follow_s=0.05) as emu:
        service, client, _ = await _train(emu.url, 3)
        await service.close("success")
        log = emu.log()
    fbs, opts = ops(log, "forward_backward", client.model_id), ops(log, "optim_step", client.model_id)
    for fb, opt in zip(fbs, opts, strict=True):
        assert fb["cycle"] == opt["cycle"]
    cycles = [fb["cycle"] for fb in fbs]
    assert cycles == sorted(set(cycles))  # each step waited for a cycle after the last one's result
    for fb in fbs:  # nothing starts between cycle boundaries
        assert fb["start_t"] - fb["submit_t"] < 0.2 + 0.15


async def test_fail_after_apply_reports_a_server_error_after_the_step():
    with emulator(fail_after_apply_every=1) as emu:
        service = tinker.ServiceClient(base_url=emu.url, api_key="tml-test")
        client = await service.create_lora_training_client(base_model="tiny", rank=4, seed=0)
        await client.forward_backward([_datum(0)], "cross_entropy")
        with pytest.raises(tinker.RequestFailedError) as info:
            await client.optim_step(types.AdamParams(learning_rate=0.1))
        assert info.value.category.value == "server"
        assert emu.models()[client.model_id]["steps"] == 1  # applied, though the caller can't know
        await service.close("errored")


async def test_a_loss_not_served_is_a_user_error():
    with emulator() as emu:
        service = tinker.ServiceClient(base_url=emu.url, api_key="tml-test")
        client = await service.create_lora_training_client(base_model="tiny", rank=4)
        with pytest.raises(tinker.RequestFailedError) as info:
            await client.forward_backward([_datum(0)], "dro")
        assert info.value.category.value == "user"
        await asyncio.wait_for(service.close("errored"), 10)


async def test_serve_only_refuses_other_names_with_the_flag_that_serves_them():
    from headrace.tinker_emulator import EmulatorThread

    with EmulatorThread(compute="bigram", serve_only=["tiny"]) as emu:
        service = tinker.ServiceClient(base_url=emu.url, api_key="tml-test")
        with pytest.raises(Exception, match=r"not served.*serves: tiny \(--serve-only\).*--model Qwen/Qwen3-8B"):
            await service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4)
        with pytest.raises(Exception, match="not served by this Tinker emulator.*--model smollm2-135m"):
            await service.create_sampling_client(base_model="smollm2-135m")
        client = await service.create_lora_training_client(base_model="tiny", rank=4)
        await client.forward_backward([_datum(0)], "cross_entropy")
        await asyncio.wait_for(service.close("errored"), 10)


# -- the emulator's own config (EmulatorConfig): the CLI and EmulatorThread are built from it ---------


def test_config_refuses_bad_values_in_one_paragraph():
    from headrace.tinker_emulator import EmulatorConfig

    with pytest.raises(ValueError) as info:
        EmulatorConfig.from_dict({"port": 70000, "device": "tpu", "models": []})
    message = str(info.value)
    assert "\n" not in message
    assert "port=70000" in message and "'tpu' is not a torch device" in message and "at least one base model" in message
    with pytest.raises(ValueError, match=r"unknown emulator setting\(s\) \['model'\]; known: .*'models'"):
        EmulatorConfig.from_dict({"model": "tiny"})
    with pytest.raises(ValueError, match=r"^bad emulator knob value\(s\): latency_s=-1"):  # the knobs' own message
        EmulatorConfig.from_dict({"knobs": {"latency_s": -1}})
    with pytest.raises(ValueError, match="bigram compute serves only 'tiny'.*--compute torch"):
        EmulatorConfig.from_dict({"compute": "bigram", "models": ["tiny", "smollm2-135m"]})
    assert EmulatorConfig.from_dict({"models": ["tiny", "smollm2-135m", "tiny"]}).models == ("tiny", "smollm2-135m")


def test_cli_flags_build_the_config():
    from headrace.tinker_emulator.cli import build_parser, config_from_args

    argv = "--port 0 --model tiny --model smollm2-135m --latency-s 0.5 --http-5xx-ops asample".split()
    argv += "--serve-only Qwen/Qwen3-8B tiny --max-ops-per-cycle 2".split()
    config = config_from_args(build_parser().parse_args(argv))
    assert (config.port, config.compute, config.models, config.device) == (0, "torch", ("tiny", "smollm2-135m"), "cpu")
    assert config.knobs.latency_s == 0.5 and config.knobs.http_5xx_ops == ("asample",)
    assert config.serve_only == ("Qwen/Qwen3-8B", "tiny") and config.knobs.max_ops_per_cycle == 2
    default = config_from_args(build_parser().parse_args([]))
    assert default.models == ("tiny",) and default.serve_only == () and default.vocab_size is None
    assert default.knobs.follow_s == 0 and default.knobs.max_ops_per_cycle == 0  # hard boundaries, no cap
    bigram = config_from_args(build_parser().parse_args("--compute bigram --vocab-size 1000".split()))
    assert bigram.vocab_size == 1000


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--compute", "bigram", "--model", "smollm2-135m"], "bigram compute serves only 'tiny'"),
        (["--device", "tpu"], "'tpu' is not a torch device"),
        (["--stall-s", "-1"], "stall_s=-1"),
        (["--model", "/nonexistent/model-dir"], "model directory '/nonexistent/model-dir' does not exist"),
        (["--vocab-size", "1000"], "--vocab-size sets the bigram compute's vocabulary"),
        (["--compute", "bigram", "--vocab-size", "10"], "vocab_size=10"),
    ],
)
def test_cli_bad_values_exit_2_with_the_reason(argv, says, capsys):
    from headrace.tinker_emulator import cli_main

    with pytest.raises(SystemExit) as info:
        cli_main([*argv, "--port", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("headrace tinker-emulator: error: ") and says in err and "Traceback" not in err


async def test_emulator_thread_from_a_config_shares_its_knobs_and_serves_its_models():
    import json
    import urllib.request

    from headrace.tinker_emulator import EmulatorConfig, EmulatorThread, Knobs

    config = EmulatorConfig(compute="bigram", port=0, knobs=Knobs(latency_s=0.01), serve_only=("tiny",))
    with EmulatorThread(config=config) as emu:
        assert emu.port and emu.url == f"http://127.0.0.1:{emu.port}"
        with urllib.request.urlopen(f"{emu.url}/api/v1/get_server_capabilities", timeout=20) as r:  # noqa: S310
            assert [m["model_name"] for m in json.loads(r.read())["supported_models"]] == ["tiny"]
        emu.set_knobs(latency_s=0.02)
        assert config.knobs.latency_s == 0.02  # one Knobs object: the config's is the running server's
        service = tinker.ServiceClient(base_url=emu.url, api_key="tml-test")
        with pytest.raises(Exception, match="not served by this Tinker emulator.*--model smollm2-135m"):
            await service.create_sampling_client(base_model="smollm2-135m")
        await asyncio.wait_for(service.close("errored"), 10)
    with pytest.raises(TypeError, match="either config= or"):
        EmulatorThread(Knobs(), config=config)


def test_a_served_model_without_weights_fails_the_start():
    from headrace.tinker_emulator import EmulatorThread

    with pytest.raises(RuntimeError, match="did not start.*'/nonexistent/model-dir' does not exist"):
        EmulatorThread(compute="torch", models=["/nonexistent/model-dir"]).start()
