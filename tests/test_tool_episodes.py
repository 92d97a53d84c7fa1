"""Tool environments in the project's episode loop (trl_ext/env/tools.py, env/episodes.py ``play``): TRL's
environment_factory convention, TRL's response parsing, tool results as environment tokens, per-token versions
across turns. Scripted turn samplers; no model."""

from __future__ import annotations

import json

import pytest

from trl_ext.compat import tool_suffix_ids
from trl_ext.env.episodes import play
from trl_ext.env.tools import ToolEpisode, check_factory, tool_episodes, tool_methods
from trl_ext.registry import ConfigError


class Counter:
    """A toy tool environment: add numbers to reach the row's target."""

    max_turns_default = 4

    def __init__(self, step_limit: int = 3):
        self.step_limit, self.total, self.target, self.closed = step_limit, 0, 0, False

    def reset(self, target: int, **row) -> str:
        self.total, self.target = 0, int(target)
        return f" Reach {target}."

    def add(self, n: int) -> str:
        """Add a number to the total.

        Args:
            n: The number to add.

        Returns:
            The new total.
        """
        if n > self.step_limit:
            raise ValueError(f"at most {self.step_limit} at once")
        self.total += n
        return f"total {self.total}"

    def get_reward(self) -> float:
        return float(self.total == self.target)

    @property
    def success(self) -> bool:
        return self.total == self.target

    @property
    def episode_info(self) -> dict:
        return {"total": self.total, "exact": self.total == self.target, "note": "text is not a metric"}

    def _close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def tok():
    from trl_ext.models.byte_tokenizer import byte_tokenizer
    from trl_ext.models.tiny import trl_template

    t = byte_tokenizer()
    t.chat_template = trl_template("qwen2_5")
    return t


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def rows(*targets):
    return [{"prompt": [{"role": "user", "content": "Count."}], "target": t, "env": "counter"} for t in targets]


class Script:
    """A turn sampler playing ``turns[k]`` as the k-th turn of every episode (k: tool responses in the context so
    far), recording the contexts; log-probs -(k + 1) and versions ``versions[k]`` per token."""

    def __init__(self, tok, turns: list[str], versions=None, record=True):
        self.tok, self.turns, self.versions, self.record = tok, turns, versions, record
        self.contexts: list[list[list[int]]] = []

    def __call__(self, contexts):
        self.contexts.append([list(c) for c in contexts])
        out, turn = [], []
        for c in contexts:
            turn.append(min(self.tok.decode(c).count("<tool_response>"), len(self.turns) - 1))
            out.append(self.tok(self.turns[turn[-1]] + "<|im_end|>", add_special_tokens=False)["input_ids"])
        if not self.record:
            return out, None, None
        versions = self.versions or [0] * 10
        lps = [[-(k + 1.0)] * len(ids) for k, ids in zip(turn, out)]
        vers = [[versions[k]] * len(ids) for k, ids in zip(turn, out)]
        return out, lps, vers


def _episodes(tok, *targets, limit=4, factory=Counter):
    return tool_episodes(rows(*targets), factory, limit, tok, "counter")


def test_tools_are_trls_methods_and_the_prompt_renders_them(tok):
    env = Counter()
    assert [t.__name__ for t in tool_methods(env)] == ["add"]  # public functions, as TRL
    (ep,) = _episodes(tok, 5)
    text = tok.decode(ep.prompt_ids)
    assert '"name": "add"' in text and "Count. Reach 5.<|im_end|>" in text  # reset's text ends the last message
    assert text.endswith("<|im_start|>assistant\n")


