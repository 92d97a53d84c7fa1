"""Text environments: interface, registry, RAGEN answer format and the multi-turn loop.

Semantics follow RAGEN (commit 381b659, 2025-02-15: ``ragen/env/base.py``, ``ragen/llm_agent/generation.py``):

- Every prompt ends with the prefilled ``<think>`` (``THINK_PREFILL``; RAGEN's templates end with it).
- Parsing (``BaseDiscreteActionEnv.postprocess_predictions``): the text after the first ``<answer>`` up to
  the next ``</answer>`` (or the end), or the whole text when there is no ``<answer>``; anything before
  ``<answer>`` is ignored. Its stripped content is matched by the environment's ``parse_action`` (action
  words, and in RAGEN's grid environments action digits: ``4``, ``4 (right)``).
- An unparseable answer is *invalid*: the environment takes its no-op step (``_noop``: Sokoban's costs
  -0.1) and the step reward is that plus ``invalid_penalty``; the agent is shown the no-op step's reward
  without the penalty (RAGEN: "penalty_for_invalid is not included in observation shown to the LLM").
- ``--env_params strict=true`` (any environment) switches to the project's stricter format instead: no
  prefill, and only ``<think>T</think><answer>A</answer>`` or ``<answer>A</answer>`` with action words
  (``extract_answer``); it helps very small models that must learn the format from scratch.

In a multi-turn episode each step's reward, done flag and new observation are appended as the next
environment turn; the trajectory reward is the sum of step rewards.

Everything here is text level and model free: a trainer supplies a policy (a function from history text
or in-progress trajectories to answer text) and tokenizes ``Trajectory.segments()`` to mask environment
tokens out of the loss.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import yaml

from trl_ext.registry import ConfigError, Registry

ENVIRONMENTS: Registry = Registry("environment")

# Modules whose import registers the builtin environments (see ``make_env``).
BUILTIN_MODULES = ("bandit", "sokoban", "frozenlake", "arithmetic", "prisoners", "search")

# Level seeds: RL and SFT training levels start at TRAIN_LEVELS, held-out validation levels at
# HELDOUT_LEVELS (the builtin_env pretraining corpus uses seeds from 1_000_000 on).
TRAIN_LEVELS = 0
HELDOUT_LEVELS = 100_000

# Joins history segments; also ends every segment, so a history always ends with it and a model
# generating from it starts directly with its answer.
SEPARATOR = "\n"
# RAGEN's prompts end with the opened think tag; the agent's text continues it (non-strict format).
THINK_PREFILL = "<think>"

# ---------------------------------------------------------------------------------------------------
# Answer format

_TAG = re.compile(r"<\s*(/?)\s*(think|answer)\s*>", re.IGNORECASE)
_THINK_ANSWER = [("", "think"), ("/", "think"), ("", "answer"), ("/", "answer")]
_ANSWER_ONLY = [("", "answer"), ("/", "answer")]


def extract_answer(text: str) -> str | None:
    """The stripped content of the ``<answer>`` tag, or None when ``text`` is not in the RAGEN format.

    Accepted: ``<think>T</think><answer>A</answer>`` or ``<answer>A</answer>``, with only whitespace
    outside the tags. Tags are case-insensitive and may contain whitespace (``< / answer >``, as a
    WordPiece decode prints them). None on: a missing, extra, repeated, nested or out-of-order tag, any
    text outside the tags, or an empty answer.
    """
    matches = list(_TAG.finditer(text))
    shape = [(m.group(1), m.group(2).lower()) for m in matches]
    if shape not in (_THINK_ANSWER, _ANSWER_ONLY):
        return None
    outside = [text[: matches[0].start()], text[matches[-1].end() :]]
    if shape == _THINK_ANSWER:
        outside.append(text[matches[1].end() : matches[2].start()])
    if any(part.strip() for part in outside):
        return None
    answer = text[matches[-2].end() : matches[-1].start()].strip()
    return answer or None


def ragen_answer(text: str) -> str:
    """RAGEN's answer extraction (``postprocess_predictions``): the stripped text between the first
    ``<answer>`` and the next ``</answer>`` (or the end), or all of ``text`` without ``<answer>``.
    Tags may contain whitespace and any case (``< answer >``, as a WordPiece decode prints them)."""
    tags = list(_TAG.finditer(text))
    opening = next((m for m in tags if m.group(1) == "" and m.group(2).lower() == "answer"), None)
    if opening is None:
        return text.strip()
    rest = text[opening.end() :]
    close = next((m for m in _TAG.finditer(rest) if m.group(1) == "/" and m.group(2).lower() == "answer"), None)
    return (rest[: close.start()] if close else rest).strip()


def answer_text(action: str) -> str:
    """The no-think completion for an action: ``<answer>action</answer>``."""
    return f"<answer>{action}</answer>"


INVALID_ACTION_NAME = "none"  # RAGEN's ACTION_LOOKUP[INVALID_ACTION]


def no_think_rewrite(text: str, env: Environment) -> str:
    """RAGEN's ``no_think_rl`` (``generation.py``): the trained response is ``<answer>X</answer>``, X the
    canonical action ``env`` parses from ``text``, or ``none`` when it is invalid; re-parsing the
    rewrite gives the same action (checked)."""
    action = env.parse_answer(text)
    rewritten = answer_text(action if action is not None else INVALID_ACTION_NAME)
    if env.parse_answer(rewritten) != action:
        raise AssertionError(f"{env.name}: no_think rewrite {rewritten!r} does not parse as {action!r}")
    return rewritten


def truncate_after_answer(text: str) -> str:
    """Cut ``text`` after its first closing answer tag (RAGEN's response post-processing)."""
    for m in _TAG.finditer(text):
        if m.group(1) == "/" and m.group(2).lower() == "answer":
            return text[: m.end()]
    return text


# ---------------------------------------------------------------------------------------------------
# Interface


@dataclass(frozen=True)
class StepResult:
    """One environment step. ``info`` always holds ``valid`` (bool), ``action`` (str or None),
    ``penalty`` (the invalid-answer penalty included in ``reward``, 0 when valid) and ``shown_reward``
    (``reward`` without the penalty: what the agent is shown)."""

    observation: str
    reward: float
    done: bool
    info: dict


class Environment(ABC):
    """A seeded text environment: ``reset(seed)`` -> observation; ``step(answer text)`` -> StepResult.

    Subclasses set the class attributes, build their state in ``_reset`` from a ``random.Random`` seeded
    by ``reset(seed)`` (so an episode is reproducible), apply a parsed action in ``_apply`` and render the
    state in ``format_observation`` as plain text: space-separated ASCII symbols, digits and words.
    """

    name: ClassVar[str]
    max_turns_default: ClassVar[int]
    invalid_penalty: ClassVar[float] = -1.0
    action_words: ClassVar[tuple[str, ...]]
    # RAGEN's action numbers: digit_actions[i] is the answer ``i + 1`` (grid environments), () for none.
    digit_actions: ClassVar[tuple[str, ...]] = ()
    strict: bool = False  # the project's strict answer format (``--env_params strict=true``, see make_env)
    has_solver: ClassVar[bool] = False
    single_step: ClassVar[bool] = False  # the first step always ends the episode (also when invalid)
    instructions: ClassVar[str]  # task + format description for instruct-model prompts

    def __init__(self, invalid_penalty: float | None = None):
        if invalid_penalty is not None:
            self.invalid_penalty = float(invalid_penalty)
        self._started = False
        self._done = False

    def reset(self, seed: int) -> str:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"{self.name}: seed must be a non-negative int, got {seed!r}")
        self._begin(seed)
        self._reset(self.rng)
        return self.format_observation()

    def _begin(self, seed: int) -> None:
        """Start an episode: seed the episode's random stream and clear the done flag."""
        self.seed, self.rng = seed, random.Random(seed)
        self._started, self._done = True, False

    def step(self, action_text: str) -> StepResult:
        if not self._started:
            raise RuntimeError(f"{self.name}: step() before reset()")
        if self._done:
            raise RuntimeError(f"{self.name}: step() after the episode ended")
        action = self.parse_answer(action_text)
        if action is None:
            shown, done, info = self._noop()
            penalty = self.invalid_penalty
        else:
            (shown, done, info), penalty = self._apply(action), 0.0
        self._done = done
        info = {"valid": action is not None, "action": action, "penalty": penalty, "shown_reward": shown, **info}
        return StepResult(self.format_observation(), float(shown + penalty), done, info)

    def _noop(self) -> tuple[float, bool, dict]:
        """The step an invalid answer takes before its penalty (RAGEN's INVALID_ACTION 0): reward 0, ends
        the episode only in single-step environments. Sokoban overrides it (gym-sokoban's no-op: -0.1)."""
        return 0.0, self.single_step, {}

    @property
    def prefill(self) -> str:
        """Text that ends every prompt, the agent's answer continuing it: RAGEN's ``<think>``, or none."""
        return "" if self.strict else THINK_PREFILL

    @classmethod
    def sft_params(cls, params: dict) -> dict:
        """Parameters of the environment whose BFS paths make SFT data (FrozenLake: non-slippery ice)."""
        return params

    @property
    def done(self) -> bool:
        return self._done

    def parse_answer(self, text: str) -> str | None:
        """The canonical action of an answer (RAGEN's extraction, or ``extract_answer`` when strict)."""
        answer = extract_answer(text) if self.strict else ragen_answer(text)
        return None if answer is None else self.parse_action(answer)

    def parse_action(self, answer: str) -> str | None:
        """An answer's content -> canonical action word (lower case), or None. Case-insensitive. Not
        strict and with ``digit_actions``: also RAGEN's ``extract_action`` forms ``N`` and ``N (word)``
        (the digit decides: ``4 (up)`` is action 4)."""
        word = answer.strip().lower()
        if word in self.action_words:
            return word
        if self.digit_actions and not self.strict:
            match = _digit_pattern(len(self.digit_actions), self.action_words).fullmatch(word)
            if match:
                return self.digit_actions[int(match.group(1) or match.group(2)) - 1]
        return None

    @abstractmethod
    def _reset(self, rng: random.Random) -> None: ...

    @abstractmethod
    def _apply(self, action: str) -> tuple[float, bool, dict]:
        """Apply a valid action; return (reward, done, extra info)."""

    @abstractmethod
    def format_observation(self) -> str: ...


