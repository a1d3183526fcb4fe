"""Backends are plugins: each owns its config section, flags and registration (the
``headrace.backends`` entry-point group), and gets only its section and a ``BackendContext``. A
backend installed as a package works from the real CLI without touching headrace (issue 11, item 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import sim_config
from pydantic import BaseModel, ConfigDict

from headrace.core.errors import ConfigError
from headrace.core.protocols import BackendContext, BackendPlugin
from headrace.plugins import registry
from headrace.plugins.backends import get_plugin
from headrace.run.backends import context, make_backend
from headrace.run.config import build_config
from headrace.run.train import train

pytestmark = pytest.mark.timeout(120)

# A package as pip would install it: the module, and a dist-info whose entry_points.txt
# publishes the plugin. It builds on the sim backend's pieces (as a third party may build on
# headrace's), and writes down what it was given, so the test sees what reached it.
PACKAGE = '''
"""mybackend: a backend from outside headrace."""

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from headrace.backends.sim import SimBackend, SimConfig
from headrace.core.protocols import BackendPlugin


class MyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    greeting: str = Field("hello", description="what the backend says when it starts")
    concurrency: int = Field(8, ge=1, description="sample requests served at once")


def make_backend(config, ctx):
    facts = {"section": config.model_dump(), "ctx": {k: getattr(ctx, k) for k in ("model", "seed", "run_dir",
             "resume", "group_size", "max_concurrent_rollouts")}, "max_tokens": ctx.sampling.max_tokens}
    with open(Path(ctx.run_dir) / "mybackend.jsonl", "a") as f:
        f.write(json.dumps(facts) + "\\n")
    return SimBackend(SimConfig(sample_concurrency=config.concurrency), ctx)


plugin = BackendPlugin(
    "mybackend",
    MyConfig,
    "mybackend:make_backend",
    description="a third-party backend, installed as a package",
    flags=[("--greeting", "greeting", str, "what mybackend says")],
)
'''


@pytest.fixture
def site(tmp_path) -> Path:
    """A directory that holds an installed package `mybackend` (module + dist-info)."""
    return installed(tmp_path / "site", "mybackend", PACKAGE)


# A backend whose sampler fails for good on every call (a device lost, a revoked key): each call
# is written down, so the test sees how many the run made before it stopped.
BROKEN = '''
"""brokenbackend: the sim, with a sampler that has lost its device."""

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from headrace import BackendFailure
from headrace.backends.sim import SimBackend, SimConfig
from headrace.core.protocols import BackendPlugin


class BrokenConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LostDevice:
    def __init__(self, calls):
        self.calls = calls

    async def sample(self, handle, prompt, n, params):
        with open(self.calls, "a") as f:
            f.write("sample\\n")
        raise BackendFailure("brokenbackend: the sampler lost its device; reattach it, then run with --resume")


def make_backend(config, ctx):
    backend = SimBackend(SimConfig(), ctx)
    backend.sampling = LostDevice(Path(ctx.run_dir) / "sample_calls.txt")
    return backend


plugin = BackendPlugin("brokenbackend", BrokenConfig, "brokenbackend:make_backend", description="a lost device")
'''


def installed(root: Path, name: str, source: str) -> Path:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(source)
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[headrace.backends]\n{name} = {name}:plugin\n")
    return root


def headrace(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "headrace", *args], capture_output=True, text=True, timeout=90, env=env
    )


@pytest.mark.slow  # > 10 s (a server, a subprocess or a benchmark); CI runs it
def test_an_installed_backend_runs_from_the_cli_with_its_flags_and_section(site, tmp_path):
    listing = headrace(site, "backends")
    assert listing.returncode == 0, listing.stderr
    lines = {line.split()[0]: line for line in listing.stdout.splitlines()}
    assert {"sim", "torch", "tinker", "vllm", "mybackend"} <= set(lines)
    assert "training" in lines["mybackend"] and "installed as a package" in lines["mybackend"]

    run_dir = tmp_path / "run"
    common = ["--backend", "mybackend", "--batch-size", "2", "--group-size", "4", "--no-progress"]
    common += ["--set", "advantages.filter_constant=false", "--run-dir", str(run_dir)]
    first = headrace(site, "run", *common, "--steps", "2", "--greeting", "hi", "--set", "mybackend.concurrency=3")
    assert first.returncode == 0, first.stderr
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["backend"] == "mybackend" and saved["mybackend"] == {"greeting": "hi", "concurrency": 3}
    assert "torch" not in saved and "tinker" not in saved  # only the sections the run uses or was given
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2

    # config.json round-trips: --resume continues with the saved section, and --steps extends
    second = headrace(site, "run", "--resume", "--run-dir", str(run_dir), "--steps", "3", "--no-progress")
    assert second.returncode == 0, second.stderr
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    made = [json.loads(line) for line in (run_dir / "mybackend.jsonl").read_text().splitlines()]
    assert [m["section"] for m in made] == [{"greeting": "hi", "concurrency": 3}] * 2
    assert [m["ctx"]["resume"] for m in made] == [False, True]
    assert made[0]["ctx"] | {"resume": True} == made[1]["ctx"]
    assert made[0]["ctx"]["run_dir"] == str(run_dir) and made[0]["ctx"]["group_size"] == 4
    assert made[0]["ctx"]["max_concurrent_rollouts"] == 2  # sync: one batch of 2 groups in flight

    typo = headrace(site, "run", *common, "--overwrite", "--set", "mybackend.greting=x")
    assert typo.returncode == 2
    assert "unknown option 'mybackend.greting' (did you mean 'mybackend.greeting'?)" in typo.stderr


def test_a_backend_failure_stops_the_run_with_its_message_and_spends_no_retry_budget(tmp_path):
    """A sampler's BackendFailure is the backend's, not the env's: the run stops at once with the
    backend's message (exit 1), instead of retrying it against every group's budget (issue 22,
    item 8: 192 sample calls, then TooManyDroppedGroups)."""
    site = installed(tmp_path / "site", "brokenbackend", BROKEN)
    run_dir = tmp_path / "run"
    out = headrace(site, "run", "--backend", "brokenbackend", "--batch-size", "4", "--group-size", "4",
                   "--steps", "3", "--no-progress", "--run-dir", str(run_dir))  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "headrace: run failed: brokenbackend: the sampler lost its device; reattach it" in out.stderr
    assert "dropped" not in out.stderr and "retry.budget" not in out.stderr
    calls = (run_dir / "sample_calls.txt").read_text().splitlines()
    assert 1 <= len(calls) <= 4, len(calls)  # one per group at most: the 4 groups of step 0 ran at once
    assert "group_dropped" not in (run_dir / "log.jsonl").read_text()


def test_help_lists_backend_flags_and_sections(site):
    out = headrace(site, "run", "--help")
    assert out.returncode == 0, out.stderr
    for text in ("--greeting", "mybackend.greeting = 'hello'", "--tinker-url", "--sampler-url", "torch.dtype"):
        assert text in out.stdout
    assert "sim.sample_concurrency = 64" in out.stdout


def test_listing_and_help_import_no_backend_library():
    code = (
        "import sys; from headrace.app.cli import build_parser, backend_flags; build_parser(['run']); "
        "from headrace.plugins.backends import plugins; assert all(isinstance(p, object) for _, p in plugins()); "
        "heavy = {'torch', 'vllm', 'tinker', 'transformers'} & set(sys.modules); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_backend_sections_are_checked_by_their_backends():
    with pytest.raises(ConfigError, match=r"unknown option 'torc' \(did you mean 'torch'\?\)"):
        build_config(overrides=["torc.device=cpu"])
    with pytest.raises(ConfigError, match=r"torch.lora_rank: .*greater than or equal to 0.*; steps|steps: .*torch"):
        build_config(overrides=["torch.lora_rank=-1", "steps=0"])
    with pytest.raises(ConfigError, match=r"valid here: base_url, commit_every"):
        build_config(overrides=["tinker.url=x"])
    # the run's backend gets its section (defaults); another backend's is kept only if given
    config = build_config(flags={"backend": "sim"}, overrides=["tinker.lora_rank=8"])
    assert set(config.sections) == {"sim", "tinker"} and config.section("tinker").lora_rank == 8
    assert config.section("torch").device == "auto"  # not held: the backend's defaults


def test_a_run_dir_written_before_backends_were_plugins_still_loads():
    """Its config.json holds every built-in backend's section."""
    legacy = build_config().model_dump()
    legacy |= {"backend": "sim", "sim": {"sample_concurrency": 5}, "torch": {"dtype": "bfloat16"}}
    legacy |= {"tinker": {"lora_rank": 8}, "vllm": {"max_model_len": 64}}
    config = build_config(base=legacy)
    assert set(config.sections) >= {"sim", "torch", "tinker", "vllm"}
    assert (config.section("sim").sample_concurrency, config.section("torch").dtype) == (5, "bfloat16")
    assert build_config(base=config.model_dump()) == config