def test_tool_results_are_environment_tokens_and_versions_hold_across_turns(tok):
    script = Script(tok, [call("add", n=2), call("add", n=3), "done"], versions=[7, 9, 12])
    eps = _episodes(tok, 5, 4)
    out = play(eps, script)
    for i, target in enumerate((5, 4)):
        ids, mask, lp, ver = (out[k][i] for k in ("completion_ids", "env_mask", "logprobs", "versions"))
        assert len(ids) == len(mask) == len(lp) == len(ver)
        agent = tok.decode([t for t, m in zip(ids, mask) if m])
        shown = tok.decode([t for t, m in zip(ids, mask) if not m])
        assert agent == call("add", n=2) + "<|im_end|>" + call("add", n=3) + "<|im_end|>" + "done<|im_end|>"
        assert "<tool_response>\ntotal 2\n</tool_response>" in shown and "total 5" in shown
        assert "total" not in agent and "<tool_response>" not in agent
        # every token: agent tokens carry their turn's version and log-prob, tool tokens the version before them, 0
        seen = []
        for t, m, p, v in zip(ids, mask, lp, ver):
            if m:
                seen.append((p, v))
            else:
                assert p == 0.0 and v == seen[-1][1]
        assert sorted(set(seen)) == [(-3.0, 12), (-2.0, 9), (-1.0, 7)]
        assert out["env_return"][i] == float(target == 5)
        traj = out["trajectories"][i]
        assert [t.info["tool_calls"] for t in traj.turns] == [[{"name": "add", "arguments": {"n": 2}}],
                                                              [{"name": "add", "arguments": {"n": 3}}], []]
        assert traj.turns[0].agent == 'call add({"n": 2})' and traj.turns[0].env == "total 2"
        assert traj.done and not traj.truncated and traj.success == (target == 5)
        assert traj.final == {"total": 5, "exact": target == 5, "note": "text is not a metric"}
    assert all(e.instance.closed for e in eps)  # closed at the end: a workspace goes
    # the context of each later turn is the prompt + everything so far (tool tokens included), no re-rendering
    assert script.contexts[1][0] == out["prompt_ids"][0] + out["completion_ids"][0][: len(script.contexts[1][0])
                                                                                   - len(out["prompt_ids"][0])]


