"""The task library's envs: word_math, gsm8k, math, tool_calc, tictactoe and pairwise_judge, each
driven by hand with scripted replies, round-tripped through pickle, and run for 2 steps through
the engine on the sim backend and on the embedded tiny model (torch)."""

from __future__ import annotations

import dataclasses
import http.server
import json
import math
import pickle
import re
import threading
from typing import ClassVar

import anyio
import pytest

from headrace.core.episode import EpisodeSpec, run_episode
from headrace.core.errors import ConfigError
from headrace.core.types import SampledTokens, SamplingParams, StopReason, Trajectory, Transition
from headrace.envs.context import EnvContext
from headrace.run.train import train
from headrace.tasks import word_math
from headrace.tasks.judges import OpenAIJudge, ShorterJudge, parse_verdict
from headrace.tasks.math_envs import MathEnv, make_gsm8k, make_math, make_word_math
from headrace.tasks.pairwise_judge import PairwiseGroup
from headrace.tasks.pairwise_judge import make_dataset as make_pairwise
from headrace.tasks.tictactoe import Game, TicTacToeGroup, parse_cell
from headrace.tasks.tictactoe import make_dataset as make_tictactoe
from headrace.tasks.tool_calc import ToolCalcEnv, problem_in
from headrace.tasks.tool_calc import make_dataset as make_tool_calc
from headrace.tokenizers.char import CharTokenizer
from tests.env_helpers import action, chatml_renderer, drive, encode, run_config, tiny_renderer

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A shop sells 2 pens a day for 5 days.", "answer": "2 * 5 = 10\n#### 10"},
    {"question": "Ann has 9 cards and gives 4 away.", "answer": "9 - 4 = 5\n#### 5"},
]
MATH_ROWS = [
    {"problem": "What is 1/2 + 1/4?", "solution": "We get $\\boxed{\\frac{3}{4}}$."},
    {"problem": "What is 2+2?", "solution": "\\boxed{4}"},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _ctx(renderer=None, **options) -> EnvContext:
    renderer = renderer or tiny_renderer()
    tokenizer = getattr(renderer, "tok", None) or CharTokenizer()
    if renderer.name == "chat_template":
        from headrace.tokenizers.hf import HFTokenizer

        tokenizer = HFTokenizer(renderer.hf)
    return EnvContext(
        tokenizer=tokenizer,
        group_size=4,
        batch_size=3,
        steps=5,
        seed=0,
        max_tokens=64,
        options=options,
        model="tiny" if renderer.name == "tiny" else "./chat",
        renderer_name=renderer.name,
    )


def _questions(dataset, index=0) -> list[str]:
    return [b.kwargs["question"] for b in dataset.get_batch(index)]


# ---- word_math, gsm8k, math ----


async def test_math_env_grades_boxed_hash_and_last_number_and_checks_the_asked_format():
    r = chatml_renderer()
    cases = [  # (answer_format, reply, reward, format_ok)
        ("boxed", "3 + 4 = 7, so \\boxed{7}", 1.0, 1.0),
        ("boxed", "The answer is 7.", 0.9, 0.0),  # right by its last number, not in the asked form
        ("boxed", "\\boxed{8}", 0.0, 1.0),
        ("hash", "3 + 4 = 7\n#### 7", 1.0, 1.0),
        ("number", "7", 1.0, 1.0),
        ("number", "it is 7", 0.9, 0.0),
        ("boxed", "no idea", -0.1, 0.0),
    ]
    for answer_format, reply, reward, format_ok in cases:
        env = MathEnv("Tom has 3 apples and buys 4. How many?", "7", r, 64, answer_format=answer_format)
        prompt, _ = await env.initial_observation()
        assert "\\boxed{}" in r.hf.decode(prompt) if answer_format == "boxed" else True
        (result,) = (await drive(env, r, [reply]))[2]
        assert result.done and result.reward == pytest.approx(reward), reply
        assert result.metrics["format_ok"] == format_ok and result.metrics["correct"] == float(reward > 0.5)


def test_word_math_splits_difficulty_and_options():
    train_set = make_word_math(_ctx(difficulty=1))
    assert _questions(train_set, 3) == _questions(train_set, 3)  # any batch can be rebuilt on its own
    assert all(word_math.split_of(q.rsplit(" Please", 1)[0]) == "train" for q in _questions(train_set))
    test_set = make_word_math(_ctx(difficulty=1, split="test", eval_size=7))
    assert len(test_set) == 3 and [len(test_set.get_batch(i)) for i in range(3)] == [3, 3, 1]  # each problem once
    held_out = [q for i in range(3) for q in _questions(test_set, i)]
    assert len(set(held_out)) == 7 and all(word_math.split_of(q.rsplit(" Please", 1)[0]) == "test" for q in held_out)
    answers = [b.kwargs["answer"] for b in test_set.get_batch(0)]
    assert answers == [str(word_math.generate(i, difficulty=1, split="test").answer) for i in range(3)]
    with pytest.raises(ValueError, match="no option 'dificulty'.*did you mean 'difficulty'"):
        make_word_math(_ctx(dificulty=1))
    with pytest.raises(ValueError, match="difficulty must be a level in 1-5"):
        make_word_math(_ctx(difficulty=9))
    with pytest.raises(ValueError, match="answer_format must be one of boxed, hash, number"):
        make_word_math(_ctx(answer_format="latex"))
    with pytest.raises(ValueError, match="split must be one of train, test"):
        make_word_math(_ctx(split="validation"))


def test_word_math_steps_and_max_value_replace_the_levels():
    # one-step problems: what SmolLM2-135M can pass (greedy 36% held out) when level 1's two are beyond it
    one_step = make_word_math(_ctx(difficulty=1, steps=1, split="test", eval_size=40))
    answers = [b.kwargs["answer"] for i in range(len(one_step)) for b in one_step.get_batch(i)]
    expected = [word_math.generate(i, difficulty=word_math.Difficulty(1, 20), split="test") for i in range(40)]
    assert answers == [str(p.answer) for p in expected] and {p.steps for p in expected} == {1}
    assert word_math.difficulty_of(3, max_value=30) == word_math.Difficulty(4, 30)
    assert word_math.difficulty_of(2) == word_math.LEVELS[2]
    with pytest.raises(ValueError, match="steps=1 / max_value=5 are out of range.*max_value >= 10"):
        make_word_math(_ctx(difficulty=1, steps=1, max_value=5))
    with pytest.raises(ValueError, match="option steps='one' should be a int"):
        make_word_math(_ctx(steps="one"))


async def test_gsm8k_and_math_from_local_files(tmp_path):
    r = chatml_renderer()
    gsm8k = make_gsm8k(_ctx(r, path=_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)))
    assert len(gsm8k) == 5  # training: the run's steps, epoch after epoch
    first_epoch = [b.kwargs["question"] for i in range(1) for b in gsm8k.get_batch(i)]
    assert sorted(first_epoch) == sorted(row["question"] for row in GSM8K_ROWS)
    assert {b.kwargs["answer"] for b in gsm8k.get_batch(0)} == {"7", "10", "5"}
    held_out = make_gsm8k(_ctx(r, path=_jsonl(tmp_path / "test.jsonl", GSM8K_ROWS[:2]), split="test"))
    assert len(held_out) == 1 and [b.kwargs["answer"] for b in held_out.get_batch(0)] == ["7", "10"]

    math_set = make_math(_ctx(r, path=_jsonl(tmp_path / "math.jsonl", MATH_ROWS), split="test"))
    builder = math_set.get_batch(0)[0]
    assert builder.kwargs["answer"] == "\\frac{3}{4}"
    env = (await builder.make_envs())[0]
    (result,) = (await drive(env, r, ["1/2 + 1/4 = 3/4, so \\boxed{0.75}"]))[2]
    assert result.metrics["correct"] == 1.0  # the grader compares values, not spellings


