"""A small OpenEnv environment server for the tests: guess a number from 0 to 9.

``reset(seed)`` draws the secret from the seed (so a group's episodes play the same one) and asks
``guess 0-9:``; each ``step`` answers `` higher:``/`` lower:`` (`` ?:`` when the guess is no
digit), reward 1 for the secret, up to three guesses. Two servers: ``text`` takes the guess as a
string (``GuessAction.guess``), ``number`` as an integer. The state reports the secret and the
guesses, so a test can check what each episode played.

``python tests/openenv_guess.py text|number`` serves one on a free loopback port and prints it
(``PORT 12345``).
"""

from __future__ import annotations

import random
import socket
import sys
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

MAX_GUESSES = 3


class GuessAction(Action):
    guess: str


class NumberAction(Action):
    guess: int


class GuessObservation(Observation):
    prompt: str
    guesses: int = 0


class GuessState(State):
    secret: int = -1
    guesses: int = 0
    solved: bool = False


class GuessEnvironment(Environment[Any, GuessObservation, GuessState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._state = GuessState(episode_id=episode_id, secret=random.Random(seed).randint(0, 9))
        return GuessObservation(prompt="guess 0-9:")

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        state = self._state
        state.step_count += 1
        state.guesses += 1
        text = str(action.guess).strip()
        guess = int(text) if text.isdigit() else None
        if guess == state.secret:
            state.solved = True
            return GuessObservation(prompt="", guesses=state.guesses, reward=1.0, done=True)
        hint = " ?:" if guess is None else " higher:" if guess < state.secret else " lower:"
        return GuessObservation(prompt=hint, guesses=state.guesses, reward=0.0, done=state.guesses >= MAX_GUESSES)

    @property
    def state(self) -> GuessState:
        return self._state


def app_for(kind: str) -> Any:
    action = {"text": GuessAction, "number": NumberAction}[kind]
    return create_fastapi_app(GuessEnvironment, action, GuessObservation, max_concurrent_envs=64)


if __name__ == "__main__":
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app_for(sys.argv[1]), log_level="warning"))
    server.run(sockets=[sock])
