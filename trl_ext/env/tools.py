"""Tool environments in the project's episode loop: any class in TRL's ``environment_factory`` convention played as
`ToolEpisode` s by `trl_ext.env.episodes.play`, so that every extension (off-policy, in-flight updates, routing,
distillation, vLLM engines and servers, several processes) composes with tool calls as with text actions.

The convention is TRL's (``GRPOTrainer(environment_factory=...)``, trl 1.x ``grpo_trainer.py``): one instance per
rollout; ``reset(**row)`` gets the dataset row and returns a string appended to the prompt's last message; the public
methods are the tools (their type hints and Google-style docstrings make the schema the chat template renders);
``get_reward()`` scores the episode. What is TRL's is used as TRL uses it: the tool methods as TRL lists them
(`tool_methods`), the response parser (``trl.chat_template_utils.parse_response`` after ``add_response_schema``),
the training chat template of a template that is not prefix-preserving (``get_training_chat_template``), the tokens of
the tool results (TRL's ``_get_tool_suffix_ids``, `tool_suffix_ids`), a failing tool's result (``{"error": ...}``).

Turns: each agent turn is sampled to its end of turn and parsed; its tool calls run (every call of the turn, in
order) and their results are rendered as environment tokens (``env_mask`` 0) before the next turn. The episode ends
at a turn without a tool call or at its turn limit (``--max_turns``: agent turns; the last turn's calls still run,
their results are not shown). The episode's return is ``get_reward()`` (carried by its last turn). Optional, none of them a
public method (which TRL's convention would make a tool): a ``success`` property (the episode's success metric), an
``episode_info`` property (a dict that reaches ``Trajectory.final`` for detectors, and whose numbers are logged as
``env/<key>``), a ``_close()`` method called at the episode's end (its resources go: a workspace).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
from collections.abc import Callable

from environments.base import Trajectory, Turn
from trl_ext.compat import tool_suffix_ids
from trl_ext.registry import ConfigError

CONTROL_COLUMNS = ("env", "env_seed")
"""Row columns of the project's own (the environment's name, the level for saved rollouts): not passed to reset."""


HOOKS = {"episode_info": "property (the dict the episode reports at its end)", "success": "property",
         "close": "private _close() (called at the episode's end)"}
"""What the loop reads of an instance beside TRL's convention, none of them a public method (which would be a tool):
``success`` and ``episode_info`` properties, a ``_close()`` method."""


def tool_methods(instance) -> list[Callable]:
    """The instance's tools, as TRL lists them: the public functions of its class other than reset and get_reward,
    bound to the instance (listed on the class: properties are not evaluated)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]  # fmt: skip


def check_factory(factory: Callable, what: str) -> object:
    """One instance of ``factory`` (as TRL probes one): it must define reset, get_reward and at least one tool whose
    schema transformers can build from its docstring; ConfigError naming ``what`` otherwise."""
    from transformers.utils import get_json_schema

    instance = factory()
    for method in ("reset", "get_reward"):
        if not callable(getattr(type(instance), method, None)):
            raise ConfigError(f"{what}: the environment class must define {method}() (TRL's environment_factory)")
    tools = tool_methods(instance)
    for name in HOOKS:
        if any(t.__name__ == name for t in tools):
            raise ConfigError(f"{what}: {name} is a public method, so TRL's convention makes it a tool; make it a "
                              f"{HOOKS[name]}")  # fmt: skip
    if not tools:
        raise ConfigError(f"{what}: the environment class has no public method to offer as a tool")
    for tool in tools:
        try:
            get_json_schema(tool)
        except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
            raise ConfigError(f"{what}: tool {tool.__name__}: {e}") from None
    return instance


def load_factory(spec: str, params: dict) -> Callable:
    """``--env_factory module:Class`` (or ``module:function`` returning an instance) with ``--env_params`` as its
    keyword arguments; a class with a ``factory`` classmethod (the builtin tool environments) is built through it."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"--env_factory {spec!r}: expected module:Class")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--env_factory {spec!r}: {e}") from None
    if inspect.isclass(obj) and hasattr(obj, "factory"):
        return obj.factory(**params)
    try:
        inspect.signature(obj).bind(**params)
    except TypeError as e:
        raise ConfigError(f"--env_factory {spec!r}: bad --env_params {sorted(params)} ({e})") from None
    return functools.partial(obj, **params)


TOOL_ENVIRONMENTS = {"search_tools": "environments.search_tools:SearchTools", "ml_task": "environments.ml_task:MLTask"}
"""The registered tool environments (``--env NAME``): classes with a ``factory(**params)`` classmethod, a
``dataset(n_rows, heldout=False)`` classmethod (their levels; held-out ones from ``environments.base.HELDOUT_LEVELS``)
and a ``max_turns_default``, as ``--env_factory`` takes a user's class."""