def _digit_pattern(n: int, words: Sequence[str]) -> re.Pattern:
    """RAGEN's grid ``extract_action`` regex: ``^\\s*(([1-n])\\s*\\((w|..)\\)|(w|..)|([1-n]))\\s*$``."""
    alts = "|".join(map(re.escape, words))
    return re.compile(rf"\s*(?:([1-{n}])\s*\((?:{alts})\)|([1-{n}]))\s*")


def register_env(cls: type[Environment]) -> type[Environment]:
    """Class decorator: register an Environment subclass under its ``name``."""
    ENVIRONMENTS.register(cls.name)(cls)
    return cls


def env_class(name: str) -> type[Environment]:
    for module in BUILTIN_MODULES:
        importlib.import_module(f"{__package__}.{module}")
    return ENVIRONMENTS.get(name)


def make_env(name: str, **params) -> Environment:
    """Build a registered environment; unknown name, unknown parameter or bad value -> ConfigError.

    ``strict`` (bool, any environment): the project's strict answer format instead of RAGEN's."""
    cls = env_class(name)
    strict = params.pop("strict", False)
    if not isinstance(strict, bool):
        raise ConfigError(f"environment {name!r}: strict must be true or false, got {strict!r}")
    try:
        inspect.signature(cls).bind(**params)
    except TypeError as e:
        accepted = [p for p in inspect.signature(cls).parameters]
        raise ConfigError(
            f"environment {name!r}: bad parameters {sorted(params)} ({e}); accepted: {accepted}"
        ) from None
    try:
        env = cls(**params)
    except ValueError as e:  # includes ConfigError (e.g. an unknown opponent)
        raise ConfigError(f"environment {name!r}: {e}") from None
    env.strict = strict
    return env


