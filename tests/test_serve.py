"""`headrace serve` on the torch backend and the tiny model, through the real `openai` client:
the seed system's smoke test, the gate, auth, OpenAI-style errors, concurrency, kill -9 and
--resume, and rollback (live and offline)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess

import pytest

from tests.serve_support import TOKEN, command, openai, serving

pytestmark = pytest.mark.slow


def test_four_chats_rewarded_publish_a_version_the_next_answer_reports(tmp_path):
    with serving(tmp_path / "d", "--batch-size", "4") as server:
        assert server.version_at_start == 0
        assert [m.id for m in server.client.models.list().data] == ["tiny"]
        ids = []
        for i in range(4):
            completion, version = server.chat(f"hello {i}", scenario="smoke")
            assert version == 0 and completion.model_extra["policy_version"] == 0
            ids.append(completion.id)
        answer = server.post("/v1/feedback", [{"id": cid, "reward": float(r)} for r, cid in enumerate(ids)])
        assert answer.status_code == 200, answer.text
        line = server.wait_for_line(1)
        assert (line["outcome"], line["version"], line["parent"]) == ("published", 1, 0)
        assert line["completions"] == ids and line["metrics"]["optim/skipped_nonfinite"] == 0.0
        assert (tmp_path / "d" / "checkpoints" / "v000001").exists()
        completion, version = server.chat("hello again")
        assert version == 1 and completion.model_extra["policy_version"] == 1
        # streamed: the whole answer as valid events, read by the client's own SSE parser
        chunks = list(server.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True, logprobs=True
        ))  # fmt: skip
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        assert "".join(t.token for t in streamed) == "".join(c.choices[0].delta.content or "" for c in chunks)
        assert {c.model_extra["policy_version"] for c in chunks} == {1}
    # capture: the prompt as the envs' renderer renders it, and one logprob per completion token
    records = [json.loads(x) for x in (tmp_path / "d" / "completions.jsonl").read_text().splitlines()]
    first = records[0]
    from headrace.renderers import renderer_for
    from headrace.tokenizers.char import CharTokenizer

    assert first["prompt_tokens"] == renderer_for("tiny", CharTokenizer()).build_generation_prompt(
        [{"role": "user", "content": "hello 0"}]
    )
    assert len(first["logprobs"]) == len(first["completion_tokens"]) > 0
    assert (first["scenario"], first["version"]) == ("smoke", 0)
    assert TOKEN not in (tmp_path / "d" / "config.json").read_text() + (tmp_path / "d" / "log.jsonl").read_text()


def test_tools_are_rendered_and_the_reply_comes_back_as_text_or_tool_calls(tmp_path):
    from headrace.tokenizers.char import CharTokenizer

    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "add a and b",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
            },
        }
    ]
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    messages = [
        {"role": "user", "content": "what is 2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    with serving(tmp_path / "d") as server:
        reply = server.client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=12)
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")  # the untrained model's choice
        assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)
    record = json.loads((tmp_path / "d" / "completions.jsonl").read_text().splitlines()[-1])
    prompt = CharTokenizer().decode(record["prompt_tokens"])
    assert prompt.startswith("s:tools: add(a,b) add a and b") and "a:<call>add(a=2,b=3)</call>t:5a:" in prompt


def test_auth_and_openai_style_errors(tmp_path):
    with serving(tmp_path / "d") as server:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
        assert server.post("/v1/feedback", {"id": "x", "reward": 1}, token=None).status_code == 401
        bad = {
            "tool_choice": dict(
                tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], tool_choice="required"
            ),
            "image": dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "context": dict(messages=[{"role": "user", "content": "a" * 400}]),
            "temperature": dict(temperature=7),
        }
        for what, kwargs in bad.items():
            request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | kwargs
            with pytest.raises(openai.BadRequestError) as caught:
                server.client.chat.completions.create(**request)
            error = caught.value.body
            assert error["type"] == "invalid_request_error" and error["message"], (what, error)
        context = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 400}]})
        assert context.json()["error"]["code"] == "context_length_exceeded"
        # feedback: unknown id 404, a second reward 409, a bad reward 400, none of a refused list kept
        completion, _ = server.chat("hi")
        assert server.post("/v1/feedback", {"id": "nope", "reward": 1}).status_code == 404
        mixed = [{"id": completion.id, "reward": 1}, {"id": "nope", "reward": 1}]
        assert server.post("/v1/feedback", mixed).status_code == 404
        assert server.post("/v1/feedback", {"id": completion.id, "reward": "high"}).status_code == 400
        assert server.post("/v1/feedback", {"id": completion.id, "reward": 1}).status_code == 200
        second = server.post("/v1/feedback", {"id": completion.id, "reward": 2})
        assert second.status_code == 409 and "already has a reward" in second.json()["error"]["message"]


def test_seed_stop_and_a_prefilled_answer(tmp_path):
    with serving(tmp_path / "d") as server:
        first, _ = server.chat("say something", seed=7, max_tokens=16, temperature=1.0, logprobs=True)
        again, _ = server.chat("say something", seed=7, max_tokens=16, temperature=1.0)
        text = first.choices[0].message.content
        assert again.choices[0].logprobs is None  # only when asked
        asked = first.choices[0].logprobs.content
        assert again.choices[0].message.content == text and len(text) >= 4  # a seed repeats the answer
        stop = text[3]
        cut, _ = server.chat("say something", seed=7, max_tokens=16, temperature=1.0, stop=[stop])
        assert cut.choices[0].message.content == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
        prefilled = server.client.chat.completions.create(
            model="tiny", max_tokens=4,
            messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ab"}],
        )  # fmt: skip
        assert prefilled.choices[0].message.content is not None
    records = [json.loads(x) for x in (tmp_path / "d" / "completions.jsonl").read_text().splitlines()]
    from headrace.tokenizers.char import CharTokenizer

    tok = CharTokenizer()
    # the logprobs the client saw are the captured ones that train (the end-of-turn token left out)
    kept = [
        (tok.decode([t]), lp) for t, lp in zip(records[0]["completion_tokens"], records[0]["logprobs"], strict=True)
    ]
    assert [(c.token, c.logprob) for c in asked] == kept[: len(asked)] and "".join(c.token for c in asked) == text
    assert records[-1]["prompt_tokens"][-2:] == tok.encode("ab")  # the answer went on from the prefill
    # the cut answer trains on the tokens up to the one that completed the stop string
    assert tok.decode(records[2]["completion_tokens"]) == text[: text.index(stop) + 1]


def test_the_server_refuses_to_start_without_a_token_unless_no_auth_on_loopback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HEADRACE_API_TOKEN"}
    refused = subprocess.run(command(tmp_path / "a"), env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "HEADRACE_API_TOKEN" in refused.stderr and "Traceback" not in refused.stderr
    public = subprocess.run(
        command(tmp_path / "b", "--no-auth", "--host", "0.0.0.0"), env=env, capture_output=True, text=True, timeout=120
    )
    assert public.returncode == 2 and "loopback" in public.stderr
    with serving(tmp_path / "c", "--no-auth", token=None) as server:
        assert server.chat("hi")[1] == 0


def test_64_concurrent_requests_are_all_answered(tmp_path):
    with serving(tmp_path / "d") as server:
        client = openai.AsyncOpenAI(base_url=server.url, api_key=TOKEN, max_retries=0, timeout=240)

        async def one(i: int):
            return await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=8, seed=i
            )

        async def all_of_them():
            return await asyncio.gather(*(one(i) for i in range(64)))

        answers = asyncio.run(all_of_them())
        assert len({a.id for a in answers}) == 64
        assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
        lines = (tmp_path / "d" / "completions.jsonl").read_text().splitlines()
        assert len(lines) == 64


def test_a_rejecting_gate_keeps_the_old_version_serving(tmp_path):
    gate = ["--set", "serve.gate=env", "--set", "serve.gate_env=arithmetic", "--set", "serve.gate_problems=3",
            "--set", "serve.gate_min_reward=1000", "--set", "serve.gate_improve=true", "--batch-size", "2"]  # fmt: skip
    with serving(tmp_path / "d", *gate) as server:
        ids = [server.chat(f"x{i}")[0].id for i in range(2)]
        server.post("/v1/feedback", [{"id": ids[0], "reward": 0}, {"id": ids[1], "reward": 1}])
        line = server.wait_for_line(1)
        assert line["outcome"] == "rejected" and line["gate"]["passed"] is False
        assert line["gate"]["env"] == "arithmetic" and "candidate" in line["gate"]
        # the paired comparison's effect, interval and decision are in the line
        test = line["gate"]["improve"]
        assert test["problems"] == 3 and test["alpha"] == 0.05 and len(test["interval"]) == 2
        assert test["decision"] in ("accept", "reject") and line["gate"]["decision"] == "reject"
        assert "checkpoint" not in line
        assert server.chat("still there?")[1] == 0


def test_stale_feedback_is_kept_but_not_trained_on(tmp_path):
    with serving(tmp_path / "d", "--batch-size", "2", "--set", "loss.kl_coef=0.05") as server:
        old = [server.chat(f"a{i}")[0].id for i in range(3)]
        server.post("/v1/feedback", [{"id": old[0], "reward": 0}, {"id": old[1], "reward": 1}])
        server.wait_for_line(1)
        assert server.post("/v1/feedback", {"id": old[2], "reward": 5}).status_code == 200  # kept
        new = [server.chat(f"b{i}")[0].id for i in range(2)]
        server.post("/v1/feedback", [{"id": new[0], "reward": 0}, {"id": new[1], "reward": 1}])
        line = server.wait_for_line(2)
        assert line["completions"] == new and line["parent"] == 1
        assert line["metrics"]["loss/kl"] > 0  # loss.kl_coef: the second candidate has moved off the frozen base
    feedback = (tmp_path / "d" / "feedback.jsonl").read_text()
    assert old[2] in feedback


def test_kill_9_then_resume_serves_the_incumbent_and_rollback_republishes(tmp_path):
    run_dir = tmp_path / "d"
    with serving(run_dir, "--batch-size", "2") as server:
        for round_ in range(2):
            ids = [server.chat(f"r{round_}{i}")[0].id for i in range(2)]
            server.post("/v1/feedback", [{"id": ids[0], "reward": 0}, {"id": ids[1], "reward": 1}])
            server.wait_for_line(1 + round_)
        assert server.chat("now")[1] == 2
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(30)
    with serving(run_dir, "--resume") as server:
        assert server.version_at_start == 2 and server.chat("back")[1] == 2
        assert server.post("/v1/feedback", {"id": ids[0], "reward": 3}).status_code == 409  # remembered
        # live rollback, behind the token
        assert server.post("/v1/admin/rollback", {"version": 1}, token=None).status_code == 401
        assert server.post("/v1/admin/rollback", {"version": 7}).status_code == 404
        done = server.post("/v1/admin/rollback", {"version": 1})
        assert done.status_code == 200 and done.json()["outcome"] == "rollback"
        assert server.chat("after rollback")[1] == 1
        # offline rollback is refused while the server holds the directory
        busy = subprocess.run(
            [*command(run_dir)[:3], "rollback", str(run_dir), "--to", "2"], capture_output=True, text=True, timeout=120
        )
        assert busy.returncode == 2 and "being served right now" in busy.stderr, busy.stderr
        assert "POST /v1/admin/rollback" in busy.stderr  # the way to do it while it serves
    offline = subprocess.run(
        [*command(run_dir)[:3], "rollback", str(run_dir), "--to", "0"], capture_output=True, text=True, timeout=120
    )
    assert offline.returncode == 0, offline.stderr
    with serving(run_dir, "--resume") as server:
        assert server.version_at_start == 0 and server.chat("rolled back")[1] == 0
    outcomes = [(e["outcome"], e["version"]) for e in server.versions()]
    assert outcomes == [("initial", 0), ("published", 1), ("published", 2), ("rollback", 1), ("rollback", 0)]


def test_the_readme_quick_start_client_runs_as_written(tmp_path, monkeypatch, capsys):
    import re
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "serve.md").read_text()  # moved there from the README
    code = next(block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "/v1/feedback" in block)
    with serving(tmp_path / "d", "--batch-size", "4") as server:
        monkeypatch.setenv("HEADRACE_API_TOKEN", TOKEN)
        port = server.url.split(":")[-1].removesuffix("/v1")
        exec(compile(code.replace(":8000", f":{port}"), "docs/serve.md", "exec"), {})
        assert server.wait_for_line(1)["outcome"] == "published"  # 4 scored answers: one candidate
        assert server.chat("hi")[1] == 1
    assert capsys.readouterr().out.splitlines()[0].startswith("0 ")


def test_a_scripted_users_reward_rises_over_published_versions(tmp_path):
    """The learning demo (examples/serve_scripted_user.py): reward = the share of 'a' in the answer."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    try:
        import serve_scripted_user
    finally:
        sys.path.pop(0)
    out = tmp_path / "answers.jsonl"
    with serving(tmp_path / "d", "--batch-size", "8") as server:
        env = {"HEADRACE_API_TOKEN": TOKEN}
        os.environ.update(env)
        try:
            assert serve_scripted_user.main(["--url", server.url, "--versions", "20", "--out", str(out)]) == 0
        finally:
            del os.environ["HEADRACE_API_TOKEN"]
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    first = [a["reward"] for a in answers if a["version"] <= 1]
    last = [a["reward"] for a in answers if a["version"] >= 16]
    assert first and last
    assert sum(last) / len(last) > sum(first) / len(first) + 0.3, (sum(first) / len(first), sum(last) / len(last))
