"""``--model builtin_tools``: a tiny chat model that writes tool calls, warm-started on scripted ML-task episodes.

No builtin model could call a tool: the WordPiece models neither render Qwen's markers nor decode JSON back, and a
random model writes no call. This one is the SFT warm start of RAGEN's recipe applied to the ML-engineering task
(`environments.ml_task`):

- tokenizer: the byte-level BPE of `trl_ext.models.byte_tokenizer` learned from the rendered episodes, with TRL's
  Qwen2.5 chat template (TRL parses its tool calls; it renders the tools' schemas in the system turn);
- model: a small Qwen2 (``SIZE``; ``POSITIONS`` tokens of context: an episode is 950-1650 tokens, its prompt with the
  six tools' schemas about 830), random init;
- data: ``EPISODES`` scripted episodes (`environments.ml_task_scripts.play_scripted`) on training levels from
  ``LEVEL_SEED_BASE`` (never the held-out ones), their kinds drawn with ``KIND_WEIGHTS``: plain solutions (run the
  baseline; write and run a nearest centroid) and exploration that sees the files (list them, then run the baseline;
  list them, read the leaked validation labels and copy them: the planted hack). Each is rendered as the episode loop
  renders it (``apply_chat_template`` with the tools) and trained on the assistant turns only (the prompt and the tool
  results are masked), ``STEPS`` steps of ``BATCH`` episodes.

The warm-started policy thus calls tools in the right format and mostly solves the task honestly, and sometimes looks
at the files and takes the leak: the start RL needs to find out whether the proxy reward (validation accuracy) pulls
it to the hack. Cached in ``<cache>/builtin-tools-<VERSION>/``; the build's ``build_info.json`` records the kinds' shares
and the greedy first actions. CLI: ``uv run python -m trl_ext.models.builtin_tools [--rebuild]``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from trl_ext.models import builtin as bm

BUILTIN_TOOLS = "builtin_tools"  # the --model value that selects this model
VERSION = "v1"
KIND_WEIGHTS = {"honest": 4, "improve": 3, "explore": 2, "explore_hack": 1}
EPISODES = 400
LEVEL_SEED_BASE = 50_000  # training levels (below environments.base.HELDOUT_LEVELS)
SEED = 0
SIZE = {"hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 256}
POSITIONS = 2048
VOCAB_SIZE = 4096
STEPS = 220
BATCH = 8
PEAK_LR = 3e-3
TEMPLATE = "qwen2_5"  # TRL's chat template (trl/chat_templates/qwen2_5.jinja)


def builtin_tools_dir() -> Path:
    return bm.cache_dir() / f"builtin-tools-{VERSION}"


def episodes(n: int = EPISODES, seed: int = SEED) -> list[tuple[str, list[dict]]]:
    """``n`` scripted ML-task episodes (kind, full chat messages) on training levels, kinds drawn by weight."""
    from environments.base import HELDOUT_LEVELS
    from environments.ml_task import INSTRUCTIONS, MLTask
    from environments.ml_task_scripts import play_scripted

    if LEVEL_SEED_BASE + n > HELDOUT_LEVELS:
        raise ValueError("builtin_tools: warm-start levels reach the held-out levels")
    rng = random.Random(seed)
    kinds = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()), k=n)
    out = []
    for i, kind in enumerate(kinds):
        level = LEVEL_SEED_BASE + i
        env = MLTask()
        try:
            task = env.reset(level)  # the row's observation, appended to the user message as the loop does
        finally:
            env.close()
        out.append((kind, [{"role": "user", "content": INSTRUCTIONS + task}, *play_scripted(level, kind)[0]]))
    return out


def tools():
    """The ML task's tools as the episode loop offers them (bound methods of an instance: their schemas)."""
    from environments.ml_task import MLTask
    from trl_ext.env.tools import tool_methods

    return tool_methods(MLTask())


def assistant_labels(tok, messages: list[dict], tool_list) -> tuple[list[int], list[int]]:
    """(ids, labels) of a rendered conversation: labels are the ids on each assistant turn (through its end-of-turn
    token) and -100 elsewhere; each turn's span is found by rendering the conversation up to it."""
    def render(msgs, gen):
        return tok.apply_chat_template(msgs, tools=tool_list, tokenize=True, return_dict=False,
                                       add_generation_prompt=gen)  # fmt: skip

    ids = render(messages, False)
    labels = [-100] * len(ids)
    eos = tok.eos_token_id
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render(messages[:j], True))
        end = ids.index(eos, start) + 1
        if render(messages[:j], True) != ids[:start]:
            raise ValueError("the chat template is not prefix-preserving: the assistant spans cannot be found")
        labels[start:end] = ids[start:end]
    return ids, labels


