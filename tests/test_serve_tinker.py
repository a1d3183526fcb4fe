"""`headrace serve --backend tinker` against `headrace tinker-emulator`, through the official SDK:
the smoke test (4 chats, rewards 0-3, one step, a new version answers), candidates as separate
training clients forked from the incumbent's saved state, and kill -9 + --resume."""

from __future__ import annotations

import signal

import pytest

from tests.serve_support import serving
from tests.tinker_support import assert_no_double_apply, emulator

pytestmark = [pytest.mark.slow, pytest.mark.tinker]


def test_smoke_and_resume_on_the_tinker_emulator(tmp_path):
    with emulator() as emu:
        flags = ["--tinker-url", emu.url, "--set", "tinker.lora_rank=4", "--batch-size", "4"]
        run_dir = tmp_path / "d"
        with serving(run_dir, *flags, backend="tinker") as server:
            ids = [server.chat(f"hello {i}", scenario="smoke")[0].id for i in range(4)]
            assert server.post("/v1/feedback", [{"id": c, "reward": float(r)} for r, c in enumerate(ids)]).is_success
            line = server.wait_for_line(1)
            assert (line["outcome"], line["version"]) == ("published", 1)
            assert line["checkpoint"].startswith("tinker://")
            assert server.chat("next")[1] == 1
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(30)
        models = emu.models()
        # the candidate trained on a training client of its own, created from the incumbent's saved state
        assert len(models) >= 2
        assert sum(info["steps"] for info in models.values()) >= 1
        with serving(run_dir, *flags, "--resume", backend="tinker") as server:
            assert server.version_at_start == 1 and server.chat("again")[1] == 1
        assert_no_double_apply(emu)
