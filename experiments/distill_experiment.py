"""Context distillation on the builtin model: does the student's "happy" rate rise toward its teacher's?

Step 1 measures the context itself: held-out happy rate of the builtin model on ``prompt`` (student) and on
``context + prompt`` (teacher), and the per-token KL between them on the student's samples. The builtin corpus
draws every feeling word independently (environments/stories.py), so its model has no reason to condition on a
preceding text: the measured effect of every context we tried is nil (see the results).

Step 2 therefore gives the distillation a teacher that is measurably happier: a copy of the builtin model whose
output logit of the token "happy" is raised by ``BOOST`` nats (untied output head; the added row ``u`` solves
``h . u = 1`` in least squares over the final hidden states ``h`` of sampled text, so the shift is close to
``BOOST`` at every position). It is passed as ``--teacher_model`` together with ``--teacher_context``; the
seed's configurations are then trained with train.py's own flags (``cli.build_plan``/``cli.run_training``):
pure distillation (adv_tau 0, teacher_tau = student_tau = 1, --skip_verification), hybrid (task happy_binary +
KL, taus 1), gated hybrid (taus 0.01, --kl_only_incorrect), token-level KL (--no_use_full_reward_baseline, taus
0.01) and pure task RL (taus 0) for reference. Every run is scored on the same held-out prompts afterwards.

    uv run python experiments/distill_experiment.py     # ~10 minutes of CPU on 2 cores

Writes experiments/results/distill.json and prints the table of experiments/results/distill.md.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve on shared cores

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONTEXT = "a happy story."
CONTEXTS = [CONTEXT, "happy. happy. happy. happy. happy. happy.", "she was happy. he was happy. everyone felt happy."]
BOOST = 2.0
EVAL_PROMPTS, EVAL_TOKENS, SEED = 256, 32, 0
COMMON = ["--reward", "happy_binary", "--model", "builtin", "--batch_size", "32", "--num_generations", "8",
          "--max_completion_length", str(EVAL_TOKENS), "--max_steps", "40", "--lr", "3e-4", "--beta", "0",
          "--logging_steps", "5", "--save_steps", "40", "--eval_rewards", "happy_binary", "--no_wandb"]  # fmt: skip
RUNS = {
    "pure distillation": ["--adv_tau", "0", "--teacher_tau", "1", "--student_tau", "1", "--skip_verification"],
    "hybrid": ["--adv_tau", "1", "--teacher_tau", "1", "--student_tau", "1"],
    "hybrid, gated KL": ["--adv_tau", "1", "--teacher_tau", "0.01", "--student_tau", "0.01", "--kl_only_incorrect"],
    "token-level KL": ["--adv_tau", "1", "--teacher_tau", "0.01", "--student_tau", "0.01",
                       "--no_use_full_reward_baseline"],
    "pure task RL": [],
}


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@torch.no_grad()
def sample(model, tok, prompts: list[str], context: str = "") -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """One completion per prompt (temperature 1), seeded; returns texts and the (ids, mask) of the prompts."""
    ids, mask = left_pad([tok(context + p, add_special_tokens=False)["input_ids"] for p in prompts], tok.pad_token_id)
    torch.manual_seed(SEED)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=EVAL_TOKENS, pad_token_id=tok.pad_token_id)
    return tok.batch_decode(out[:, ids.size(1):], skip_special_tokens=True), ids, out


def happy_rate(texts: list[str]) -> float:
    from rewards.config import load_reward_config

    fn = load_reward_config(ROOT / "config.yaml").reward("happy_binary")
    return sum(fn(texts)) / len(texts)


@torch.no_grad()
def context_kl(model, tok, prompts: list[str], context: str) -> float:
    """Mean per-token k1 KL estimate (student - teacher log-prob) on the student's samples."""
    from trl_ext.distill import build_teacher_inputs, encode_context, teacher_logprobs

    _, ids, out = sample(model, tok, prompts)
    p_ids, p_mask = left_pad([tok(p, add_special_tokens=False)["input_ids"] for p in prompts], tok.pad_token_id)
    completion = out[:, ids.size(1):]
    c_mask = torch.ones_like(completion)
    for i, row in enumerate(completion.tolist()):  # mask everything after the first EOS
        if tok.eos_token_id in row:
            c_mask[i, row.index(tok.eos_token_id) + 1 :] = 0
    s_in = (torch.cat([p_ids, completion], 1), torch.cat([p_mask, c_mask], 1), completion.size(1))
    t_in = build_teacher_inputs(encode_context(tok, context), p_ids, p_mask, completion, c_mask, tok.pad_token_id)
    lp_s, lp_t = teacher_logprobs(model, *s_in, 1.0), teacher_logprobs(model, *t_in, 1.0)
    return ((lp_s - lp_t) * c_mask).sum().item() / c_mask.sum().item()