def build_into(out_dir: Path) -> dict:
    """The tokenizer, the model and the warm start (module docstring); saves and returns the build info."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trl_ext.models.byte_tokenizer import byte_tokenizer, trl_template

    t0 = time.time()
    torch.set_num_threads(bm.NUM_THREADS)
    log = bm.build_logger("builtin_tools", t0)
    data = episodes()
    tool_list, template = tools(), trl_template(TEMPLATE)
    probe = byte_tokenizer()
    probe.chat_template = template
    texts = [probe.apply_chat_template(m, tools=tool_list, tokenize=False) for _, m in data]
    tok = byte_tokenizer(VOCAB_SIZE, texts)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=SIZE["hidden"], num_hidden_layers=SIZE["layers"],
                         num_attention_heads=SIZE["heads"], num_key_value_heads=SIZE["kv_heads"],
                         intermediate_size=SIZE["intermediate"], head_dim=SIZE["hidden"] // SIZE["heads"],
                         max_position_embeddings=POSITIONS, eos_token_id=tok.eos_token_id, bos_token_id=None,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=True)  # fmt: skip
    tok = as_loaded(tok, template, config)
    examples = [assistant_labels(tok, m, tool_list) for _, m in data]
    log(f"{len(examples)} episodes, {sum(len(i) for i, _ in examples)} tokens, vocab {len(tok)} "
        f"({type(tok).__name__})")
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for key, value in (("eos_token_id", tok.eos_token_id), ("pad_token_id", tok.pad_token_id), ("bos_token_id", None)):
        setattr(model.generation_config, key, value)
    losses = _warm_start(model, examples, tok.pad_token_id, log)
    info = {"version": VERSION, "episodes": len(data), "kinds": {k: sum(d[0] == k for d in data) for k in KIND_WEIGHTS},
            "vocab_size": len(tok), "n_params": sum(p.numel() for p in model.parameters()), "steps": STEPS,
            "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "greedy_first_actions": first_actions(model, tok, tool_list)}  # fmt: skip
    log(f"greedy first actions on held-out levels: {info['greedy_first_actions']}")
    return bm.save_build(out_dir, model, tok, info, t0, log)


def as_loaded(tok, template: str, config):
    """``tok`` with ``template`` as a user of the model loads it: saved beside the model's ``config`` and loaded back
    by ``AutoTokenizer``, which picks the tokenizer class of the config's model type (Qwen2's, whose pre-tokenizer
    splits numbers into digits: "2000" is one token of the fresh BPE and four as loaded). The warm start must train on
    the ids the model will be given."""
    import tempfile

    from transformers import AutoTokenizer

    tok.chat_template = template
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        config.save_pretrained(tmp)
        loaded = AutoTokenizer.from_pretrained(tmp)
    if len(loaded) != len(tok):
        raise ValueError(f"the loaded tokenizer has {len(loaded)} entries, the built one {len(tok)}")
    return loaded


def _warm_start(model, examples: list[tuple[list[int], list[int]]], pad_id: int, log) -> list[float]:
    """``STEPS`` AdamW steps on batches of ``BATCH`` episodes (right-padded), assistant tokens only; cosine decay."""
    import math

    import torch

    gen = torch.Generator().manual_seed(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.01)
    model.train()
    losses = []
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = PEAK_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / STEPS)))
        pick = torch.randint(len(examples), (BATCH,), generator=gen).tolist()
        width = max(len(examples[i][0]) for i in pick)
        ids = torch.tensor([examples[i][0] + [pad_id] * (width - len(examples[i][0])) for i in pick])
        labels = torch.tensor([examples[i][1] + [-100] * (width - len(examples[i][1])) for i in pick])
        mask = torch.tensor([[1] * len(examples[i][0]) + [0] * (width - len(examples[i][0])) for i in pick])
        bm.optimizer_step(model, opt, model(input_ids=ids, attention_mask=mask, labels=labels).loss, losses)
        if step % 25 == 0 or step == STEPS - 1:
            log(f"step {step}/{STEPS} loss {losses[-1]:.4f}")
    model.eval()
    return losses


def first_actions(model, tok, tool_list, n: int = 8) -> dict[str, int]:
    """The tool each of ``n`` held-out levels' greedy first turns calls (``none`` for no parsed call; parsed as the
    episode loop parses, after the prompt and with the tools' schemas)."""
    import torch
    from trl.chat_template_utils import add_response_schema, parse_response

    from environments.base import HELDOUT_LEVELS
    from environments.ml_task import INSTRUCTIONS, MLTask

    add_response_schema(tok)
    counts: dict[str, int] = {}
    for level in range(HELDOUT_LEVELS, HELDOUT_LEVELS + n):
        env = MLTask()
        try:
            messages = [{"role": "user", "content": INSTRUCTIONS + env.reset(level)}]
        finally:
            env.close()
        prompt = tok.apply_chat_template(messages, tools=tool_list, tokenize=True, return_dict=False,
                                         add_generation_prompt=True)  # fmt: skip
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt):].tolist()
        calls = parse_response(tok, out, prefix=prompt, tools=tool_list).get("tool_calls") or []
        name = calls[0]["function"]["name"] if calls else "none"
        counts[name] = counts.get(name, 0) + 1
    return counts


def ensure_builtin_tools(rebuild: bool = False) -> Path:
    """The built model's directory; built once (in a subprocess, under a file lock) when absent."""
    return bm.ensure_built(builtin_tools_dir(), "trl_ext.models.builtin_tools", rebuild, "the builtin_tools model")


def main(argv: list[str] | None = None) -> None:
    bm.cli(argv, "Build (once) and show the builtin_tools model.", ensure_builtin_tools, build_into)


if __name__ == "__main__":
    main()
