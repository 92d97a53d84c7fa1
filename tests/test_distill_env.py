"""Distillation on environments (issue 12, point 3): where the teacher context goes for chat and plain-text
prompts, and teacher log-probs over the agent's tokens only in multi-turn episodes.

References are independent of the trainer's plumbing: the teacher's prompt is rendered by hand and its
log-probs come from a direct forward of one unpadded row (teacher prompt + completion) of the reference model.
"""

import pytest
import zygote
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from environments.base import make_env
from trl_ext.config import train_config
from trl_ext.distill.teacher import chat_teacher_prompt, teacher_messages
from trl_ext.env.episodes import env_dataset, env_reward
from reference import word_tokenizer

WORDS = ("[UNK] [EOS] < > / answer think jump left right up down reward : - 1 0 . done false true invalid "
         "p _ o g x * junk system user assistant hint go").split()  # fmt: skip
# role :content . per message, then "assistant :" (an agent turn renders verbatim after the generation prompt)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} :{{ m['content'] }} . {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")  # fmt: skip
CONTEXT = "hint : go right"
AGENT = "< answer > jump < / answer >"  # invalid on every turn: the episode runs max_turns, env tokens in between


def make_tok(chat: bool):
    return word_tokenizer(" ".join(WORDS), TEMPLATE if chat else None)


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_chat_teacher_prompt_keeps_the_suffix_after_the_rendered_messages():
    assert chat_teacher_prompt([5, 6, 7, 8], [5, 6], [9, 9, 9]) == [9, 9, 9, 7, 8]
    assert chat_teacher_prompt([5, 6], [5, 6], [9]) == [9]
    with pytest.raises(ValueError, match="do not start with"):
        chat_teacher_prompt([5, 7, 8], [5, 6], [9])


def test_teacher_messages_replaces_or_inserts_the_system_message():
    student = [{"role": "system", "content": "rules"}, {"role": "user", "content": "obs"}]
    assert teacher_messages(student, "ctx") == [{"role": "system", "content": "ctx"}, {"role": "user", "content": "obs"}]
    assert student[0]["content"] == "rules"  # not modified
    bare = [{"role": "user", "content": "obs"}, {"role": "assistant", "content": "a"}]
    assert teacher_messages(bare, "ctx") == [{"role": "system", "content": "ctx"}, *bare]
    assert teacher_messages(student, "") == student


def make_trainer(tok, tmp_path, **over):
    from trl_ext.trainer import ExtGRPOTrainer

    torch.manual_seed(0)
    model = str(tmp_path / "tiny")  # a path: TRL loads the reference model (the teacher, beta > 0) from it
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, eos_token_id=1, pad_token_id=1, bos_token_id=None,
    )).save_pretrained(model)
    args = dict(output_dir=str(tmp_path), env="frozenlake", max_turns=2, per_device_train_batch_size=2,
                num_generations=2, max_completion_length=12, beta=0.05, report_to=[], use_cpu=True,
                save_strategy="no", disable_tqdm=True, max_steps=1, teacher_context=CONTEXT, teacher_tau=1.0,
                student_tau=0.5, adv_tau=0.0, skip_verification=True)  # fmt: skip
    args.update(over)
    trainer = ExtGRPOTrainer(model=model, reward_funcs=[env_reward], args=train_config(**args),
                             train_dataset=env_dataset(make_env("frozenlake"), 2, tok), processing_class=tok)
    trainer._generate_single_turn = lambda prompt_ids, *a: ([encode(tok, AGENT + " junk")] * len(prompt_ids), None)
    with torch.no_grad():  # the policy moves away from the reference (the teacher): the two scores differ
        for p in trainer.model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    trainer.model.train()
    return trainer