def prepare_tool_tokenizer(tok) -> str | None:
    """Make ``tok`` parse tool calls as TRL's trainer does (``add_response_schema`` when it has no response
    template or schema) and return the chat template to render with: TRL's training template when the tokenizer's
    is not prefix-preserving, else None (its own). ValueError when its template cannot render a tool conversation."""
    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        is_chat_template_prefix_preserving,  # fmt: skip
        supports_tool_calling,
    )

    if not supports_tool_calling(tok):
        raise ValueError("the tokenizer's chat template cannot render a tool-calling conversation (user -> assistant "
                         "with tool_calls -> tool): tool environments need a model whose template can")
    if getattr(tok, "response_template", None) is None and getattr(tok, "response_schema", None) is None:
        add_response_schema(tok)
    return None if is_chat_template_prefix_preserving(tok) else get_training_chat_template(tok)


def _call(tools: dict[str, Callable], call: dict) -> tuple[str, object, bool]:
    """Run one parsed tool call as TRL's tool loop does: (name, result, failed); a failure's result is
    ``{"error": message}``."""
    if call.get("type", "function") != "function":
        return call.get("name", "unknown"), {"error": f"Unsupported tool call type: {call['type']}"}, True
    function = call.get("function", call)
    name = function["name"]
    try:
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        result = tools[name](**function["arguments"])
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
        return name, result, False
    except Exception as e:  # a tool's own error is the agent's to read (TRL's tool loop)
        return name, {"error": str(e)}, True


class ToolEpisode:
    """One episode of a tool environment in `trl_ext.env.episodes.play` (module docstring). ``parallel``: the loop
    runs the episodes' tool calls (``step``) in threads, so that a batch's sandboxed runs overlap."""

    parallel = True

    def __init__(self, instance, row: dict, limit: int, tok, chat_template: str | None, name: str) -> None:
        self.instance, self.tok, self.limit, self.chat_template = instance, tok, limit, chat_template
        self.tools = tool_methods(instance)
        self._by_name = {t.__name__: t for t in self.tools}
        observation = instance.reset(**{k: v for k, v in row.items() if k not in CONTROL_COLUMNS})
        prompt = list(row["prompt"])
        if observation is not None:  # TRL: appended to the last message's content
            prompt[-1] = {**prompt[-1], "content": prompt[-1]["content"] + observation}
        self.messages = prompt
        self.render_kwargs = {"tools": self.tools, "chat_template": chat_template}  # the teacher renders it so too
        self.prompt_ids = list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False, **self.render_kwargs))
        self.trajectory = Trajectory(int(row.get("env_seed", row.get("level", 0)) or 0), observation or "", env=name)
        self.over, self._message, self._results = False, {}, []

    def parse(self, ids: list[int], context: list[int]) -> list[int]:
        from trl.chat_template_utils import parse_response

        self._message = parse_response(self.tok, ids, prefix=context, tools=self.tools) if ids else {"content": ""}
        return ids

    def step(self) -> None:
        calls = self._message.get("tool_calls") or []
        self._results = [_call(self._by_name, c) for c in calls]
        named = [c.get("function", c) for c in calls]
        agent = " ".join(p for p in (self._message.get("content") or "", *(
            f"call {f['name']}({json.dumps(f.get('arguments', {}))})" for f in named)) if p)  # fmt: skip
        shown = "\n".join(str(result) for _, result, _ in self._results)
        info = {"valid": not any(failed for *_, failed in self._results), "tool_calls": [
            {"name": f["name"], "arguments": f.get("arguments", {})} for f in named],
                "action": named[0]["name"] if named else "", "penalty": 0.0, "shown_reward": 0.0}  # fmt: skip
        self.trajectory.turns.append(Turn(agent, shown, 0.0, info["valid"], info))
        self.over = not calls or len(self.trajectory.turns) >= self.limit
        if self.over:
            self._finish()

    def _finish(self) -> None:
        t, inst = self.trajectory, self.instance
        t.done = not t.turns[-1].info["tool_calls"]
        t.truncated = not t.done
        t.turns[-1].reward = float(inst.get_reward())  # the episode's return (module docstring)
        t.final = dict(inst.episode_info) if hasattr(type(inst), "episode_info") else {}
        if hasattr(type(inst), "success"):
            t.turns[-1].info["success"] = bool(inst.success)
        if callable(getattr(inst, "_close", None)):
            inst._close()  # its resources (a workspace) go; what detectors read is in the trajectory

    def stop(self) -> None:
        """End the episode before its next turn (its context would reach the model's length): the episode's return,
        report and cleanup as at any end."""
        if not self.over:
            self.over = True
            self._finish()

    def reply(self, ids: list[int]) -> list[int]:
        if self.over:
            return []
        messages = [{"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
                    for name, result, _ in self._results]  # fmt: skip
        eos = self.tok.eos_token_id  # TRL's suffix follows the turn's end-of-turn token: a sampler that cut it
        return ([] if ids and ids[-1] == eos else [eos]) + tool_suffix_ids(self.tok, messages, self.chat_template)

    def closing(self, completion: list[int]) -> list[int]:
        return []  # the agent's last turn ends with its own end-of-turn token (trained, as in TRL's tool loop)


def tool_episodes(rows: list[dict], factory: Callable, limit: int, tok, name: str) -> list[ToolEpisode]:
    """One `ToolEpisode` per row, each with a fresh instance of ``factory``."""
    chat_template = prepare_tool_tokenizer(tok)
    return [ToolEpisode(factory(), row, limit, tok, chat_template, name) for row in rows]
