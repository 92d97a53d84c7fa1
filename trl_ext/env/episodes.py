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

import itertools
import re
from collections.abc import Callable
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


def play_episodes(prompts: list, seeds: list[int], args, tok, generate: TurnSampler, names: list[str] | None = None,
                  lockstep: Callable[[bool], bool] | None = None) -> dict:  # fmt: skip
    """One episode per prompt on the levels ``seeds`` of the environments ``names`` (a mixture's rows name theirs;
    None: ``args.build_env()``, one environment): the multi-turn loop shared by the synchronous path (TRL's
    generation, ``env_rollout``) and the asynchronous generator (``offpolicy``), which passes a sampler that records
    behaviour log-probs and policy versions. Environment tokens get log-prob 0, the version of the turn before them
    and ``env_mask`` 0 (never trained on, never in a ratio or an IS mask). Each episode ends at its environment's turn
    limit (``args.env_turns``; ``args.turns`` without names), single- and multi-turn environments in one batch.

    ``lockstep`` (several FSDP2 processes, where each generation is a collective): called after every turn with
    whether this process still plays, it answers whether any process does; a process whose episodes all ended then
    makes idle generation calls (on its first prompt, discarded) until none plays, so that every process makes the
    same calls.

    Returns ``prompt_ids``, ``completion_ids``, ``env_mask``, ``env_return``, ``logprobs`` and ``versions`` (None
    without a recording sampler) and ``trajectories``."""
    envs = [args.build_env() for _ in seeds] if names is None else [args.build_env(name) for name in names]
    limits = [args.turns] * len(seeds) if names is None else [args.env_turns(name) for name in names]
    trajs = [Trajectory(s, e.reset(s), prefill=e.prefill, env=e.name) for e, s in zip(envs, seeds, strict=True)]
    chat = not isinstance(prompts[0], str)
    msgs = [list(p) for p in prompts] if chat else None
    prompt_ids = [
        _encode(tok, tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) + e.prefill if chat else p)
        for p, e in zip(prompts, envs, strict=True)
    ]
    n = len(prompts)
    completion, mask, logprobs, versions = ([[] for _ in range(n)] for _ in range(4))
    recorded = None
    closed = [False] * n
    active = list(range(n))
    for turn in itertools.count():  # until no episode plays: each ends at its turn limit
        generated, lps, vers = generate([prompt_ids[i] + completion[i] for i in active] or [prompt_ids[0]])
        if not active:  # lockstep: an idle call while another process plays (docstring)
            generated = []
        recorded = lps is not None if recorded is None else recorded
        for j, (i, ids) in enumerate(zip(active, generated, strict=True)):
            ids, closed[i] = cut_after_answer(list(ids), tok)
            text = decode_agent(tok, ids)
            if args.no_think_rl:
                text = no_think_rewrite(text, envs[i])
                ids, closed[i] = _encode(tok, text), True
            result = envs[i].step(text)
            trajs[i].add(text, result)
            completion[i] += ids
            mask[i] += [1] * len(ids)
            if recorded:
                logprobs[i] += list(lps[j][: len(ids)])
                versions[i] += list(vers[j][: len(ids)])
            if not result.done and turn + 1 < limits[i]:
                reply, prefill = feedback_text(result), envs[i].prefill
                if chat:
                    env_text = chat_env_text(tok, msgs[i], prefill + text, reply) + prefill
                    msgs[i] += [{"role": "assistant", "content": prefill + text}, {"role": "user", "content": reply}]
                else:
                    env_text = SEPARATOR + reply + SEPARATOR + prefill
                env_ids = _encode(tok, env_text)
                if chat and ids and env_ids[:1] == ids[-1:] and ids[-1] in tok.all_special_ids:
                    env_ids = env_ids[1:]  # the agent sampled the template's end-of-turn token (EOS) itself
                completion[i] += env_ids
                mask[i] += [0] * len(env_ids)
                logprobs[i] += [0.0] * len(env_ids)
                versions[i] += [versions[i][-1] if versions[i] else 0] * len(env_ids)
        active = [i for i in active if not trajs[i].done and turn + 1 < limits[i]]
        if not (active if lockstep is None else lockstep(bool(active))):
            break
    eos = tok.eos_token_id
    for i in range(n):
        if closed[i] and (not completion[i] or completion[i][-1] != eos):
            completion[i].append(eos)  # close the episode; not trained on
            mask[i].append(0)
            logprobs[i].append(0.0)
            versions[i].append(versions[i][-1] if versions[i] else 0)
    return {
        "prompt_ids": prompt_ids, "completion_ids": completion, "env_mask": mask,
        "env_return": [t.total_reward for t in trajs], "logprobs": logprobs if recorded else None,
        "versions": versions if recorded else None, "trajectories": trajs,
    }  # fmt: skip


def episode_columns(rows: list[dict]) -> dict[str, list]:
    """Saved-rollout columns (`trl_ext.runs.rollouts`) of a batch's rows: ``env`` and ``env_seed``."""
    return {"env": [r.get("env") for r in rows], "env_seed": [r["env_seed"] for r in rows]}


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

    @classmethod
    def of(cls, t: Trajectory) -> EpisodeSummary:
        # an action with an argument (search's "read: title") counts under its verb, the step's info["action_kind"]
        first = t.turns[0].info.get("action_kind", t.turns[0].info.get("action", "")) if t.turns else ""
        return cls(t.env, bool(t.success), t.n_invalid, len(t.turns), float(t.total_reward), first)


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
    for name, env_words in (mixture or {}).items():
        mine = [e for e in episodes if e.env == name]
        metrics[f"env/{name}/share"].append(len(mine) / len(episodes))  # every step: the shares sum to 1
        if mine:
            metrics[f"env/{name}/return"].append(sum(e.total_reward for e in mine) / len(mine))
            _episode_metrics(metrics, f"env/{name}", mine, env_words)


def _episode_metrics(metrics, prefix: str, episodes: list[EpisodeSummary], words: tuple[str, ...] | None) -> None:
    n = len(episodes)
    metrics[f"{prefix}/success"].append(sum(e.success for e in episodes) / n)
    metrics[f"{prefix}/invalid_frac"].append(sum(e.n_invalid for e in episodes) / sum(e.n_turns for e in episodes))
    metrics[f"{prefix}/turns"].append(sum(e.n_turns for e in episodes) / n)
    if words is not None and all(len(w) > 1 for w in words):  # action words (not arithmetic's characters)
        first = [e.first_action for e in episodes]
        for w in words:
            metrics[f"{prefix}/first_action/{w}"].append(first.count(w) / n)
