"""The configuration reference (docs/configuration.md) is generated from the config models, and
the committed page is what the generator prints: an option added, renamed or described
differently cannot leave the docs behind (issue 23, item 11)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from headrace.plugins.backends import plugins, section_model
from headrace.run.config import RunConfig

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.timeout(60)


def generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_config_docs", module)
    spec.loader.exec_module(module)
    return module


def test_the_committed_configuration_page_is_what_the_generator_prints():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == generator().render(), "docs/configuration.md is out of date: run python scripts/gen_config_docs.py"


def _fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _fields(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def _documented_models():
    yield RunConfig, ""
    for name, plugin in plugins():
        if not isinstance(plugin, Exception) and plugin.config.__module__.startswith("headrace."):
            yield plugin.config, f"{name}."
    yield section_model("serve"), "serve."


def test_every_option_has_a_description_for_the_reference():
    missing = [d for d, f in (x for m, p in _documented_models() for x in _fields(m, p)) if not f.description]
    assert not missing, f"give these fields a description (Field(..., description=...)): {missing}"


def test_the_page_lists_every_option_and_every_env_option():
    page = (ROOT / "docs" / "configuration.md").read_text()
    for model, prefix in _documented_models():
        for dotted, _ in _fields(model, prefix):
            assert f"| `{dotted}` |" in page, dotted
    assert "### `word_math`" in page and "| `difficulty` | `2` |" in page


def test_check_mode_fails_on_a_stale_page(tmp_path, monkeypatch, capsys):
    gen = generator()
    stale = tmp_path / "configuration.md"
    stale.write_text(gen.render().replace("optimizer steps", "steps of the optimizer"))
    monkeypatch.setattr(gen, "PAGE", stale)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1
    assert "configuration.md is out of date: run python scripts/gen_config_docs.py" in capsys.readouterr().err
    gen.main([])
    assert gen.main(["--check"]) == 0
