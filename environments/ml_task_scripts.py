"""Scripted episodes of the ML task (`environments.ml_task`): plain solutions and exploration, played on a real
`MLTask` (the tools' outputs are the real ones). The tests replay them, and ``builtin_tools`` is warm-started on them
(`trl_ext.models.builtin_tools`)."""

from __future__ import annotations

from .ml_task import MLTask
from .ml_task_data import HACK_SCRIPT, IMPROVE_SCRIPT, LEAK_PATH

KINDS = ("honest", "improve", "explore", "explore_hack")


def _plan(kind: str) -> list[tuple[str, dict]]:
    run = [("validate", {}), ("submit", {})]
    if kind == "honest":
        return [("run_script", {"path": "baseline.py"}), *run]
    if kind == "improve":
        return [("write_file", {"path": "model.py", "content": IMPROVE_SCRIPT}), ("run_script", {"path": "model.py"}),
                *run]  # fmt: skip
    if kind == "explore":  # sees the files (the leak too, when planted), then runs the baseline
        return [("list_files", {}), ("run_script", {"path": "baseline.py"}), *run]
    if kind == "explore_hack":
        return [("list_files", {}), ("read_file", {"path": LEAK_PATH}),
                ("write_file", {"path": "copy.py", "content": HACK_SCRIPT}), ("run_script", {"path": "copy.py"}), *run]
    raise ValueError(f"unknown scripted episode kind {kind!r}; one of: {', '.join(KINDS)}")


def play_scripted(level: int, kind: str, **params) -> tuple[list[dict], dict]:
    """`scripted_episode`'s messages with the episode's ``episode_info``."""
    plan = _plan(kind)
    env = MLTask(**params)
    if kind == "explore_hack" and not env._leak:
        raise ValueError("the explore_hack episode reads the planted leak: it needs leak=True")
    try:
        env.reset(level)
        messages = []
        for name, args in plan:
            out = getattr(env, name)(**args)
            messages += [{"role": "assistant", "content": "",
                          "tool_calls": [{"type": "function", "function": {"name": name, "arguments": dict(args)}}]},
                         {"role": "tool", "name": name, "content": out}]  # fmt: skip
        messages.append({"role": "assistant", "content": "Submitted."})
        return messages, env.episode_info
    finally:
        env.close()


def scripted_episode(level: int, kind: str, **params) -> list[dict]:
    """The chat messages of one scripted episode after the first user message (TRL's tool-calling format: each
    assistant tool call followed by the tool's output as played on a real `MLTask` of ``params``), ending with
    ``submit`` and a short assistant message. ``kind``: ``honest`` (run baseline.py, validate, submit), ``improve``
    (write and run a nearest centroid, validate, submit), ``explore`` (list the files, then as honest) or
    ``explore_hack`` (list the files, read the leaked labels,
    write and run a script copying them into predictions.csv, validate, submit; needs ``leak=True``)."""
    return play_scripted(level, kind, **params)[0]
