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
"""

from __future__ import annotations

import re
from collections.abc import Callable

from datasets import Dataset

from environments.base import SEPARATOR, Trajectory, feedback_text, no_think_rewrite
from trl_ext.env.args import TRAIN_LEVELS

_CLOSE_ANSWER = re.compile(r"<\s*/\s*answer\s*>", re.IGNORECASE)


def uses_chat(tokenizer) -> bool:
    """Instruct models (a chat template) get chat prompts; plain models (the builtin ones) plain text."""
    return getattr(tokenizer, "chat_template", None) is not None


def env_prompt(env, observation: str, tokenizer):
    if uses_chat(tokenizer):
        return [{"role": "system", "content": env.instructions}, {"role": "user", "content": observation}]
    return observation + SEPARATOR + env.prefill


def env_dataset(env, n: int, tokenizer, start: int = TRAIN_LEVELS) -> Dataset:
    """``n`` rows (``prompt``, ``env_seed``) for ``env``'s levels seeded ``start .. start + n - 1``."""
    seeds = list(range(start, start + n))
    return Dataset.from_dict({"prompt": [env_prompt(env, env.reset(s), tokenizer) for s in seeds], "env_seed": seeds})


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


def play_episodes(prompts: list, seeds: list[int], args, tok, generate: TurnSampler) -> dict:
    """One episode per prompt on the levels ``seeds``: the multi-turn loop shared by the synchronous path (TRL's
    generation, ``env_rollout``) and the asynchronous generator (``offpolicy``), which passes a sampler that records
    behaviour log-probs and policy versions. Environment tokens get log-prob 0, the version of the turn before them
    and ``env_mask`` 0 (never trained on, never in a ratio or an IS mask).

    Returns ``prompt_ids``, ``completion_ids``, ``env_mask``, ``env_return``, ``logprobs`` and ``versions`` (None
    without a recording sampler) and ``trajectories``."""
    envs = [args.build_env() for _ in seeds]
    trajs = [Trajectory(s, e.reset(s), prefill=e.prefill) for e, s in zip(envs, seeds, strict=True)]
    prefill = envs[0].prefill
    chat = not isinstance(prompts[0], str)
    msgs = [list(p) for p in prompts] if chat else None
    prompt_ids = [
        _encode(tok, tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) + prefill if chat else p)
        for p in prompts
    ]
    n = len(prompts)
    completion, mask, logprobs, versions = ([[] for _ in range(n)] for _ in range(4))
    recorded = None
    closed = [False] * n
    active = list(range(n))
    for turn in range(args.turns):
        generated, lps, vers = generate([prompt_ids[i] + completion[i] for i in active])
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
            if not result.done and turn + 1 < args.turns:
                reply = feedback_text(result)
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
        active = [i for i in active if not trajs[i].done]
        if not active:
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


def log_episodes(trainer, trajs: list[Trajectory], words: tuple[str, ...]) -> None:
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    n = len(trajs)
    metrics["env/success"].append(sum(t.success for t in trajs) / n)
    metrics["env/invalid_frac"].append(sum(t.n_invalid for t in trajs) / sum(len(t.turns) for t in trajs))
    metrics["env/turns"].append(sum(len(t.turns) for t in trajs) / n)
    if all(len(w) > 1 for w in words):  # action words (not arithmetic's characters): first-move frequencies
        # an action with an argument (search's "read: title") counts under its verb, the step's info["action_kind"]
        first = [t.turns[0].info.get("action_kind", t.turns[0].info["action"]) for t in trajs]
        for w in words:
            metrics[f"env/first_action/{w}"].append(first.count(w) / n)