async def test_gsm8k_without_a_path_says_how_to_give_one(tmp_path):
    with pytest.raises(ConfigError, match="gsm8k dataset is not available.*env_options.path"):
        await train(run_config(tmp_path, "gsm8k"))
    with pytest.raises(ConfigError, match="no option 'paht'.*did you mean 'path'"):
        await train(run_config(tmp_path / "typo", "math", options={"paht": "x.jsonl"}))


# ---- tool_calc ----


async def test_tool_calc_runs_the_call_in_the_sandbox_and_grades_the_final_answer():
    r = tiny_renderer()
    env = ToolCalcEnv("483*27+1906", 483 * 27 + 1906, r, 32)
    observations, actions, results = await drive(env, r, ["<calc>483*27+1906</calc>", "14947"])
    assert not results[0].done and results[-1].done and results[-1].reward == 1.0
    tail = r.tok.decode(observations[1][len(observations[0]) + len(actions[0].tokens) :])
    assert tail == "t:14947a:"  # the tool's answer, then the next assistant turn
    assert env.messages[2] == {"role": "tool", "content": "14947"}
    assert results[-1].metrics == {"truncated": 0.0, "correct": 1.0, "tool_calls": 1, "tool_errors": 0}

    env = ToolCalcEnv("2+2", 4, r, 32, max_turns=2)
    _, _, results = await drive(env, r, ["<calc>open(1)</calc>", "<calc>4</calc>"])
    assert env.messages[2]["content"].startswith("error:") and "not allowed" in env.messages[2]["content"]
    # the last turn allowed is graded as the answer even when it is another call
    assert results[-1].done and results[-1].reward == 0.0
    assert results[-1].metrics["tool_calls"] == 1 and results[-1].metrics["tool_errors"] == 1