def parse_env_params(text: str) -> dict:
    """``"key=value,key=value"`` -> dict; each value is a YAML scalar (``true``, ``6``, ``0.9``, ``random``)."""
    params = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError(f"--env_params: expected key=value pairs separated by commas, got {item!r}")
        if key.strip() in params:
            raise ConfigError(f"--env_params: {key.strip()!r} given twice")
        params[key.strip()] = yaml.safe_load(value.strip()) if value.strip() else ""
    return params


def check_max_turns(max_turns: int) -> int:
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ConfigError(f"max_turns must be an int >= 1, got {max_turns!r}")
    return max_turns


# ---------------------------------------------------------------------------------------------------
# Multi-turn episodes


def feedback_text(result: StepResult) -> str:
    """The environment turn shown after an action: validity, reward without the invalid-answer penalty
    (RAGEN's ``parse_update_info_to_obs``), done flag, new observation."""
    lines = [] if result.info["valid"] else ["invalid answer"]
    shown = round(result.info["shown_reward"], 10)
    lines += [f"reward: {shown:g}", f"done: {str(result.done).lower()}", result.observation]
    return SEPARATOR.join(lines)


@dataclass
class Turn:
    agent: str  # the policy's text, as generated
    env: str  # the environment's reply (``feedback_text``)
    reward: float
    valid: bool
    info: dict


