"""Environment training (RAGEN, early 2025): env prompts, env rewards, multi-turn rollouts, estimators.

- Prompts: one dataset row per level seed; the observation of ``env.reset(seed)`` as plain text
  (``observation + "\\n" + prefill``, what ``Trajectory.history_text`` gives) for models without a chat
  template, or system instructions + observation as chat messages for instruct models (the prefill,
  RAGEN's ``<think>``, then follows the generation prompt). Every later prompt ends with it too.
- Rollouts go through TRL's ``rollout_func`` hook, single- and multi-turn alike: per turn the policy
  generates with the trainer's own generation path; the sampled tokens are cut right after the first
  ``</answer>`` (RAGEN's response post-processing); ``--no_think_rl`` replaces them by
  ``<answer>X</answer>``, X the canonical action or ``none`` (RAGEN's ``no_think_rl``); the environment's
  reply is appended
  as the next turn, up to ``--max_turns`` turns. The completion is agent and environment tokens in order;
  ``env_mask`` (TRL's tool mask: 1 = trained, 0 = not) excludes the environment tokens (and the
  prefills) from the loss. RAGEN (its default ``state_masking: false``) trained on them: the policy
  gradient then also pushes up the likelihood of observations the policy does not choose. Chat models: the
  environment's tokens are the template's rendering between the agent's content and the next generation prompt
  (`chat_env_text`), less a leading end-of-turn token (EOS) that the agent's turn already ends with.
  A finished trajectory is closed with an EOS that is not trained on.
- Reward: the sum of the episode's step rewards (invalid answers earn the environment's penalty).
- ``--adv_estimator grpo|brpo|arpo`` replaces TRL's advantage with ``trl_ext.advantages``.
- Mixtures (``--env frozenlake:3,arithmetic``, `trl_ext.env.mixture`): every row names its environment (column
  ``env``, as TRL's dict ``environment_factory`` reads ``environment``); the loop builds each row's environment and
  ends each episode at that environment's turn limit; metrics are also logged per environment (`log_episodes`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from datasets import Dataset, concatenate_datasets

from environments.base import SEPARATOR, Trajectory, feedback_text, no_think_rewrite
from trl_ext.compat import trl_metrics
from trl_ext.env.args import TRAIN_LEVELS
from trl_ext.env.mixture import mixture_counts, mixture_order

_CLOSE_ANSWER = re.compile(r"<\s*/\s*answer\s*>", re.IGNORECASE)


def uses_chat(tokenizer) -> bool:
    """Instruct models (a chat template) get chat prompts; plain models (the builtin ones) plain text."""
    return getattr(tokenizer, "chat_template", None) is not None


def env_prompt(env, observation: str, tokenizer):
    if uses_chat(tokenizer):
        return [{"role": "system", "content": env.instructions}, {"role": "user", "content": observation}]
    return observation + SEPARATOR + env.prefill


def env_dataset(env, n: int, tokenizer, start: int = TRAIN_LEVELS) -> Dataset:
    """``n`` rows (``prompt``, ``env_seed``, ``env``: the environment's name) for ``env``'s levels seeded
    ``start .. start + n - 1``."""
    seeds = list(range(start, start + n))
    prompts = [env_prompt(env, env.reset(s), tokenizer) for s in seeds]
    return Dataset.from_dict({"prompt": prompts, "env_seed": seeds, "env": [env.name] * n})


def mixture_dataset(args, n: int, tokenizer, start: int = TRAIN_LEVELS) -> Dataset:
    """``n`` rows of ``--env``'s environments (``args``: EnvArgs): environment i's `env_dataset` of
    ``mixture_counts`` rows (its levels from ``start``), interleaved in ``mixture_order`` (`trl_ext.env.mixture`);
    one environment: its `env_dataset`."""
    comps = args.env_mixture
    counts = mixture_counts([c.weight for c in comps], n)
    parts = [env_dataset(args.build_env(c.name), k, tokenizer, start) for c, k in zip(comps, counts, strict=True)]
    if len(parts) == 1:
        return parts[0]
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    taken = [0] * len(counts)
    index = []
    for i in mixture_order(counts):
        index.append(offsets[i] + taken[i])
        taken[i] += 1
    return concatenate_datasets(parts).select(index)


def env_reward(completions, env_return, **kwargs) -> list[float]:
    """TRL reward function: the episode return computed during the rollout (sum of step rewards)."""
    return [float(r) for r in env_return]


def named_env_reward(name: str) -> Callable:
    """`env_reward` under the name ``name`` (a tool environment's class: TRL names its ``get_reward`` column so)."""

    def reward(completions, env_return, **kwargs) -> list[float]:
        return env_reward(completions, env_return)

    reward.__name__ = reward.__qualname__ = name
    return reward


def cut_after_answer(ids: list[int], tokenizer) -> tuple[list[int], bool]:
    """The shortest prefix of ``ids`` whose decoding holds a closing answer tag, and whether one was found."""
    def closed(k: int) -> bool:
        return _CLOSE_ANSWER.search(tokenizer.decode(ids[:k], skip_special_tokens=True)) is not None

    if not closed(len(ids)):
        return ids, False
    lo, hi = 1, len(ids)  # a prefix that holds the tag keeps it when extended: bisect for the shortest one
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if closed(mid) else (mid + 1, hi)
    return ids[:lo], True


def answer_stop_sequences(tokenizer) -> tuple[tuple[int, ...], ...]:
    """Token sequences of the closing answer tag (with and without a leading space): the fast sampler stops a turn
    there, since everything after it is cut off (`cut_after_answer`, which stays the rule for any other spelling)."""
    seqs = {tuple(_encode(tokenizer, text)) for text in ("</answer>", " </answer>")}
    return tuple(sorted(seq for seq in seqs if seq))


_SPLIT_DIGITS = re.compile(r"(?<=\d) (?=\d)")


def decode_agent(tokenizer, ids: list[int]) -> str:
    """The agent's text for ``ids``; digit runs a decoder spaced out ("4 2") are joined ("42") when the
    joined text encodes to the same tokens (WordPiece with single-digit pre-tokens: the builtin models)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    joined = _SPLIT_DIGITS.sub("", text)
    if joined != text and _encode(tokenizer, joined) == _encode(tokenizer, text):
        return joined
    return text


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_env_text(tokenizer, messages: list[dict], agent: str, env_reply: str) -> str:
    """The rendered text between an agent turn's content and the next generation start (chat models)."""
    head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    turns = messages + [{"role": "assistant", "content": agent}, {"role": "user", "content": env_reply}]
    full = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    if not full.startswith(head + agent):
        raise ValueError("the chat template does not render the agent's turn verbatim after the prompt; "
                         "multi-turn token bookkeeping needs it to")  # fmt: skip
    return full[len(head) + len(agent) :]


TurnSampler = Callable[[list[list[int]]], tuple[list[list[int]], list[list[float]] | None, list[list[int]] | None]]
"""One turn of generation: token ids of each context -> (sampled ids, behaviour log-probs, policy versions), the last
two None when the sampler records none (TRL's own generation)."""


class TextEpisode:
    """One episode of a text environment (RAGEN's answer format) in `play`: each turn the agent's text up to its first
    closing answer tag is the action (``--no_think_rl``: rewritten to ``<answer>X</answer>``), the environment's reply
    (`feedback_text`) is rendered as the next turn, and a closed episode ends with an EOS that is not trained on.
    The three turn phases are `play`'s: ``parse`` and ``reply`` use the tokenizer, ``step`` only the environment."""

    def __init__(self, env, seed: int, prompt, limit: int, tok, no_think: bool = False) -> None:
        self.env, self.tok, self.limit, self.no_think, self.prompt = env, tok, limit, no_think, prompt
        self.trajectory = Trajectory(seed, env.reset(seed), prefill=env.prefill, env=env.name)
        self.chat = not isinstance(prompt, str)
        self.messages = list(prompt) if self.chat else None
        text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) + env.prefill \
            if self.chat else prompt
        self.prompt_ids = _encode(tok, text)
        self.closed, self.over, self._text = False, False, ""

    def parse(self, ids: list[int], context: list[int]) -> list[int]:
        ids, self.closed = cut_after_answer(list(ids), self.tok)
        self._text = decode_agent(self.tok, ids)
        if self.no_think:
            self._text = no_think_rewrite(self._text, self.env)
            ids, self.closed = _encode(self.tok, self._text), True
        return ids

    def step(self) -> None:
        self._result = self.env.step(self._text)
        self.trajectory.add(self._text, self._result)
        self.over = self.trajectory.done or len(self.trajectory.turns) >= self.limit

    def reply(self, ids: list[int]) -> list[int]:
        if self.over:
            return []
        tok, text, reply, prefill = self.tok, self._text, feedback_text(self._result), self.env.prefill
        if self.chat:
            env_text = chat_env_text(tok, self.messages, prefill + text, reply) + prefill
            self.messages += [{"role": "assistant", "content": prefill + text}, {"role": "user", "content": reply}]
        else:
            env_text = SEPARATOR + reply + SEPARATOR + prefill
        env_ids = _encode(tok, env_text)
        if self.chat and ids and env_ids[:1] == ids[-1:] and ids[-1] in tok.all_special_ids:
            env_ids = env_ids[1:]  # the agent sampled the template's end-of-turn token (EOS) itself
        return env_ids

    def stop(self) -> None:
        """End the episode before its next turn (`play`'s context limit)."""
        self.over = self.trajectory.truncated = True

    def closing(self, completion: list[int]) -> list[int]:
        eos = self.tok.eos_token_id
        return [eos] if self.closed and (not completion or completion[-1] != eos) else []


def text_episodes(prompts: list, seeds: list[int], args, tok, names: list[str] | None = None) -> list[TextEpisode]:
    """`TextEpisode` s for the levels ``seeds`` of the environments ``names`` (a mixture's rows name theirs; None:
    ``args.build_env()``, one environment), each ending at its environment's turn limit (``args.env_turns``)."""
    envs = [args.build_env() for _ in seeds] if names is None else [args.build_env(name) for name in names]
    limits = [args.turns] * len(seeds) if names is None else [args.env_turns(name) for name in names]
    return [TextEpisode(e, s, p, k, tok, args.no_think_rl) for e, s, p, k in zip(envs, seeds, prompts, limits,
                                                                                 strict=True)]  # fmt: skip


def play_episodes(prompts: list, seeds: list[int], args, tok, generate: TurnSampler, names: list[str] | None = None,
                  lockstep: Callable[[bool], bool] | None = None) -> dict:  # fmt: skip
    """`play` of the `text_episodes` of ``prompts`` on the levels ``seeds``."""
    return play(text_episodes(prompts, seeds, args, tok, names), generate, lockstep)


def play(episodes: list, generate: TurnSampler, lockstep: Callable[[bool], bool] | None = None,
         max_context: int | None = None) -> dict:  # fmt: skip
    """The multi-turn loop of text and tool episodes (`TextEpisode`, `trl_ext.env.tools.ToolEpisode`), shared by the
    synchronous path (TRL's generation, ``env_rollout``) and the asynchronous generator (``offpolicy``), which passes
    a sampler that records behaviour log-probs and policy versions. Each turn the active episodes' contexts are sampled
    together; each episode keeps its agent tokens (``parse``), acts (``step``: the environments step in parallel
    threads, so that sandboxed tool runs of a batch overlap) and renders the environment's reply (``reply``).
    Environment tokens get log-prob 0, the version of the turn before them and ``env_mask`` 0 (never trained on, never
    in a ratio or an IS mask); per-token versions therefore hold across turns: an update landing between two turns
    shows in the versions of the later turn's tokens. An episode ends when its environment says so or at its turn
    limit; with ``max_context`` also when its next context would reach it (the reply is dropped, the trajectory
    marked truncated).

    ``lockstep`` (several FSDP2 processes, where each generation is a collective): called after every turn with
    whether this process still plays, it answers whether any process does; a process whose episodes all ended then
    makes idle generation calls (on its first prompt, discarded) until none plays, so that every process makes the
    same calls.

    Returns ``prompt_ids``, ``completion_ids``, ``env_mask``, ``env_return``, ``logprobs`` and ``versions`` (None
    without a recording sampler) and ``trajectories``."""
    n = len(episodes)
    prompt_ids = [e.prompt_ids for e in episodes]
    completion, mask, logprobs, versions = ([[] for _ in range(n)] for _ in range(4))
    recorded = None
    active = list(range(n))
    pool = ThreadPoolExecutor(max_workers=min(n, 16)) if any(getattr(e, "parallel", False) for e in episodes) else None
    try:
        while True:  # until no episode plays: each ends at its turn limit
            generated, lps, vers = generate([prompt_ids[i] + completion[i] for i in active] or [prompt_ids[0]])
            if not active:  # lockstep: an idle call while another process plays (docstring)
                generated = []
            recorded = lps is not None if recorded is None else recorded
            kept = [episodes[i].parse(list(ids), prompt_ids[i] + completion[i])
                    for i, ids in zip(active, generated, strict=True)]  # fmt: skip
            if pool is not None:  # tool calls (sandboxed runs) of the batch's episodes overlap
                list(pool.map(lambda i: episodes[i].step(), active))
            else:
                for i in active:
                    episodes[i].step()
            for j, (i, ids) in enumerate(zip(active, kept, strict=True)):
                completion[i] += ids
                mask[i] += [1] * len(ids)
                if recorded:
                    logprobs[i] += list(lps[j][: len(ids)])
                    versions[i] += list(vers[j][: len(ids)])
                env_ids = episodes[i].reply(ids)
                if env_ids and max_context is not None and len(prompt_ids[i]) + len(completion[i]) + len(env_ids) \
                        >= max_context:  # fmt: skip
                    env_ids = []
                    episodes[i].stop()
                _append_env(i, env_ids, completion, mask, logprobs, versions)
            active = [i for i in active if not episodes[i].over]
            if not (active if lockstep is None else lockstep(bool(active))):
                break
    finally:
        if pool is not None:
            pool.shutdown()
    for i, e in enumerate(episodes):
        _append_env(i, e.closing(completion[i]), completion, mask, logprobs, versions)  # not trained on
    return {
        "prompt_ids": prompt_ids, "completion_ids": completion, "env_mask": mask,
        "env_return": [e.trajectory.total_reward for e in episodes], "logprobs": logprobs if recorded else None,
        "versions": versions if recorded else None, "trajectories": [e.trajectory for e in episodes],
    }  # fmt: skip


def _append_env(i: int, env_ids: list[int], completion, mask, logprobs, versions) -> None:
    """Environment tokens: env_mask 0, log-prob 0, the version of the token before them."""
    completion[i] += env_ids
    mask[i] += [0] * len(env_ids)
    logprobs[i] += [0.0] * len(env_ids)
    versions[i] += [versions[i][-1] if versions[i] else 0] * len(env_ids)


def episode_columns(rows: list[dict]) -> dict[str, list]:
    """Saved-rollout columns (`trl_ext.runs.rollouts`) of a batch's rows: ``env`` and ``env_seed`` (null where a
    tool environment's rows have none)."""
    return {"env": [r.get("env") for r in rows], "env_seed": [r.get("env_seed") for r in rows]}


def row_envs(rows: list[dict]) -> list[str] | None:
    """Each row's environment (the dataset's ``env`` column), None for rows without one (one environment)."""
    return [r["env"] for r in rows] if rows and "env" in rows[0] else None


def log_words(args) -> tuple[tuple[str, ...] | None, dict[str, tuple[str, ...]] | None]:
    """`log_episodes`'s ``words`` and ``mixture`` for ``args`` (EnvArgs)."""
    names = args.env_names
    if len(names) == 1:
        return args.build_env().action_words, None
    return None, {name: args.build_env(name).action_words for name in names}


@dataclass(frozen=True)
class EpisodeSummary:
    """What the episode metrics read of a trajectory (small enough to gather from every process)."""

    env: str
    success: bool
    n_invalid: int
    n_turns: int
    total_reward: float
    first_action: str
    tool_calls: int = 0
    final: tuple = ()
    """The numbers of ``Trajectory.final`` as (key, value) pairs (a tool environment's; bools as 0 / 1)."""

    @classmethod
    def of(cls, t: Trajectory) -> EpisodeSummary:
        # an action with an argument (search's "read: title") counts under its verb, the step's info["action_kind"]
        first = t.turns[0].info.get("action_kind", t.turns[0].info.get("action", "")) if t.turns else ""
        calls = sum(len(turn.info.get("tool_calls", ())) for turn in t.turns)
        final = tuple((k, float(v)) for k, v in t.final.items() if isinstance(v, (int, float)))  # None: no score
        return cls(t.env, bool(t.success), t.n_invalid, len(t.turns), float(t.total_reward), first, calls, final)


def log_episodes(trainer, trajs: list[Trajectory], words: tuple[str, ...] | None,
                 mixture: dict[str, tuple[str, ...]] | None = None) -> None:  # fmt: skip
    """Episode metrics: ``env/success``, ``env/invalid_frac``, ``env/turns`` over the batch and, with the action
    ``words`` of one environment, ``env/first_action/<word>``. A ``mixture`` ({name: action words}) adds per
    environment ``env/<name>/share`` (its fraction of the batch's episodes, 0 when absent) and, when the batch has
    episodes of it, ``env/<name>/{return,success,invalid_frac,turns,first_action/<word>}`` (a step without it logs
    none of these, so TRL's mean over a logging window averages the steps that had it). On several processes the
    batch is every process's episodes (gathered)."""
    metrics = trl_metrics(trainer)  # of the model's mode
    episodes = [EpisodeSummary.of(t) for t in trajs]
    if trainer.accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        episodes = gather_object(episodes)
    _episode_metrics(metrics, "env", episodes, words)
    if any(e.tool_calls for e in episodes) or any(e.final for e in episodes):  # a tool environment
        metrics["env/tool_calls"].append(sum(e.tool_calls for e in episodes) / len(episodes))
        for key, value in final_means(episodes, "env").items():
            metrics[key].append(value)
    for name, env_words in (mixture or {}).items():
        mine = [e for e in episodes if e.env == name]
        metrics[f"env/{name}/share"].append(len(mine) / len(episodes))  # every step: the shares sum to 1
        if mine:
            metrics[f"env/{name}/return"].append(sum(e.total_reward for e in mine) / len(mine))
            _episode_metrics(metrics, f"env/{name}", mine, env_words)


def final_means(episodes: list, prefix: str) -> dict[str, float]:
    """The mean of each number tool environments report at the end (``Trajectory.final``, or an `EpisodeSummary`'s
    ``final``: the ML task's ``true_score``, the held-out score beside the proxy reward) over the episodes that report
    it (bools count as 0 / 1; None, no score, is left out)."""
    values: dict[str, list[float]] = {}
    for e in episodes:
        pairs = e.final.items() if isinstance(e.final, dict) else e.final
        for key, v in pairs:
            if isinstance(v, (int, float)):
                values.setdefault(key, []).append(float(v))
    return {f"{prefix}/{k}": sum(v) / len(v) for k, v in values.items()}


def _episode_metrics(metrics, prefix: str, episodes: list[EpisodeSummary], words: tuple[str, ...] | None) -> None:
    n = len(episodes)
    metrics[f"{prefix}/success"].append(sum(e.success for e in episodes) / n)
    metrics[f"{prefix}/invalid_frac"].append(sum(e.n_invalid for e in episodes) / sum(e.n_turns for e in episodes))
    metrics[f"{prefix}/turns"].append(sum(e.n_turns for e in episodes) / n)
    if words is not None and all(len(w) > 1 for w in words):  # action words (not arithmetic's characters)
        first = [e.first_action for e in episodes]
        for w in words:
            metrics[f"{prefix}/first_action/{w}"].append(first.count(w) / n)