def test_tool_calc_problems_and_splits():
    expression, value = problem_in("test", "k", digits=3, terms=3)
    assert word_math.split_of(expression) == "test" and eval(expression) == value
    assert problem_in("test", "k", 3, 3) == (expression, value)
    held_out = make_tool_calc(_ctx(split="test", eval_size=4))
    assert len(held_out) == 2
    assert all(word_math.split_of(b.kwargs["expression"]) == "test" for b in held_out.get_batch(0))
    builder = make_tool_calc(_ctx(max_turns=3)).get_batch(0)[0]
    assert builder.kwargs["max_turns"] == 3 and word_math.split_of(builder.kwargs["expression"]) == "train"
    shown = make_tool_calc(_ctx(few_shot=True, tool_role="user")).get_batch(0)[0]
    roles = [m["role"] for m in ToolCalcEnv(**shown.kwargs).initial_messages()]
    assert roles == ["user", "assistant", "user", "assistant", "user"]  # one worked exchange, then the question
    with pytest.raises(ValueError, match="terms >= 2"):
        make_tool_calc(_ctx(terms=1))


# ---- tictactoe ----


def test_tictactoe_game_rules():
    game = Game((0, 1))
    for cell in (0, 3, 1, 4):
        game.play(cell)
    assert game.result is None and game.board() == "xx./oo./..."
    game.play(2)
    assert game.result == {0: 1.0, 1: -1.0} and game.illegal is None
    taken = Game((0, 1))
    taken.play(4)
    taken.play(4)  # o takes x's cell
    assert taken.result == {1: -1.0, 0: 1.0} and taken.illegal == 1
    draw = Game((0, 1))
    for cell in (0, 1, 2, 4, 3, 5, 7, 6, 8):
        draw.play(cell)
    assert draw.result == {0: 0.0, 1: 0.0}
    assert [parse_cell(t) for t in ("5", "cell 9 then 1", "0", "10", "none")] == [4, 8, None, None, None]


def _policy(pick):
    """A fake sampler that reads the board from the prompt and answers ``pick(board)``."""
    r = tiny_renderer()

    async def sample(prompt, n, params: SamplingParams):
        board = re.search(r"bottom: ([xo./]+)\.", r.tok.decode(prompt)).group(1).replace("/", "")
        tokens = encode(r, pick(board)) + list(r.end_of_turn)
        return [SampledTokens(tokens, [0.0] * len(tokens), StopReason.STOP)]

    return sample


def lowest(board: str) -> str:
    return str(board.index(".") + 1)


async def _play(envs, policies) -> list[Trajectory]:
    spec = EpisodeSpec(SamplingParams(), max_turns=16, seed=0)
    out: list[Trajectory | None] = [None] * len(envs)

    async def one(i):
        out[i] = await run_episode(envs[i], policies[i], spec, seed=i)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(len(envs)):
                tg.start_soon(one, i)
    return out


