"""A small OpenEnv environment, written as OpenEnv's authors write one (openenv-core 0.3: an Environment with its
own Action and Observation models): a number-guessing game whose secret comes from the episode's seed. The
trainer runs it unchanged, in-process, as rl.environment (pip install 'llm-forge[envs]'; docs/rl.md):

    python -m training.train training/recipes/openenv_guess.yaml
"""

import random

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    """Guess the secret number."""

    guess: int = Field(description="Your guess, from 1 to 10")


class GuessObservation(Observation):
    hint: str = Field(default="", description="What the game says")


class GuessNumber(Environment[GuessAction, GuessObservation, State]):
    """A number-guessing game: -0.1 a wrong guess, 1.0 the right one, which ends the episode."""

    def __init__(self):
        super().__init__()
        self._state, self._secret = State(step_count=0), 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self._secret = random.Random(seed).randint(1, 10)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(hint="I picked a number from 1 to 10.", reward=0.0)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        if action.guess == self._secret:
            return GuessObservation(hint="Right!", reward=1.0, done=True)
        return GuessObservation(hint="Higher." if action.guess < self._secret else "Lower.", reward=-0.1)

    @property
    def state(self) -> State:
        return self._state