def test_a_backend_of_the_wrong_kind_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="pass --backend TRAINING --sampler vllm"):
        make_backend(build_config(flags={"backend": "vllm"}))
    with pytest.raises(ConfigError, match="Sampler backends here: vllm"):
        make_backend(build_config(flags={"backend": "sim", "sampler": "sim"}))


async def test_a_sampler_gets_the_same_context_and_the_training_backend(tmp_path):
    """`--sampler NAME` pairs a sampler with the training backend: same context, its own section."""
    seen: list[Any] = []

    class Counted:
        def __init__(self, inner: Any, counter: dict[str, int]):
            self.inner, self.counter = inner, counter

        async def sample(self, *args: Any) -> Any:
            self.counter["requests"] += 1
            return await self.inner.sample(*args)

    class Sampled:
        def __init__(self, section: Any, ctx: BackendContext, training: Any):
            seen.append((section, ctx, training, self))
            self.inner, self.training, self.tokenizer = training, training.training, training.tokenizer
            self.counter = {"requests": 0}
            self.sampling = Counted(training.sampling, self.counter)

        def initial_handle(self) -> Any:
            return self.inner.initial_handle()

        def describe(self) -> dict[str, Any]:
            return {**self.inner.describe(), "sampler": "counted"}

        async def __aenter__(self) -> Sampled:
            await self.inner.__aenter__()
            return self

        async def __aexit__(self, *exc: Any) -> None:
            await self.inner.__aexit__(*exc)

    class Section(BaseModel):
        model_config = ConfigDict(extra="forbid")
        label: str = "x"

    plugin = BackendPlugin("counted", Section, Sampled, kind="sampler")
    with registry.backends.temporarily("counted", plugin):
        # it samples through the sim, version stamp and all: room for the stamp, the digit and its end
        config = sim_config(tmp_path, sampler="counted", steps=2, set={"counted.label": "y", "sampling.max_tokens": 3})
        summary = await train(config)
        assert summary.steps == 2
    ((section, ctx, training, sampler),) = seen
    assert section.label == "y" and type(training).__name__ == "SimBackend"
    assert ctx == context(config) and ctx.seed == config.seed and ctx.run_dir == str(tmp_path / "run")
    assert sampler.counter["requests"] > 0  # the run sampled through the sampler
    assert get_plugin("sim").kind == "training" and get_plugin("vllm").kind == "sampler"


