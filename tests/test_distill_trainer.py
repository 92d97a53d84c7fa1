"""Context distillation in the trainer: the batch advantages, skip_verification, the per-token bonus in the loss,
the shared adv_tau, bad command lines (exit 2 before any model load) and one train.py run on the builtin model.

References are computed independently of the trainer's plumbing: every log-prob comes from a direct forward of
one unpadded row (``context + prompt + completion`` for the teacher, ``prompt + completion`` for the student),
and the task reward from calling the reward function on the decoded completions.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import zygote
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

import trl_ext.cli_train as cli
from trl_ext.config import train_config
from trl_ext.registry import ConfigError
from trl_ext.distill.advantages import distill_advantages
from trl_ext.models import load_tokenizer, prepare_tokenizer
from trl_ext.trainer import ExtGRPOTrainer

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = "a happy story."
# different token lengths, so the prompts are left-padded in the batch
PROMPTS = ["ivy was a young bird who lived near", "the dog", "once upon a time, there", "ben felt"]


def a_count(texts):
    """A deterministic task reward in [0, 1]: 1 if the completion has more than two letters 'a'."""
    return [float(t.count("a") > 2) for t in texts]


def a_count_reward(completions, **kwargs):
    return a_count(completions)


def forbidden_reward(completions, **kwargs):
    raise AssertionError("skip_verification: no task reward function may be called")


def make_trainer(builtin_path, tmp_path, reward=a_count_reward, **over):
    cfg = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=2,
               max_completion_length=6, max_steps=1, beta=0.0, learning_rate=1e-3, logging_steps=1,
               save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
               teacher_model=str(builtin_path), teacher_context=CONTEXT, teacher_tau=0.5, student_tau=0.25)  # fmt: skip
    tok = prepare_tokenizer(load_tokenizer(builtin_path))
    trainer = ExtGRPOTrainer(model=str(builtin_path), reward_funcs=[reward], args=train_config(**{**cfg, **over}),
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), processing_class=tok)
    trainer.model.train()
    return trainer


def row_logps(model, context: list[int], prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """Log-probs of ``completion`` after ``context + prompt``: one unpadded row, one forward."""
    ids = torch.tensor([context + prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -len(completion) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def reference(trainer, batch):
    """(task, lp_teacher, lp_student, mask) of the batch, each computed row by row."""
    tok = trainer.processing_class
    teacher = AutoModelForCausalLM.from_pretrained(trainer.args.teacher_model).eval()
    student = trainer.model
    context = tok(CONTEXT, add_special_tokens=False)["input_ids"]
    mask = batch["completion_mask"]
    lp_t, lp_s = torch.zeros(mask.shape), torch.zeros(mask.shape)
    for i in range(mask.size(0)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        completion = batch["completion_ids"][i][mask[i].bool()].tolist()
        lp_t[i, : len(completion)] = torch.tensor(row_logps(teacher, context, prompt, completion, 1.0))
        lp_s[i, : len(completion)] = torch.tensor(row_logps(student, [], prompt, completion, 1.0))
    texts = tok.batch_decode([r[m.bool()].tolist() for r, m in zip(batch["completion_ids"], mask)],
                             skip_special_tokens=True)
    return torch.tensor(a_count(texts)), lp_t, lp_s, mask


def generate(trainer):
    torch.manual_seed(0)
    return trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(2)])  # groups


# ------------------------------------------------------------------------------ advantages in the batch
@pytest.mark.parametrize("kl_only_incorrect", [False, True])
def test_batch_advantages_equal_distill_advantages(builtin_path, tmp_path, kl_only_incorrect):
    trainer = make_trainer(builtin_path, tmp_path, kl_only_incorrect=kl_only_incorrect)
    batch = generate(trainer)
    task, lp_t, lp_s, mask = reference(trainer, batch)
    assert batch["prompt_mask"].min() == 0  # prompts of different lengths: left padding is exercised
    expected = distill_advantages(task, lp_t, lp_s, mask, trainer.args.distill_config(), group_size=2)
    assert torch.allclose(batch["advantages"], expected.advantages, atol=1e-4)
    assert batch["advantages"].view(-1, 2).sum(1).abs().max() < 1e-5  # full-reward baseline: zero per group
    assert "distill_lp_teacher" not in batch and "distill_gate" not in batch  # sequence path: nothing per token
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    sums_t, sums_s = (lp_t * mask).sum(1), (lp_s * mask).sum(1)
    assert metrics["distill/teacher_logp_sum"] == pytest.approx(sums_t.mean().item(), abs=1e-4)
    assert metrics["distill/student_logp_sum"] == pytest.approx(sums_s.mean().item(), abs=1e-4)
    assert metrics["distill/kl"] == pytest.approx(((sums_s - sums_t).sum() / mask.sum()).item(), abs=1e-5)
    assert metrics["distill/reward_task"] == pytest.approx(task.mean().item())  # adv_tau = 1
    if kl_only_incorrect:
        gate = 1 - task.view(-1, 2).mean(1).repeat_interleave(2)
        assert metrics["distill/gate_mean"] == pytest.approx(gate.mean().item())


# ------------------------------------------------------------------------------ skip_verification
def test_skip_verification_calls_no_reward_and_trains(builtin_path, tmp_path):
    trainer = make_trainer(builtin_path, tmp_path, reward=forbidden_reward, adv_tau=0.0, teacher_tau=1.0,
                           student_tau=1.0, skip_verification=True)
    batch = generate(trainer)  # forbidden_reward raises if it is called
    _, lp_t, lp_s, mask = reference(trainer, batch)
    r = ((lp_t - lp_s) * mask).sum(1)  # R = 1*sum lp_teacher - 1*sum lp_student, no task term
    expected = r - r.view(-1, 2).mean(1).repeat_interleave(2)
    assert torch.allclose(batch["advantages"], expected, atol=1e-4)
    trainer.train()  # one full optimizer step, still without a reward call
    assert trainer.state.global_step == 1
    assert [h["distill/reward_task"] for h in trainer.state.log_history if "distill/reward_task" in h] == [0.0]


# ------------------------------------------------------------------------------ token path
def test_token_path_adds_bonus_in_loss(builtin_path, tmp_path):
    trainer = make_trainer(builtin_path, tmp_path, use_full_reward_baseline=False, kl_only_incorrect=True)
    batch = generate(trainer)
    task, lp_t, _, mask = reference(trainer, batch)
    # advantages: task only, adv_tau*(task - group mean); lp_teacher and the gate ride in the batch
    assert torch.allclose(batch["advantages"], task - task.view(-1, 2).mean(1).repeat_interleave(2))
    assert torch.allclose(batch["distill_lp_teacher"], lp_t, atol=1e-4)
    gate = 1 - task.view(-1, 2).mean(1).repeat_interleave(2)
    assert torch.equal(batch["distill_gate"], gate)
    # lp_trainer of the loss = the current policy's log-probs (no update yet: the student's, row by row)
    _, _, lp_trainer, _ = reference(trainer, batch)
    bonus = gate[:, None] * (0.5 * lp_t - 0.25 * lp_trainer) * mask
    a_tok = batch["advantages"][:, None] + bonus
    # TRL's "grpo" loss at ratio 1, beta 0: -mean_i( sum_t A_it m_it / sum_t m_it )
    expected = -((a_tok * mask).sum(1) / mask.sum(1)).mean()
    without = -batch["advantages"].mean()
    advantages_before = batch["advantages"].clone()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); the loss divides by it
    loss = trainer._compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-4)
    assert abs(expected.item() - without.item()) > 1e-2  # the bonus is not negligible here
    assert torch.equal(batch["advantages"], advantages_before)  # restored for a later iteration
    assert trainer._metrics["train"]["distill/token_bonus"][-1] == pytest.approx(
        (bonus.sum() / mask.sum()).item(), abs=1e-4)


# ------------------------------------------------------------------------------ adv_tau and loss_adv_tau
def test_adv_tau_is_distillations_and_loss_adv_tau_is_the_losss(builtin_path, tmp_path):
    trainer = make_trainer(builtin_path, tmp_path, max_async_level=1, adv_tau=0.5, loss_adv_tau=0.25)
    assert trainer.components.distill.cfg.adv_tau == 0.5  # the task weight inside the distillation advantages
    assert trainer.components.offpolicy.cfg.loss_adv_tau == 0.25  # the off-policy loss's own weight, independent of it
    with pytest.raises(ConfigError, match="weights the task reward of distillation"):  # no distillation: no meaning
        train_config(output_dir=str(tmp_path), report_to=[], adv_tau=0.5)
    with pytest.raises(ConfigError, match="--loss_adv_tau has no effect with --max_async_level 0"):
        train_config(output_dir=str(tmp_path), report_to=[], loss_adv_tau=0.5)


# ------------------------------------------------------------------------------ bad command lines


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--teacher_tau", "1", "--beta", "0"], "--teacher_tau 1.0 > 0 needs a teacher"),
        (["--teacher_context", "x", "--eval_baseline", "--beta", "0"], "--eval_baseline needs a teacher"),
        (["--teacher_tau", "1", "--sync_ref_model"], "--sync_ref_model moves"),
        (["--skip_verification", "--teacher_tau", "1", "--student_tau", "1"], "adv_tau must be 0"),
        (["--teacher_tau", "-1"], "--teacher_tau must be a finite number >= 0"),
        (["--student_tau", "-0.5"], "--student_tau must be a finite number >= 0"),
        (["--teacher_tau", "1", "--adv_tau", "-1"], "adv_tau must be a finite number >= 0"),
        (["--kl_only_incorrect"], "there is no KL term to gate"),
        (["--teacher_tau", "1", "--batch_size", "6", "--num_generations", "4"], "not divisible by the group size"),
        (["--teacher_context", "x"], "apply only with distillation"),
        (["--no_use_full_reward_baseline"], "apply only with distillation"),
        (["--eval_baseline"], "--eval_baseline compares the student with a teacher"),
        (["--teacher_tau", "1", "--teacher_model", "/no/such/dir"], "path does not exist"),
        (["--teacher_tau", "1", "--temperature", "0"], "--temperature must be > 0"),
    ],
)
def test_bad_inputs_exit_2(train_cli_error, argv, message):
    assert message in train_cli_error("--reward", "happy_binary", *argv)


def test_no_use_full_reward_baseline_flag_parses(monkeypatch):
    plan = cli.build_plan(["--reward", "happy_binary", "--teacher_tau", "0.01", "--student_tau", "0.01",
                           "--no_use_full_reward_baseline", "--output_dir", "/tmp/unused"])
    assert plan.cfg.use_full_reward_baseline is False and plan.cfg.distill_on
    default = cli.build_plan(["--reward", "happy_binary", "--output_dir", "/tmp/unused"]).cfg
    assert (default.use_full_reward_baseline, default.distill_on, default.teacher_tau, default.student_tau) == (
        True, False, 0.0, 0.0)


# ------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_train_py_pure_distillation(builtin_path, tmp_path):
    flags = ["--reward", "happy_binary", "--batch_size", "4", "--num_generations", "2", "--max_steps", "2",
             "--max_completion_length", "8", "--no_wandb", "--output_dir", str(tmp_path), "--logging_steps", "1",
             "--adv_tau", "0", "--teacher_tau", "1", "--student_tau", "1", "--skip_verification",
             "--teacher_context", CONTEXT, "--eval_baseline", "--eval_baseline_prompts", "4",
             "--run_name", "distill"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = zygote.run([sys.executable, "train.py", *flags], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "distill"
    baseline = json.loads((run_dir / "eval_baseline.json").read_text())
    assert set(baseline) == {"student", "teacher"} and set(baseline["student"]) == {"task/happy_binary"}
    assert "eval_baseline teacher: task/happy_binary=" in (run_dir / "train.log").read_text()
    final = json.loads((run_dir / "run_summary.json").read_text())["final_log"]
    assert final["distill/reward_task"] == 0.0 and final["rewards/happy_binary/mean"] == 0.0  # never computed
    # R - group mean has mean 0; the logged reward is the mean R = teacher part + student part
    assert final["distill/reward"] == pytest.approx(final["distill/reward_teacher"] + final["distill/reward_student"],
                                                    abs=1e-3)


# ------------------------------------------------------------------------------ default teacher, eval baseline
def test_lora_teacher_is_the_base_model(builtin_path, tmp_path):
    from peft import LoraConfig

    peft = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"], task_type="CAUSAL_LM")
    cfg = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=2,
               max_completion_length=6, beta=0.0, report_to=[], use_cpu=True, seed=0, teacher_context=CONTEXT,
               teacher_tau=1.0, student_tau=0.0)  # fmt: skip
    tok = prepare_tokenizer(load_tokenizer(builtin_path))
    trainer = ExtGRPOTrainer(model=str(builtin_path), reward_funcs=[a_count_reward], args=train_config(**cfg),
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
                             peft_config=peft)
    with torch.no_grad():  # make the adapters matter: the policy now differs from the base model
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    trainer.model.train()
    batch = generate(trainer)
    base = AutoModelForCausalLM.from_pretrained(builtin_path).eval()
    context = tok(CONTEXT, add_special_tokens=False)["input_ids"]
    lp = trainer.components.distill.score_teacher(batch)
    for i in range(lp.size(0)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        completion = batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist()
        want = torch.tensor(row_logps(base, context, prompt, completion, 1.0))
        assert torch.allclose(lp[i, : len(completion)], want, atol=1e-4)
        policy = torch.tensor(row_logps(trainer.model, context, prompt, completion, 1.0))
        assert (policy - want).abs().max() > 1e-2  # with adapters on, the scores would differ


def test_eval_baseline_same_teacher_same_samples(builtin_path, tmp_path):
    from trl_ext.distill.baseline import eval_baseline

    trainer = make_trainer(builtin_path, tmp_path, teacher_context="", student_tau=0.0)
    seen = []
    rng = torch.random.get_rng_state()
    results = eval_baseline(trainer, PROMPTS, {"texts": lambda texts: seen.append(texts) or [1.0] * len(texts),
                                               "a": a_count})
    assert torch.equal(torch.random.get_rng_state(), rng)  # the training RNG is untouched
    # teacher = the same weights, empty context, same seed: the same samples and scores on both sides
    assert len(seen) == 2 and seen[0] == seen[1] and any(seen[0])
    assert results["student"] == results["teacher"] == {"texts": 1.0, "a": sum(a_count(seen[0])) / 4}
    assert json.loads((Path(trainer.args.output_dir) / "eval_baseline.json").read_text()) == results
