"""The search environment through TRL's tool convention: ``GRPOTrainer(environment_factory=SearchTools.factory())``.

TRL's GRPOTrainer (``environment_factory``) builds one instance per rollout, calls ``reset(**row)`` with the dataset
row and appends the string it returns to the prompt's last user message, offers the instance's public methods as
tools (their names, type hints and Google-style docstrings make the schema the chat template renders), runs the tool
calls the model writes (parsed by the template's response schema; the results enter the completion as tool tokens,
``tool_mask`` 0) and scores the rollout with ``get_reward()``.

`SearchTools` plays `environments.search.SearchEnv` behind that interface, with the same corpus, questions, levels
and dynamics: ``search``, ``read`` and ``answer`` are its three actions, and each call is one turn of the episode. An
invalid call (an empty query, an unknown title) costs the environment's ``invalid_penalty`` and the episode goes on,
as with text actions. The episode ends with ``answer`` or after ``max_turns`` calls; a call after the end returns
``EPISODE_OVER`` and changes nothing. ``get_reward`` is the episode's return: the answer's reward plus the penalties.

The rows (`tool_dataset`) carry the instructions as the user message and the episode's ``level`` (the environment's
seed: training levels from 0, held-out levels from ``HELDOUT_LEVELS``, as the text environment's).
"""

from __future__ import annotations

import functools

from .base import HELDOUT_LEVELS, answer_text, check_max_turns, make_env
from .search import SearchEnv

INSTRUCTIONS = ("Answer the question with the help of a search engine over an encyclopedia of the story world. Call "
                "search to see the best page titles with their first sentence, read to see a page, and answer to give "
                "your answer, which ends the game with reward 1 if it is right.")  # fmt: skip
EPISODE_OVER = "the episode is over."


class SearchTools:
    """One search episode per rollout, its actions as tools (module docstring). ``params``: `SearchEnv`'s."""

    max_turns_default = SearchEnv.max_turns_default
    """Calls per episode, and the episode loop's agent turns (`trl_ext.env.tools`) unless --max_turns says."""

    def __init__(self, max_turns: int = SearchEnv.max_turns_default, **params):
        self._env = make_env("search", strict=True, **params)  # strict: a tool call is one action, tags are invalid
        self._max_turns = check_max_turns(max_turns)
        self._turns, self._return, self._success = 0, 0.0, False

    @classmethod
    def factory(cls, max_turns: int = SearchEnv.max_turns_default, **params):
        """What ``environment_factory`` takes: a callable building an instance (parameters checked now, once)."""
        cls(max_turns, **params)
        return functools.partial(cls, max_turns, **params)

    @classmethod
    def dataset(cls, n_rows: int, heldout: bool = False):
        """`tool_dataset`: the rows ``--env_factory environments.search_tools:SearchTools`` trains on (a classmethod:
        a public function of the class would be a tool)."""
        return tool_dataset(n_rows, heldout)

    def reset(self, level: int, **row) -> str:
        """Start the episode of ``level``; the question, appended to the user message."""
        self._turns, self._return, self._success = 0, 0.0, False
        return "\n" + self._env.reset(int(level))

    def _act(self, verb: str, argument: str) -> str:
        if self._env.done or self._turns >= self._max_turns:
            return EPISODE_OVER
        self._turns += 1
        result = self._env.step(answer_text(f"{verb}: {argument}"))
        self._return += result.reward
        self._success = bool(result.info.get("success", False))
        return result.observation if result.info["valid"] else f"invalid {verb}: {result.observation}"

    def search(self, query: str) -> str:
        """Search the encyclopedia.

        Args:
            query: The words to search for.

        Returns:
            The titles of the best pages, each with its first sentence.
        """
        return self._act("search", str(query))

    def read(self, title: str) -> str:
        """Read a page of the encyclopedia.

        Args:
            title: The title of the page.

        Returns:
            The page.
        """
        return self._act("read", str(title))

    def answer(self, text: str) -> str:
        """Answer the question; this ends the game.

        Args:
            text: The answer.

        Returns:
            Whether the answer is correct.
        """
        return self._act("answer", str(text))

    def get_reward(self) -> float:
        """The episode's return: 1 for a right answer, plus ``invalid_penalty`` for each invalid call."""
        return self._return

    @property
    def success(self) -> bool:
        return self._success


def tool_dataset(n_rows: int, heldout: bool = False, first_level: int = 0):
    """A ``datasets.Dataset`` of ``n_rows`` search episodes for ``environment_factory``: ``prompt`` (the instructions
    as one user message) and ``level`` (``first_level`` + row, plus ``HELDOUT_LEVELS`` when ``heldout``)."""
    from datasets import Dataset

    base = first_level + (HELDOUT_LEVELS if heldout else 0)
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": INSTRUCTIONS}]] * n_rows,
                              "level": list(range(base, base + n_rows))})  # fmt: skip
