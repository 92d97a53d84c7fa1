"""Dataset-driven accuracy rewards: a completion against its row's ``answer`` column (TRL reward signature).

The final answer of a completion (:func:`final_answer`): the content of its last ``<answer>...</answer>``, else of
its last ``\\boxed{...}`` (balanced braces), else the whole text.

- ``exact_match``: 1.0 when the normalised final answer equals the normalised ``answer``, else 0.0. Normalised
  (:func:`normalize`): lower-cased, whitespace runs collapsed to one space, stripped, one trailing period removed.
- ``math_accuracy``: 1.0 when ``math_verify.verify(parse(answer), parse(final))`` holds (Hugging Face Math-Verify,
  the checker of TRL's ``trl.rewards.accuracy_reward``): equal fractions, decimals, LaTeX and plain forms agree.
  Here the final answer keeps its ``\\boxed{}`` (Math-Verify extracts it) and only ``<answer>`` tags are cut;
  a text with a backslash that does not parse is retried inside ``$...$`` (bare LaTeX such as ``\\frac12``). An
  unparseable completion scores 0.0; an unparseable ``answer`` raises ValueError (a data error, not a wrong
  completion; TRL's accuracy_reward returns None and skips the row instead).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence

from .bound import completion_texts
from .functions import REWARD_FNS

_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = "\\boxed{"
PARSE_TIMEOUT_S = 5
"""Math-Verify's parsing and verification timeout (seconds; signal-based, so only in the main thread, as TRL)."""


def answer_tag(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` of ``text``, or None."""
    found = _ANSWER_TAG_RE.findall(text)
    return found[-1] if found else None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` of ``text`` (nested braces balanced), or None (none, or unclosed)."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(text: str) -> str:
    """The final answer of a completion (module docstring)."""
    for found in (answer_tag(text), last_boxed(text)):
        if found is not None:
            return found
    return text


def normalize(text: str) -> str:
    """Lower-cased, whitespace collapsed, stripped, one trailing period removed (then stripped again)."""
    out = " ".join(text.lower().split())
    return out[:-1].rstrip() if out.endswith(".") else out


def _answers(answer: Sequence, n: int) -> list[str]:
    if isinstance(answer, str) or not isinstance(answer, Sequence) or len(answer) != n:
        raise ValueError(f"answer must be a column with one value per completion ({n}), got {answer!r}")
    for i, a in enumerate(answer):
        if a is None or isinstance(a, bool) or not isinstance(a, (str, int, float)):
            raise ValueError(f"answer[{i}] must be a string or a number, got {a!r}")
    return [str(a) for a in answer]


@REWARD_FNS.register("exact_match")
def exact_match(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when the normalised final answer equals the normalised ``answer`` column value (module docstring)."""
    texts = completion_texts(completions)
    gold = _answers(answer, len(texts))
    return [float(normalize(final_answer(t)) == normalize(g)) for t, g in zip(texts, gold)]


@REWARD_FNS.register("math_accuracy")
def math_accuracy(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when Math-Verify finds the final answer equal to the ``answer`` column value (module docstring)."""
    from math_verify import verify

    texts = completion_texts(completions)
    gold = _answers(answer, len(texts))
    timeout = PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    out = []
    for i, (text, g) in enumerate(zip(texts, gold)):
        gold_parsed = _parse(g, timeout)
        if not gold_parsed:
            raise ValueError(f"math_accuracy: answer[{i}] {g!r} does not parse as math (Math-Verify)")
        tag = answer_tag(text)
        pred = _parse(text if tag is None else tag, timeout)
        out.append(float(bool(pred) and verify(gold_parsed, pred, timeout_seconds=timeout)))
    return out


def _parse(text: str, timeout: int | None) -> list:
    from math_verify import parse

    parsed = parse(text, parsing_timeout=timeout)
    if not parsed and "\\" in text:  # bare LaTeX (a command without $ delimiters), e.g. \frac12
        parsed = parse(f"${text.strip()}$", parsing_timeout=timeout)
    return parsed
