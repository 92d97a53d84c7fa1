"""Context distillation on the builtin_mood model: does the student's "happy" rate rise toward its teacher's?

The teacher is the student's initial weights (``--teacher_model builtin_mood``, a frozen copy: with a
full fine-tune and ``--beta 0`` there is no reference model to reuse) given the context "A happy story.";
the student sees only the story prompt. ``--model builtin_mood`` is the builtin model built on a
corpus where 30% of the stories carry a title "A <feeling> story." that their feelings follow
(``trl_ext.models.builtin_mood``); the plain builtin model draws feelings independently, so no context
changes it (step 1 measures both).

Step 1: held-out happy rate of each model on ``prompt`` (student) and on ``context + prompt`` (teacher), and
the per-token KL between them on the student's samples.
Step 2: the seed's configurations, trained with train.py's own code (``cli.build_plan``/``cli.run_training``):
pure distillation (adv_tau 0, teacher_tau = student_tau = 1, --skip_verification), hybrid (task happy_binary +
KL, taus 1), gated hybrid (taus 0.01, --kl_only_incorrect), token-level KL (--no_use_full_reward_baseline, taus
0.01), pure task RL (taus 0) for reference, and pure distillation again for 160 steps. Every run is scored on
the same held-out prompts afterwards.

    uv run python experiments/distill_experiment.py     # ~10 minutes of CPU on 2 cores

Writes experiments/results/distill.json (the table of experiments/results/distill.md is written from it).
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

CONTEXT = "A happy story."
MODELS = ("builtin", "builtin_mood")  # the student trained in step 2 is the last
EVAL_PROMPTS, EVAL_TOKENS, SEED = 256, 32, 0
COMMON = ["--reward", "happy_binary", "--model", "builtin_mood", "--batch_size", "32", "--num_generations", "8",
          "--max_completion_length", str(EVAL_TOKENS), "--lr", "3e-4", "--beta", "0",
          "--logging_steps", "5", "--eval_rewards", "happy_binary", "--no_wandb"]  # fmt: skip
RUNS = {
    "pure distillation": ["--adv_tau", "0", "--teacher_tau", "1", "--student_tau", "1", "--skip_verification"],
    "hybrid": ["--adv_tau", "1", "--teacher_tau", "1", "--student_tau", "1"],
    "hybrid, gated KL": ["--adv_tau", "1", "--teacher_tau", "0.01", "--student_tau", "0.01", "--kl_only_incorrect"],
    "token-level KL": ["--adv_tau", "1", "--teacher_tau", "0.01", "--student_tau", "0.01",
                       "--no_use_full_reward_baseline"],
    "pure task RL": [],
}
STEPS = 40
LONG = "pure distillation, 160 steps"  # the first configuration, trained 4x longer
LONG_STEPS = 160


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    from trl.trainer.utils import pad

    tensors = [torch.tensor(r, dtype=torch.long) for r in rows]
    return pad(tensors, pad_id, "left"), pad([torch.ones_like(t) for t in tensors], 0, "left")


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
    """Mean per-token k1 KL estimate of ``model`` (prompt) against itself given ``context`` (the teacher)."""
    return context_kl_to(model, model, tok, prompts, context)


@torch.no_grad()
def context_kl_to(student, teacher, tok, prompts: list[str], context: str) -> float:
    """Mean per-token k1 KL estimate (student - teacher log-prob) on the student's samples; the teacher
    scores them after ``context``."""
    from trl_ext.distill.teacher import build_teacher_inputs, encode_context, teacher_logprobs

    _, ids, out = sample(student, tok, prompts)
    p_ids, p_mask = left_pad([tok(p, add_special_tokens=False)["input_ids"] for p in prompts], tok.pad_token_id)
    completion = out[:, ids.size(1):]
    c_mask = torch.ones_like(completion)
    for i, row in enumerate(completion.tolist()):  # mask everything after the first EOS
        if tok.eos_token_id in row:
            c_mask[i, row.index(tok.eos_token_id) + 1 :] = 0
    s_in = (torch.cat([p_ids, completion], 1), torch.cat([p_mask, c_mask], 1), completion.size(1))
    t_in = build_teacher_inputs(encode_context(tok, context), p_ids, p_mask, completion, c_mask, tok.pad_token_id)
    lp_s, lp_t = teacher_logprobs(student, *s_in, 1.0), teacher_logprobs(teacher, *t_in, 1.0)
    return ((lp_s - lp_t) * c_mask).sum().item() / c_mask.sum().item()


def main() -> None:
    from transformers import AutoModelForCausalLM

    import trl_ext.cli_train as cli
    from environments.stories import load_prompts
    from trl_ext.models import model_source, load_tokenizer, prepare_tokenizer

    torch.set_num_threads(2)
    start = time.time()
    results = {"context": CONTEXT, "models": {}, "runs": {}}
    for name in MODELS:  # step 1: what the context does to each model
        model_dir = model_source(name)
        tok = prepare_tokenizer(load_tokenizer(model_dir))
        prompts = list(load_prompts("builtin", tok, 8, "test", EVAL_PROMPTS, SEED)["prompt"])
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        results["models"][name] = {
            "student_happy": happy_rate(sample(model, tok, prompts)[0]),
            "teacher_happy": happy_rate(sample(model, tok, prompts, CONTEXT + " ")[0]),
            "kl_per_token": context_kl(model, tok, prompts, CONTEXT + " "),
        }
    print(json.dumps(results, indent=2), flush=True)
    teacher = model  # builtin_mood's initial weights (the last of MODELS); tok and prompts are its own

    work = Path(tempfile.mkdtemp(prefix="distill_exp_"))
    runs = [(name, flags, STEPS) for name, flags in RUNS.items()] + [(LONG, next(iter(RUNS.values())), LONG_STEPS)]
    for name, flags, steps in runs:  # step 2: train the builtin_mood student (tok/prompts are its own)
        run_start = time.time()
        slug = name.replace(",", "").replace(" ", "_")
        argv = [*COMMON, "--max_steps", str(steps), "--save_steps", str(steps), "--output_dir", str(work),
                "--run_name", slug, *flags]  # fmt: skip
        if flags:  # every run but pure task RL distils from the initial weights (a frozen copy) given the context
            argv += ["--teacher_model", "builtin_mood", "--teacher_context", CONTEXT]
        plan = cli.build_plan(argv)
        assert cli.run_training(plan) == 0
        ckpt = plan.run_dir / f"checkpoint-{steps}"
        history = json.loads((ckpt / "trainer_state.json").read_text())["log_history"]
        trained = AutoModelForCausalLM.from_pretrained(ckpt).eval()
        results["runs"][name] = {
            "flags": flags,
            "steps": steps,
            "train_happy": [h["eval_rewards/happy_binary"] for h in history if "eval_rewards/happy_binary" in h],
            "kl": [h["distill/kl"] for h in history if "distill/kl" in h],
            "gate": [h["distill/gate_mean"] for h in history if "distill/gate_mean" in h],
            "heldout_happy": happy_rate(sample(trained, tok, prompts)[0]),
            "heldout_kl_to_teacher": context_kl_to(trained, teacher, tok, prompts, CONTEXT + " "),
            "wall_s": round(time.time() - run_start, 1),
        }
        print(name, json.dumps(results["runs"][name]), flush=True)
    results["wall_s"] = round(time.time() - start, 1)
    out = ROOT / "experiments" / "results" / "distill.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text(markdown(results))
    print(f"wrote {out} and {out.with_suffix('.md')} ({results['wall_s']} s)")


def markdown(r: dict) -> str:
    """experiments/results/distill.md from the raw results."""
    m = r["models"]
    lines = [
        "# Context distillation on the builtin_mood model", "",
        f"`uv run python experiments/distill_experiment.py` ({r['wall_s']:.0f} s wall on 2 CPU cores; raw numbers in",
        f"`distill.json`). Held-out happy rate = fraction of {EVAL_PROMPTS} held-out prompts (8 tokens, split \"test\")",
        f"whose one sampled completion ({EVAL_TOKENS} tokens, temperature 1, seed {SEED}) contains \"happy\".", "",
        f"## 1. The context `{r['context']}`", "",
        "| model | student (prompt) | teacher (context + prompt) | per-token KL(student ‖ teacher) on student samples |",
        "|---|---|---|---|",
        *[f"| `{name}` | {v['student_happy']:.3f} | {v['teacher_happy']:.3f} | {v['kl_per_token']:.3f} nats |"
          for name, v in m.items()],
        "", "## 2. Training the builtin_mood student toward its context teacher", "",
        f"Common flags: `{' '.join(COMMON)} --max_steps {STEPS}` (except the last row); every distilling run adds `--teacher_model builtin_mood "
        f"--teacher_context \"{r['context']}\"`. Train happy = `eval_rewards/happy_binary` (the on-policy samples of "
        "each 5-step logging window). Held-out KL = per-token k1 estimate of KL(trained ‖ teacher) on the trained "
        "model's held-out samples.", "",
        "| configuration | flags | train happy, first → last 5-step window | held-out happy after training | held-out KL to the teacher | `distill/kl` first → last window |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name, run in r["runs"].items():
        kl = f"{run['kl'][0]:.3f} → {run['kl'][-1]:.3f}" if run["kl"] else "—"
        lines.append(f"| {name} | `{' '.join(run['flags']) or '(taus 0)'}` | {run['train_happy'][0]:.3f} → "
                     f"{run['train_happy'][-1]:.3f} | **{run['heldout_happy']:.3f}** | "
                     f"{run['heldout_kl_to_teacher']:.3f} | {kl} |")  # fmt: skip
    lines += ["", f"Student before training: {m['builtin_mood']['student_happy']:.3f}; teacher: "
              f"{m['builtin_mood']['teacher_happy']:.3f}. One seed per configuration.", ""]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