@dataclass
class Trajectory:
    seed: int
    observation: str  # the observation returned by reset
    turns: list[Turn] = field(default_factory=list)
    done: bool = False  # the environment ended the episode
    truncated: bool = False  # max_turns ran out first
    prefill: str = ""  # the environment's ``prefill``: ends every prompt, the agent's text continues it
    env: str = ""  # the environment's name (a mixture's episodes differ in it; empty where no one set it)
    final: dict = field(default_factory=dict)  # a tool environment's ``episode_info()`` at the end (detectors, metrics)

    def add(self, agent: str, result: StepResult) -> None:
        self.turns.append(Turn(agent, feedback_text(result), result.reward, result.info["valid"], result.info))
        self.done = result.done

    @property
    def step_rewards(self) -> list[float]:
        return [t.reward for t in self.turns]

    @property
    def total_reward(self) -> float:
        return sum(self.step_rewards)

    @property
    def n_invalid(self) -> int:
        return sum(not t.valid for t in self.turns)

    @property
    def success(self) -> bool:
        """True when a step reported ``info["success"]`` (solved / goal / correct answer)."""
        return any(t.info.get("success", False) for t in self.turns)

    def segments(self) -> list[tuple[str, str]]:
        """(role, text) pieces in order, role "env" or "agent"; env pieces are not trained on."""
        out = [("env", self.observation)]
        for t in self.turns:
            out += [("agent", t.agent), ("env", t.env)]
        return out

    def history_text(self) -> str:
        """Plain-text prompt for the next action: every segment followed by SEPARATOR, every env segment
        then by the prefill."""
        return "".join(text + SEPARATOR + (self.prefill if role == "env" else "") for role, text in self.segments())

    def messages(self, system: str | None = None) -> list[dict]:
        """Chat messages (env turns as "user", agent turns as "assistant", each after the prefill) for
        chat-template models; the caller appends the prefill after the generation prompt."""
        head = [{"role": "system", "content": system}] if system is not None else []
        return head + [{"role": "user", "content": text} if role == "env"
                       else {"role": "assistant", "content": self.prefill + text} for role, text in self.segments()]  # fmt: skip


def run_episodes(
    envs: Sequence[Environment],
    policy: Callable[[list[Trajectory]], list[str]],
    seeds: Sequence[int],
    max_turns: int,
) -> list[Trajectory]:
    """Play one episode per (env, seed) in lock step; ``policy`` answers all unfinished ones per turn."""
    check_max_turns(max_turns)
    if len(envs) != len(seeds):
        raise ValueError(f"{len(envs)} environments but {len(seeds)} seeds")
    trajs = [Trajectory(seed, env.reset(seed), prefill=env.prefill) for env, seed in zip(envs, seeds)]
    active = list(range(len(envs)))
    for _ in range(max_turns):
        if not active:
            break
        answers = policy([trajs[i] for i in active])
        if len(answers) != len(active):
            raise ValueError(f"policy returned {len(answers)} answers for {len(active)} episodes")
        for i, text in zip(active, answers):
            trajs[i].add(text, envs[i].step(text))
        active = [i for i in active if not trajs[i].done]
    for i in active:
        trajs[i].truncated = True
    return trajs


def run_episode(env: Environment, policy_fn: Callable[[str], str], seed: int, max_turns: int) -> Trajectory:
    """One episode; ``policy_fn(history_text) -> answer text``."""
    return run_episodes([env], lambda ts: [policy_fn(ts[0].history_text())], [seed], max_turns)[0]