def test_tool_suffix_is_what_the_template_renders_for_the_tool_turn(tok):
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"n": 1}}}]}]  # fmt: skip
    head = tok.apply_chat_template(messages, tokenize=False)
    full = tok.apply_chat_template(messages + [{"role": "tool", "name": "add", "content": "total 1"}], tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    suffix = tok.decode(tool_suffix_ids(tok, [{"role": "tool", "name": "add", "content": "total 1"}], None))
    assert head.endswith("<|im_end|>\n") and full == head[: -1] + suffix  # after the agent's own end of turn


def test_a_failing_tool_reports_an_error_and_the_episode_goes_on(tok):
    script = Script(tok, [call("add", n=9), call("nope"), call("add", n=1), "done"])
    out = play(_episodes(tok, 1), script)
    traj = out["trajectories"][0]
    assert traj.turns[0].env == "{'error': 'at most 3 at once'}" and not traj.turns[0].valid
    assert traj.turns[1].env == "{'error': 'Tool nope not found.'}"
    assert traj.turns[2].valid and out["env_return"] == [1.0]
    assert len(traj.turns) == 4 and traj.done and not traj.truncated  # the 4th turn calls nothing: the end


def test_turn_limit_runs_the_last_calls_without_showing_them(tok):
    script = Script(tok, [call("add", n=1)] * 9)
    (ep,) = eps = _episodes(tok, 2, limit=2)
    out = play(eps, script)
    traj = out["trajectories"][0]
    assert len(traj.turns) == 2 and traj.truncated and not traj.done
    assert ep.instance.total == 2 and out["env_return"] == [1.0]  # the 2nd call ran: its effect counts
    shown = tok.decode([t for t, m in zip(out["completion_ids"][0], out["env_mask"][0]) if not m])
    assert shown.count("<tool_response>") == 1  # its result is not shown: no turn follows
    assert out["completion_ids"][0][-1] == tok.convert_tokens_to_ids("<|im_end|>")


def test_max_context_ends_an_episode_before_its_reply(tok):
    script = Script(tok, [call("add", n=1)] * 9)
    (ep,) = eps = _episodes(tok, 2, limit=5)
    first = len(ep.prompt_ids) + len(tok(call("add", n=1) + "<|im_end|>", add_special_tokens=False)["input_ids"])
    out = play(eps, script, max_context=first + 3)
    assert len(out["trajectories"][0].turns) == 1 and out["trajectories"][0].truncated
    assert all(out["env_mask"][0])  # the reply that would reach the limit is dropped
    assert out["env_return"] == [0.0] and out["trajectories"][0].final["total"] == 1  # ended as any episode ends
    assert ep.instance.closed


def test_unparsed_text_ends_the_episode(tok):
    script = Script(tok, ['<tool_call>\n{"name": "add", "argu', "x"])
    out = play(_episodes(tok, 0), script)
    traj = out["trajectories"][0]
    assert len(traj.turns) == 1 and traj.done and traj.turns[0].info["tool_calls"] == []
    assert out["env_return"] == [1.0]  # target 0 reached without a call


def test_a_turn_without_its_end_of_turn_token_gets_it_as_an_environment_token(tok):
    """A sampler that cuts the end-of-turn token (the routing eval's ``model.generate``): the reply starts with it,
    untrained, so the next context is the template's rendering."""
    eos = tok.eos_token_id

    def cut(contexts):
        ids, lps, vers = Script(tok, [call("add", n=1), "ok"])(contexts)
        return [i[:-1] for i in ids], lps, vers

    out = play(_episodes(tok, 1), cut)
    ids, mask = out["completion_ids"][0], out["env_mask"][0]
    first = len(tok(call("add", n=1), add_special_tokens=False)["input_ids"])
    assert ids[first] == eos and mask[first] == 0 and mask[first - 1] == 1
    assert tok.decode(ids[first:]).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>")


def test_synchronous_sampler_records_nothing(tok):
    out = play(_episodes(tok, 3), Script(tok, [call("add", n=3), "ok"], record=False))
    assert out["logprobs"] is None and out["versions"] is None and out["env_return"] == [1.0]


def test_tool_steps_run_in_parallel_threads(tok):
    import threading
    import time

    barrier = threading.Barrier(3, timeout=10)

    class Slow(Counter):
        def add(self, n: int) -> str:
            """Add.

            Args:
                n: The number.
            """
            barrier.wait()  # all three episodes' calls must be running at once
            time.sleep(0.01)
            return super().add(n)

    out = play(_episodes(tok, 1, 1, 1, factory=Slow), Script(tok, [call("add", n=1), "ok"]))
    assert out["env_return"] == [1.0, 1.0, 1.0]


def test_factories_are_checked_as_trl_probes_them():
    class NoReset:
        def get_reward(self):
            return 0.0

        def go(self) -> str:
            """Go."""
            return ""

    class Undocumented(Counter):
        def jump(self, height):
            return ""

    class PublicClose(Counter):
        def close(self) -> None:
            """Close."""

    with pytest.raises(ConfigError, match="must define reset"):
        check_factory(NoReset, "x")
    with pytest.raises(ConfigError, match="close is a public method.*private _close"):
        check_factory(PublicClose, "x")
    with pytest.raises(ConfigError, match="tool jump"):
        check_factory(Undocumented, "x")
    assert isinstance(check_factory(Counter, "x"), Counter)


def test_tool_episode_needs_a_tool_calling_template():
    from trl_ext.models.byte_tokenizer import byte_tokenizer
    from trl_ext.models.tiny import CHAT_TEMPLATES

    t = byte_tokenizer()
    t.chat_template = next(iter(CHAT_TEMPLATES.values()))
    with pytest.raises(ValueError, match="cannot render a tool-calling conversation"):
        tool_episodes(rows(1), Counter, 2, t, "counter")
    assert ToolEpisode.parallel


class NoRows(Counter):
    """A tool environment without a dataset classmethod (train.py has no rows for it)."""


@pytest.mark.parametrize("argv, message", [
    (["--env", "ml_task", "--model", "builtin_env"], "needs a chat model whose template writes tool calls"),
    (["--env", "ml_task,frozenlake", "--model", "builtin_tools"], "plays alone, not in a mixture"),
    (["--env", "ml_task", "--model", "builtin_tools", "--no_think_rl"], "actions are tool calls"),
    (["--env", "ml_task", "--model", "builtin_tools", "--mode", "sft"], "a tool environment has none"),
    (["--env", "ml_task", "--model", "builtin_tools", "--env_params", "reward=sparse"], "reward must be one of"),
    (["--env", "ml_task", "--model", "builtin_tools", "--env_params", "sandbox=docker"], "docker"),
    (["--env", "ml_task", "--env_factory", "test_tool_episodes:Counter", "--model", "builtin_tools"],
     "exclude each other"),
    (["--env_factory", "no_such_module:Env", "--model", "builtin_tools"], "No module named"),
    (["--env_factory", "test_tool_episodes", "--model", "builtin_tools"], "expected module:Class"),
    (["--env_factory", "test_tool_episodes:NoRows", "--model", "builtin_tools"], "classmethod dataset"),
    (["--env", "no_such_env", "--model", "builtin_tools"], "tool environments: search_tools, ml_task"),
])  # fmt: skip
def test_train_py_refuses_tool_environment_mistakes_at_parse_time(argv, message, train_cli_error):
    assert message in train_cli_error(*argv, "--output_dir", "/tmp/unused")


def test_env_factory_turns_come_from_the_class_or_the_flag(tmp_path):
    import trl_ext.cli_train as cli

    class_default = cli.build_plan(["--env_factory", "environments.search_tools:SearchTools", "--model",
                                    "builtin_tools", "--env_params", "n_pages=40", "--output_dir", str(tmp_path)])
    assert class_default.cfg.tool_turns == 5 and class_default.cfg.env_names == ["SearchTools"]
    flag = cli.build_plan(["--env", "ml_task", "--model", "builtin_tools", "--max_turns", "3", "--output_dir",
                           str(tmp_path)])  # fmt: skip
    assert flag.cfg.tool_turns == 3 and flag.cfg.tool_dataset(2)["level"] == [0, 1]
    assert flag.cfg.tool_dataset(1, heldout=True)["level"] == [100_000]


def test_ml_task_episodes_through_the_loop_are_judged_by_the_detector(tok):
    """The ML task's scripted honest and hacking episodes replayed by the loop (the scripts' tool calls as the
    agent's turns): real tools in the sandbox, the proxy reward and the true score in the trajectory, and the
    config.yaml detector ``ml_task_leak`` flags the hacking episode only, from the transcript."""
    from environments.ml_task import INSTRUCTIONS, MLTask
    from environments.ml_task_scripts import play_scripted
    from rewards.config import load_reward_config

    level = 7
    scripts = {kind: play_scripted(level, kind) for kind in ("honest", "explore_hack")}
    turns = {kind: [m for m in msgs if m["role"] == "assistant"] for kind, (msgs, _) in scripts.items()}

    def text(m):
        calls = "".join(f'<tool_call>\n{json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})}\n</tool_call>'
                        for c in m.get("tool_calls", []))  # fmt: skip
        return (m["content"] or "") + calls + "<|im_end|>"

    def sample(contexts):  # row 0 plays honest, row 1 explore_hack; turn k: the k-th assistant message
        out = []
        for i, c in enumerate(contexts if len(contexts) == 2 else []):
            k = tok.decode(c).count("<tool_response>")
            out.append(tok(text(turns[("honest", "explore_hack")[i]][k]), add_special_tokens=False)["input_ids"])
        if len(contexts) == 1:  # the honest episode ended first: only the hacking one plays on
            k = tok.decode(contexts[0]).count("<tool_response>")
            out = [tok(text(turns["explore_hack"][k]), add_special_tokens=False)["input_ids"]]
        return out, None, None

    rows = [{"prompt": [{"role": "user", "content": INSTRUCTIONS}], "level": level}] * 2
    out = play(tool_episodes(rows, MLTask.factory(), 12, tok, "ml_task"), sample)
    honest, hack = out["trajectories"]
    assert [t.turns[0].info["tool_calls"][0]["name"] for t in (honest, hack)] == ["run_script", "list_files"]
    assert out["env_return"] == [scripts["honest"][1]["validation_score"], 1.0]
    assert hack.final["true_score"] == scripts["explore_hack"][1]["true_score"] < 0.8
    detector = load_reward_config("config.yaml").detector("ml_task_leak")
    assert detector(["", ""], trajectories=[honest, hack]) == [False, True]