# A third-party backend that offers one optional capability, ChecksLoss (headrace/core/protocols.py):
# it defines check_loss and registers nothing; the run finds it with isinstance and asks it before
# anything is sampled. It writes down each loss it was asked about.
CAPABLE = '''
"""picky: sim's backend whose training refuses every loss but one, before the run starts."""

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from headrace.backends.sim import SimBackend, SimConfig
from headrace.core.errors import ConfigError
from headrace.core.protocols import BackendPlugin


class PickyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    loss: str = "importance_sampling"


class PickyTraining:
    """sim's training calls, and check_loss: nothing else says it can check a loss."""

    def __init__(self, inner, allowed, asked):
        self.inner, self.allowed, self.asked = inner, allowed, asked

    def forward_backward(self, datums, loss):
        return self.inner.forward_backward(datums, loss)

    def optim_step(self, adam):
        return self.inner.optim_step(adam)

    def publish(self, version):
        return self.inner.publish(version)

    async def save_state(self, name):
        return await self.inner.save_state(name)

    async def load_state(self, path):
        await self.inner.load_state(path)

    def check_loss(self, loss):
        with open(self.asked, "a") as f:
            f.write(loss.name + "\\n")
        if loss.name != self.allowed:
            raise ConfigError(f"picky trains with loss '{self.allowed}' only, not '{loss.name}'")


class PickyBackend(SimBackend):
    def __init__(self, config, ctx):
        super().__init__(SimConfig(), ctx)
        self.training = PickyTraining(self.training, config.loss, Path(ctx.run_dir) / "asked.txt")


plugin = BackendPlugin("picky", PickyConfig, "picky:PickyBackend", description="a backend that checks losses")
'''