async def test_tictactoe_self_play_is_zero_sum_and_an_illegal_move_loses():
    builder = TicTacToeGroup(tiny_renderer(), 4, group_size=4)
    envs = await builder.make_envs()
    first = [(await e.initial_observation())[0] for e in envs]
    assert all(o == first[0] for o in first)  # everyone opens as x on an empty board: one shared sample
    # pair 0-1: member 1 always answers 5 (illegal once taken); pair 2-3: both play the lowest empty cell
    trajectories = await _play(envs, [_policy(lowest), _policy(lambda b: "5"), _policy(lowest), _policy(lowest)])
    totals = [t.total_reward for t in trajectories]
    assert totals[0] == 2.0 and totals[1] == -2.0  # member 1 lost both games by illegal moves
    assert totals[2] == 0.0 and totals[3] == 0.0  # x wins each game, and each member is x once
    assert trajectories[1].transitions[-1].metrics["illegal"] == 1.0
    assert trajectories[2].transitions[-1].metrics == {
        "win": 0.5,
        "loss": 0.5,
        "draw": 0.0,
        "illegal": 0.0,
        "aborted": 0.0,
        "moves": 7.0,
    }
    assert all(t.stop_reason == StopReason.DONE for t in trajectories)


async def test_tictactoe_against_the_bot_and_on_a_retry():
    builder = TicTacToeGroup(tiny_renderer(), 4, group_size=2, opponent="random", seed=3)
    (trajectory,) = await _play((await builder.make_envs())[:1], [_policy(lowest)])
    assert -2.0 <= trajectory.total_reward <= 2.0 and trajectory.transitions[-1].metrics["aborted"] == 0.0
    selfplay = TicTacToeGroup(tiny_renderer(), 4, group_size=2)
    await selfplay.make_envs()
    retry = await selfplay.make_envs()  # a retried member's partner has moved on: it plays the bot
    (trajectory,) = await _play(retry[1:], [_policy(lowest)])
    assert trajectory.transitions[-1].metrics["aborted"] == 0.0 and len(trajectory.transitions) >= 3


async def test_tictactoe_a_partner_that_fails_or_vanishes_releases_the_other():
    r = tiny_renderer()
    a, b = await TicTacToeGroup(r, 4, group_size=2, move_timeout_s=0.3).make_envs()
    await a.initial_observation()
    await b.initial_observation()
    with anyio.fail_after(5):
        result = await a.step(action(r, "1"))  # b never moves: a gives up after move_timeout_s
    assert result.done and result.reward == 0.0 and result.metrics["aborted"] == 1.0

    a, b = await TicTacToeGroup(r, 4, group_size=2).make_envs()
    await a.initial_observation()
    await b.initial_observation()
    with anyio.move_on_after(0.2):
        await a.step(action(r, "1"))  # cancelled while it waits for b: the match is aborted
    assert a.match.aborted
    with anyio.fail_after(5):
        result = await b.step(action(r, "5"))
    assert result.done and result.metrics["aborted"] == 1.0
    assert result.reward == 0.0 and b.match.games[1].board() == ".../.../..."  # a late move changes nothing


def test_tictactoe_options():
    with pytest.raises(ValueError, match="group_size must be even"):
        make_tictactoe(dataclasses.replace(_ctx(), group_size=3))
    dataset = make_tictactoe(_ctx(opponent="random"))
    assert dataset.get_batch(0)[0].opponent == "random"
    with pytest.raises(ValueError, match="'self' or 'random'"):
        make_tictactoe(_ctx(opponent="minimax"))


# ---- pairwise_judge ----


def _trajectory(renderer, text: str) -> Trajectory:
    act = action(renderer, text)
    return Trajectory([Transition([1], act, 0.0, True)], StopReason.DONE)


class Longer:
    """An in-process judge: the longer answer wins; an answer "?" gets no verdict."""

    def __init__(self):
        self.calls = []

    async def prefer(self, prompt, a, b):
        self.calls.append((a, b))
        return None if "?" in (a, b) else 0.5 if len(a) == len(b) else float(len(a) > len(b))


