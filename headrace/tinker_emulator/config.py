"""The emulator's own config: where it listens, what computes (and with which models, under
which base-model names), its knobs and its log. ``headrace tinker-emulator`` builds one from its
flags, ``EmulatorThread`` from its arguments; both go through :meth:`EmulatorConfig.from_dict`,
so a bad value is refused the same way everywhere: one ``ValueError`` paragraph naming every bad
field and what it takes.

Light: no torch, no transformers. Whether a served model's weights exist is checked when the
emulator starts (``make_compute``), since finding them may convert a GGUF file.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from headrace.tinker_emulator.compute import Compute
from headrace.tinker_emulator.compute_bigram import DEFAULT_VOCAB, BigramCompute
from headrace.tinker_emulator.faults import Knobs

COMPUTES = ("torch", "bigram")
_DEVICE = re.compile(r"^(cpu|auto|mps|cuda(:\d+)?)$")


class EmulatorConfig(BaseModel):
    """Everything an emulator is built from. Frozen: the knobs are the one part that changes
    while it runs (``POST /emulator/knobs`` updates the ``Knobs`` object in place)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    host: str = Field("127.0.0.1", min_length=1, description="bind address (default: loopback only)")
    port: int = Field(8765, ge=0, le=65535, description="0 = pick a free one")
    compute: Literal["torch", "bigram"] = Field(
        "torch", description="torch: headrace's torch backend, real training; bigram: numpy, instant"
    )
    models: tuple[str, ...] = Field(
        ("tiny",), description="the base models served (--model): registry names, model directories or .gguf files"
    )
    serve_only: tuple[str, ...] = Field(
        (),
        description="the only base-model names answered to (--serve-only); empty: every name a client asks for, "
        "computed by the --model of that name or else the first",
    )
    vocab_size: int | None = Field(
        None,
        ge=56,
        le=1 << 20,
        description=f"the bigram compute's vocabulary (--vocab-size; default {DEFAULT_VOCAB:,}): every token id "
        "below it is accepted; the torch compute's is its model's",
    )
    device: str = Field("cpu", description="the torch compute's device: cpu | auto | cuda | cuda:N | mps")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the torch compute's dtype (auto: the torch backend's choice for the model)"
    )
    knobs: Knobs = Field(default_factory=Knobs)
    log: str | None = Field(None, description="append the request log here as JSON lines")

    @field_validator("models", mode="before")
    @classmethod
    def _models(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = (value,)
        if not isinstance(value, list | tuple):
            return value  # pydantic names the type error
        names = [v.strip() if isinstance(v, str) else v for v in value]
        if not names:
            raise ValueError("serve at least one base model (--model NAME, e.g. tiny or smollm2-135m)")
        if any(not (isinstance(n, str) and n) for n in names):
            raise ValueError(f"model names must be non-empty strings, got {list(value)!r}")
        return tuple(dict.fromkeys(names))  # a repeated --model serves that model once

    @field_validator("serve_only", mode="before")
    @classmethod
    def _serve_only(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = (value,)
        if not isinstance(value, list | tuple):
            return value
        names = [v.strip() if isinstance(v, str) else v for v in value]
        if any(not (isinstance(n, str) and n) for n in names):
            raise ValueError(f"--serve-only names must be non-empty strings, got {list(value)!r}")
        return tuple(dict.fromkeys(names))

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"'{value}' is not a torch device; use cpu, auto, cuda, cuda:N or mps")
        return value

    @field_validator("knobs", mode="before")
    @classmethod
    def _knobs(cls, value: Any) -> Any:
        if value is None:
            return Knobs()
        if isinstance(value, dict):
            return Knobs.from_dict(value)
        return value

    @model_validator(mode="after")
    def _bigram_serves_tiny(self) -> EmulatorConfig:
        if self.compute == "bigram" and self.models != ("tiny",):
            raise ValueError(
                f"the bigram compute serves only 'tiny' (its own bigram model, under any base-model name), not "
                f"{', '.join(repr(m) for m in self.models if m != 'tiny')}; use --compute torch to serve other models"
            )
        if self.compute == "torch" and self.vocab_size is not None:
            raise ValueError(
                "--vocab-size sets the bigram compute's vocabulary; the torch compute's is its model's "
                "(drop --vocab-size, or add --compute bigram)"
            )
        return self

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EmulatorConfig:
        """A validated config; ``ValueError`` names every bad or unknown field in one paragraph."""
        known = set(cls.model_fields)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown emulator setting(s) {unknown}; known: {sorted(known)}")
        if isinstance(values.get("knobs"), dict):  # the knobs' own message, not one wrapped in this one's
            values = values | {"knobs": Knobs.from_dict(values["knobs"])}
        try:
            return cls(**values)
        except pydantic.ValidationError as e:
            raise ValueError(f"bad emulator setting(s): {_describe(e)}") from None

    def replace(self, **values: Any) -> EmulatorConfig:
        """A validated copy with ``values`` changed (the knobs object is shared, not copied)."""
        return self.from_dict({name: getattr(self, name) for name in type(self).model_fields} | values)

    def url(self, port: int | None = None) -> str:
        host = self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1"  # noqa: S104 - printing only
        return f"http://{host}:{self.port if port is None else port}"


def make_compute(config: EmulatorConfig | str) -> Compute:
    """The compute ``config`` names (or the compute called ``config``, serving ``tiny``). The torch
    compute finds every served model's weights here: a missing one fails the start."""
    if isinstance(config, str):
        config = EmulatorConfig.from_dict({"compute": config})
    if config.compute == "bigram":
        return BigramCompute(config.vocab_size or DEFAULT_VOCAB)
    from headrace.tinker_emulator.compute_torch import TorchCompute

    return TorchCompute(config.device, config.models, config.dtype)


def _describe(e: pydantic.ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(map(str, err["loc"])) or "config"
        msg = str(err["msg"]).removeprefix("Value error, ")
        shown = "" if err["type"] in ("value_error", "missing") else f"={err['input']!r}"
        parts.append(f"{where}{shown}: {msg}")
    return "; ".join(parts)


__all__ = ["COMPUTES", "EmulatorConfig", "make_compute"]
