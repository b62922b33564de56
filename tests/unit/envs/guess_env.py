"""An OpenEnv-style environment defined locally for the tests of posttrain.envs (not a test file):
the shape of ``openenv.core.env_server.interfaces.Environment`` (openenv-core 0.3.0: ``reset`` and
``step`` returning pydantic observations with ``done`` and ``reward``), written here so that the
tests need no openenv package. A letter-guessing game: each guess that holds the secret letter ends
the episode with reward 1; otherwise the environment answers and the model guesses again."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from pydantic import BaseModel, Field

ActT, ObsT, StateT = TypeVar("ActT"), TypeVar("ObsT"), TypeVar("StateT")


class Environment(Generic[ActT, ObsT, StateT]):
    """openenv's base class, as far as posttrain reads it (not imported)."""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> ObsT: ...

    def step(self, action: ActT, timeout_s: float | None = None, **kwargs: Any) -> ObsT: ...


class GuessAction(BaseModel):
    guess: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class GuessObservation(BaseModel):
    feedback: str
    done: bool = False
    reward: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class GuessEnv(Environment[GuessAction, GuessObservation, dict]):
    def __init__(self, hint: str = "Guess my letter."):
        self.hint, self.secret, self.guesses = hint, "", []

    def reset(self, seed=None, episode_id=None, secret: str = "e") -> GuessObservation:
        self.secret, self.guesses = secret, []
        return GuessObservation(feedback=self.hint)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self.guesses.append(action.guess)
        hit = self.secret in action.guess
        return GuessObservation(feedback="yes" if hit else f"no; guess {len(self.guesses) + 1}", done=hit,
                                reward=1.0 if hit else 0.0)