async def test_pairwise_rewards_are_win_rates_over_the_groups_pairs():
    r = tiny_renderer()
    judge = Longer()
    builder = PairwiseGroup("say hi", r, 8, 3, judge)
    envs = await builder.make_envs()
    assert len(envs) == 3 and (await envs[0].initial_observation())[0] == r.build_generation_prompt(
        [{"role": "user", "content": "say hi"}]
    )
    rewards = await builder.compute_group_rewards([_trajectory(r, t) for t in ("a", "bbb", "cc")])
    assert [x for x, _ in rewards] == [0.0, 1.0, 0.5] and len(judge.calls) == 6  # both orders
    assert rewards[1][1] == {"win_rate": 1.0, "judge_invalid": 0.0}
    one_way = PairwiseGroup("say hi", r, 8, 3, Longer(), both_orders=False)
    rewards = await one_way.compute_group_rewards([_trajectory(r, t) for t in ("a", "?", "cc")])
    assert [x for x, _ in rewards] == [0.25, 0.5, 0.75] and rewards[0][1]["judge_invalid"] == pytest.approx(2 / 3)
    assert await ShorterJudge().prefer("p", "a", "bb") == 1.0

    class Down:
        async def prefer(self, prompt, a, b):
            raise ConnectionError("judge endpoint down")

    with pytest.raises(ConnectionError, match="judge endpoint down"):  # its own error, not an ExceptionGroup
        await PairwiseGroup("say hi", r, 8, 3, Down()).compute_group_rewards([_trajectory(r, t) for t in "ab"])
    assert [parse_verdict(t) for t in ("A", " B.", "Response A", "maybe")] == [1.0, 0.0, 1.0, None]


