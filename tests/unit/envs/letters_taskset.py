"""A verifiers (0.4.0) taskset defined locally for the tests of posttrain.envs (imported by its module
path, ``tests.unit.envs.letters_taskset``, as ``verifiers`` imports an installed taskset): each task
asks for a word; two weighted reward functions score the reply (not a test file)."""

from __future__ import annotations

import verifiers.v1 as vf

__all__ = ["LettersTaskset"]

WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "bread")
LOWERCASE_WEIGHT, ECHO_WEIGHT = 1.0, 0.5


def lowercase_fraction(text: str) -> float:
    """The share of the reply's characters that are ASCII lowercase letters."""
    return sum("a" <= ch <= "z" for ch in text) / max(len(text), 1)


def echoes(text: str, word: str) -> float:
    return float(word in text)


class LettersData(vf.TaskData):
    answer: str = ""


class LettersTask(vf.Task[LettersData]):
    @vf.reward(weight=LOWERCASE_WEIGHT)
    async def lowercase(self, trace) -> float:
        return lowercase_fraction(trace.last_reply)

    @vf.reward(weight=ECHO_WEIGHT)
    async def echo(self, task, trace) -> float:
        return echoes(trace.last_reply, task.answer)


class LettersConfig(vf.TasksetConfig):
    num_tasks: int = 8
    system: str | None = None


class LettersTaskset(vf.Taskset[LettersTask, LettersConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            word = WORDS[i % len(WORDS)]
            yield LettersTask(LettersData(prompt=f"Write the word {word}.", answer=word,
                                          system_prompt=self.config.system))