@torch.no_grad()
def happy_teacher(model_dir: str, tok, prompts: list[str], out_dir: Path) -> Path:
    """The builtin model with the output logit of "happy" raised by ~BOOST nats (module docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    texts, _, out = sample(model, tok, prompts)
    hidden = model.model(input_ids=out).last_hidden_state.reshape(-1, model.config.hidden_size)  # after the norm
    u = torch.linalg.lstsq(hidden, torch.ones(hidden.size(0), 1)).solution[:, 0]
    happy = tok.convert_tokens_to_ids("happy")
    model.config.tie_word_embeddings = False
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    head.weight.data = model.get_input_embeddings().weight.data.clone()
    head.weight.data[happy] += BOOST * u
    model.lm_head = head
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    shift = (hidden @ (BOOST * u)).std().item()
    print(f"happy teacher: logit shift {BOOST} nats (std over positions {shift:.3f}), saved to {out_dir}", flush=True)
    return out_dir


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import trl_ext.cli_train as cli
    from environments.stories import load_prompts
    from trl_ext.builtin_model import ensure_builtin
    from trl_ext.models import prepare_tokenizer

    torch.set_num_threads(2)
    start = time.time()
    model_dir = str(ensure_builtin())
    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(model_dir))
    prompts = list(load_prompts("builtin", tok, 8, "test", EVAL_PROMPTS, SEED)["prompt"])
    student = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    results = {"student": happy_rate(sample(student, tok, prompts)[0]), "contexts": {}, "runs": {}}
    for context in CONTEXTS:
        results["contexts"][context] = {"happy_rate": happy_rate(sample(student, tok, prompts, context + " ")[0]),
                                        "kl_per_token": context_kl(student, tok, prompts, context + " ")}
    print(json.dumps(results, indent=2), flush=True)

    work = Path(tempfile.mkdtemp(prefix="distill_exp_"))
    teacher_dir = happy_teacher(model_dir, tok, prompts, work / "happy_teacher")
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    results["teacher"] = {"happy_rate": happy_rate(sample(teacher, tok, prompts, CONTEXT + " ")[0])}
    print(f"teacher (boosted, with context) happy rate {results['teacher']['happy_rate']:.3f}", flush=True)
    for name, flags in RUNS.items():
        run_start = time.time()
        slug = name.replace(",", "").replace(" ", "_")
        argv = [*COMMON, "--output_dir", str(work), "--run_name", slug, *flags]
        if flags:  # every run but pure task RL distils from the happy teacher, which sees the context
            argv += ["--teacher_model", str(teacher_dir), "--teacher_context", CONTEXT]
        plan = cli.build_plan(argv)
        assert cli.run_training(plan) == 0
        ckpt = plan.run_dir / "checkpoint-40"
        history = json.loads((ckpt / "trainer_state.json").read_text())["log_history"]
        trained = AutoModelForCausalLM.from_pretrained(ckpt).eval()
        results["runs"][name] = {
            "flags": flags,
            "train_happy": [h["eval_rewards/happy_binary"] for h in history if "eval_rewards/happy_binary" in h],
            "kl": [h["distill/kl"] for h in history if "distill/kl" in h],
            "heldout_happy": happy_rate(sample(trained, tok, prompts)[0]),
            "wall_s": round(time.time() - run_start, 1),
        }
        print(name, json.dumps(results["runs"][name]), flush=True)
    results["wall_s"] = round(time.time() - start, 1)
    out = ROOT / "experiments" / "results" / "distill.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out} ({results['wall_s']} s)")


if __name__ == "__main__":
    main()