@pytest.fixture
def capable_site(tmp_path) -> Path:
    root = tmp_path / "capable"
    (root / "picky").mkdir(parents=True)
    (root / "picky" / "__init__.py").write_text(CAPABLE)
    info = root / "picky-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: picky\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[headrace.backends]\npicky = picky:plugin\n")
    return root


def test_a_third_party_backends_optional_capability_is_found_by_isinstance(capable_site, tmp_path, monkeypatch):
    from headrace.core.protocols import ChecksLoss, DeletesState

    monkeypatch.syspath_prepend(str(capable_site))
    import picky

    training = picky.PickyTraining(None, "importance_sampling", tmp_path / "asked.txt")
    assert isinstance(training, ChecksLoss) and not isinstance(training, DeletesState)

    run_dir = tmp_path / "run"
    common = ["--backend", "picky", "--batch-size", "2", "--group-size", "4", "--steps", "2", "--no-progress"]
    common += ["--set", "advantages.filter_constant=false", "--run-dir", str(run_dir)]
    ran = headrace(capable_site, "run", *common)
    assert ran.returncode == 0, ran.stderr
    assert (run_dir / "asked.txt").read_text().split() == ["importance_sampling"]  # asked once, before it trained
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2

    refused = headrace(capable_site, "run", *common, "--overwrite", "--set", "loss.name=ppo")
    assert refused.returncode == 2, refused.stderr
    assert "picky trains with loss 'importance_sampling' only, not 'ppo'" in refused.stderr
    assert (run_dir / "asked.txt").read_text().split() == ["ppo"]  # asked before anything was sampled
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()


def test_the_cluster_and_serve_sections_read_their_older_forms(tmp_path):
    """``cluster.*`` beside ``cluster.kind`` is ``[ray]`` now, and ``serve`` a section its room
    registers: config files, --set and the config.json of earlier runs still read."""
    config = build_config(overrides=["cluster.kind=ray", "cluster.rollout_workers=3", "ray.sampler_replicas=2"])
    assert config.cluster.kind == "ray" and "cluster" not in config.sections
    assert (config.section("ray").rollout_workers, config.section("ray").sampler_replicas) == (3, 2)
    mixed = build_config(flags={"cluster.kind": "ray"}, overrides=["cluster.learner_processes=2"])
    assert mixed.section("ray").learner_processes == 2
    # an earlier run's config.json: every run held the cluster's and serve's defaults
    legacy = build_config().model_dump()
    legacy |= {"cluster": {"kind": "none", "address": "local", "num_cpus": None, "rollout_workers": 2,
                           "sampler_replicas": 1, "learner_processes": 1, "episodes_per_worker": 256},
               "serve": {"port": 9000, "batch_size": 4}}  # fmt: skip
    resumed = build_config(base=legacy)
    assert resumed.cluster.kind == "none" and "ray" not in resumed.sections
    assert (resumed.section("serve").port, resumed.section("serve").batch_size) == (9000, 4)
    assert build_config(base=resumed.model_dump()) == resumed
    assert build_config().section("serve").port == 8000  # not given: serve's defaults
    with pytest.raises(ConfigError, match=r"unknown option 'serve.prot' \(did you mean 'serve.port'\?\)"):
        build_config(overrides=["serve.prot=1"])
    with pytest.raises(ConfigError, match=r"ray.rollout_workers: .*greater than or equal to 1"):
        build_config(overrides=["cluster.kind=ray", "cluster.rollout_workers=0"])