def row_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -len(completion) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("chat", [False, True])
def test_env_teacher_context_placement_and_agent_tokens_only(tmp_path, chat):
    tok = make_tok(chat)
    trainer = make_trainer(tok, tmp_path)
    seen = {}
    score = trainer.components.distill.score_teacher

    def spy(batch, prompts=None, render_kwargs=None):
        seen["lp"] = score(batch, prompts, render_kwargs)
        return seen["lp"]

    trainer.components.distill.score_teacher = spy
    env = make_env("frozenlake")
    rows = [{"prompt": p, "env_seed": 0} for p in list(env_dataset(env, 1, tok)["prompt"]) * 2]
    batch = trainer._generate_and_score_completions(rows)

    obs = env.reset(0)
    if chat:  # the student's system message (the environment's instructions) is replaced by the context; what
        # follows the rendered messages in the student's prompt (the environment's prefill) follows them here too
        assert rows[0]["prompt"][0] == {"role": "system", "content": env.instructions}
        teacher_prompt = encode(tok, f"system :{CONTEXT} . user :{obs} . assistant :{env.prefill}")
        student_prompt = encode(tok, f"system :{env.instructions} . user :{obs} . assistant :{env.prefill}")
    else:  # plain text: the context ids, then the prompt's
        student_prompt = encode(tok, rows[0]["prompt"])
        teacher_prompt = encode(tok, CONTEXT) + student_prompt
    assert batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist() == student_prompt
    completion_mask = batch["completion_mask"][0].bool()
    completion = batch["completion_ids"][0][completion_mask].tolist()
    agent = (batch["tool_mask"][0].bool() & completion_mask)[completion_mask]
    assert 0 < agent.sum() < len(completion)  # agent and environment tokens
    expected = torch.where(agent, row_logps(trainer.ref_model, teacher_prompt, completion), 0.0)
    lp = seen["lp"][0][completion_mask]
    assert torch.allclose(lp, expected, rtol=0, atol=1e-5)
    assert (lp[agent] != 0).all() and (lp[~agent] == 0).all()
    # not the student's prompt: the context changed the teacher's scores
    assert (row_logps(trainer.ref_model, student_prompt, completion)[agent] - expected[agent]).abs().max() > 1e-4
    # R = teacher_tau * sum_agent lp_teacher - student_tau * sum_agent lp_student; equal rows: advantages 0
    assert batch["advantages"].abs().max().item() < 1e-5
    logged = trainer._metrics["train"]["distill/teacher_logp_sum"][-1]
    assert logged == pytest.approx(expected.sum().item(), abs=1e-4)


def test_plain_prompt_with_chat_tokenizer_needs_no_template(tmp_path):
    """A plain-text prompt is prepended to even when the tokenizer has a chat template (the prompt decides)."""
    tok = make_tok(chat=True)
    trainer = make_trainer(tok, tmp_path)
    batch = {"prompt_ids": torch.tensor([encode(tok, "up down")]), "prompt_mask": torch.ones(1, 2, dtype=torch.long),
             "completion_ids": torch.tensor([encode(tok, "left right")]),
             "completion_mask": torch.ones(1, 2, dtype=torch.long)}  # fmt: skip
    lp = trainer.components.distill.score_teacher(batch, ["up down"])
    expected = row_logps(trainer.ref_model, encode(tok, CONTEXT + " up down"), encode(tok, "left right"))
    assert torch.allclose(lp[0], expected, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_train_py_pure_distillation_on_frozenlake_builtin_env(builtin_cache, tmp_path):
    """train.py end to end: a multi-turn environment, the base weights (adapters off) as the teacher with a context."""
    import json
    import sys
    from pathlib import Path

    from trl_ext.models.builtin_env import ensure_builtin_env

    ensure_builtin_env()
    flags = ["--env", "frozenlake", "--model", "builtin_env", "--max_turns", "2", "--teacher_context", CONTEXT,
             "--teacher_tau", "1", "--student_tau", "1", "--adv_tau", "0", "--skip_verification", "--lora_rank", "4",
             "--lr", "1e-3", "--max_steps", "2", "--batch_size", "4", "--n_rollout", "2", "--max_completion_length",
             "16", "--logging_steps", "1", "--save_steps", "2", "--no_wandb", "--output_dir", str(tmp_path),
             "--run_name", "distill_env"]  # fmt: skip
    root = Path(__file__).resolve().parents[1]
    proc = zygote.run([sys.executable, "train.py", *flags], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((tmp_path / "distill_env" / "checkpoint-2" / "trainer_state.json").read_text())
    logs = [h for h in state["log_history"] if "distill/teacher_logp_sum" in h]
    assert len(logs) == 2 and all(h["distill/teacher_logp_sum"] < 0 and "env/turns" in h for h in logs)
    assert all(h["distill/reward_task"] == 0.0 for h in logs)  # pure distillation: no task reward