class _ScriptedJudge(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint whose judge prefers the longer response, and answers
    "maybe" (no verdict) when a response is "?"."""

    requests: ClassVar[list] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, self.headers.get("Authorization"), body))
        text = body["messages"][-1]["content"]
        a = text.split("Response A:\n", 1)[1].split("\n\nResponse B:\n", 1)[0]
        b = text.split("\n\nResponse B:\n", 1)[1].split("\n\nWhich response", 1)[0]
        verdict = "maybe" if "?" in (a, b) else "A" if len(a) >= len(b) else "B"
        reply = json.dumps(
            {
                "id": "cmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": verdict}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_server():
    pytest.importorskip("openai")
    _ScriptedJudge.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ScriptedJudge, bind_and_activate=False)
    server.request_queue_size = 64  # the default 5 drops concurrent connections (a 1 s SYN retry each)
    server.server_bind()
    server.server_activate()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", _ScriptedJudge.requests
    server.shutdown()
    server.server_close()


async def test_the_openai_judge_through_the_real_client(judge_server, monkeypatch):
    url, requests = judge_server
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    r = tiny_renderer()
    judge = OpenAIJudge(url, "judge-model", api_key_env="JUDGE_KEY")
    builder = PairwiseGroup("say hi", r, 8, 3, judge)
    rewards = await builder.compute_group_rewards([_trajectory(r, t) for t in ("a", "bbb", "cc")])
    assert [x for x, _ in rewards] == [0.0, 1.0, 0.5] and len(requests) == 6
    path, auth, body = requests[0]
    assert path == "/v1/chat/completions" and auth == "Bearer sk-test" and body["model"] == "judge-model"
    assert body["temperature"] == 0.0 and "Prompt:\nsay hi" in body["messages"][-1]["content"]
    rewards = await builder.compute_group_rewards([_trajectory(r, t) for t in ("a", "?", "cc")])
    assert rewards[0][1]["judge_invalid"] == pytest.approx(4 / 6)
    clone = pickle.loads(pickle.dumps(builder))  # the client (sockets, a loop) stays behind
    assert clone.judge._clients == {} and clone.judge.base_url == url
    assert [x for x, _ in await clone.compute_group_rewards([_trajectory(r, t) for t in ("bb", "c")])] == [1.0, 0.0]


async def test_pairwise_judge_runs_through_the_engine_against_the_endpoint(tmp_path, judge_server):
    url, requests = judge_server
    config = run_config(tmp_path, "pairwise_judge", options={"judge_url": url, "judge_model": "m"})
    summary = await train(config)
    assert summary.steps == 2 and len(requests) == 2 * 2 * 12  # steps x groups x ordered pairs of 4
    assert all(row["env/all/judge_invalid"] == 0.0 for row in summary.metrics)


def test_pairwise_judge_options(tmp_path):
    with pytest.raises(ValueError, match="judge_url"):
        make_pairwise(_ctx())
    dataset = make_pairwise(_ctx(judge="shorter", split="test"))
    prompts = {dataset.get_batch(i)[0].prompt for i in range(5)}
    assert prompts and all(word_math.split_of(p) == "test" for p in prompts)
    path = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"say {w}"} for w in ("hi", "yes", "no", "ok", "go")])
    assert {b.prompt for b in make_pairwise(_ctx(judge="shorter", path=path)).get_batch(0)} <= {
        f"say {w}" for w in ("hi", "yes", "no", "ok", "go")
    }
    with pytest.raises(ValueError, match="row 0 .* no text field 'prompt'"):
        make_pairwise(_ctx(judge="shorter", path=_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}])))


# ---- every builder pickles; every env runs through the engine ----


async def test_every_task_builder_round_trips_through_pickle(tmp_path):
    ctxs = [_ctx(), _ctx(chatml_renderer())]
    for ctx in ctxs:
        path = _jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
        builders = [
            make_word_math(ctx).get_batch(0)[0],
            make_gsm8k(dataclasses.replace(ctx, options={"path": path})).get_batch(0)[0],
            make_tool_calc(ctx).get_batch(0)[0],
            make_tictactoe(ctx).get_batch(0)[0],
            make_pairwise(dataclasses.replace(ctx, options={"judge": "shorter"})).get_batch(0)[0],
            PairwiseGroup("p", ctx.renderer, 8, 2, OpenAIJudge("http://127.0.0.1:1/v1", "m")),
        ]
        for builder in builders:
            clone = pickle.loads(pickle.dumps(builder))
            envs, again = await builder.make_envs(), await clone.make_envs()
            assert len(envs) == len(again) == ctx.group_size or isinstance(builder, PairwiseGroup)
            prompts = [(await e.initial_observation())[0] for e in envs]
            assert prompts == [(await e.initial_observation())[0] for e in again]


ENVS = [
    ("word_math", {"difficulty": 1, "answer_format": "number"}),  # the tiny model's context is 256 characters
    ("gsm8k", "gsm8k"),
    ("math", "math"),
    ("tool_calc", {"digits": 2}),
    ("tictactoe", {}),
    ("pairwise_judge", {"judge": "shorter"}),
]


def _options(tmp_path, options):
    if options == "gsm8k":
        return {"path": _jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)}
    if options == "math":
        return {"path": _jsonl(tmp_path / "math.jsonl", MATH_ROWS)}
    return options


@pytest.mark.parametrize(("env", "options"), ENVS, ids=[e for e, _ in ENVS])
async def test_each_env_runs_on_the_sim_backend(tmp_path, env, options):
    summary = await train(run_config(tmp_path, env, "sim", _options(tmp_path, options)))
    assert summary.steps == 2 and len(summary.metrics) == 2
    rewards = [row["reward/mean"] for row in summary.metrics]
    assert all(math.isfinite(x) for x in rewards) and all(row.get("groups/dropped", 0) == 0 for row in summary.metrics)
    if env == "tictactoe":
        assert rewards == [0.0, 0.0]  # zero-sum within each pair


@pytest.mark.parametrize(("env", "options"), ENVS, ids=[e for e, _ in ENVS])
async def test_each_env_trains_two_steps_on_the_tiny_model(tmp_path, env, options):
    pytest.importorskip("torch")
    summary = await train(run_config(tmp_path, env, "torch", _options(tmp_path, options)))
    assert summary.steps == 2 and len(summary.metrics) == 2
    assert all(math.isfinite(row["optim/loss"]) for row in summary.metrics if "optim/loss" in row)
    assert any(k.startswith("env/all/") for k in summary.metrics[-1])
