"""Off-policy training on the builtin model with the happy_binary reward: how does the policy lag k change learning,
and do the importance-sampling masks recover it?

Runs (seed 000's grid, shrunk to CPU): k = 0 (synchronous, TRL's own loss), k in {1, 4, 16} with
--strict_async_level, each with every mask off (seed 000's "no mask" flags) and with prime-rl's default masks
(token [0.125, 8], geo [0.1, 10], sequence [0, 100], sequence clip 10), plus non-strict k = 1 (in-flight updates)
with the default masks. All runs share the config below; a high learning rate makes the effect of stale rollouts
visible within a short run; beta = 0 keeps the comparison to the importance-sampling loss alone. Each run is built
from train.py's own flags (``cli.build_plan``), so the flags are validated exactly as on the command line.

Two rewards are reported. The *batch* reward at step n is that of the completions trained on at step n, sampled by
the behaviour policy (n - k for strict runs), so it lags the trainer. The *policy* reward at step s is measured on the
trained policy itself: 2 samples on each of 64 held-out prompts, same sampler and random stream for every run.

    uv run python experiments/offpolicy_experiment.py --seeds 42,43   # all runs, then the table and plot
    uv run python experiments/offpolicy_experiment.py --report        # table and plot from the saved logs

Writes experiments/results/offpolicy.json (per-step logs), offpolicy.md (table) and offpolicy.png (plot).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve on shared cores

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
NO_MASK_FLAGS = ["--token_mask_low", "0", "--token_mask_high", "1e10", "--sequence_mask_low", "0",
                 "--sequence_mask_high", "1e10", "--geo_mask_low", "0", "--geo_mask_high", "1e10",
                 "--sequence_clip_high", "1e10"]  # fmt: skip  (seed 000's "no mask" flags; token_clip_high is off)
FAST = ["--generation_backend", "fast"]  # the generator's sampler of the recorded runs
RUNS = {
    "k0": ["--max_async_level", "0"],
    **{
        f"k{k}_strict_{m}": ["--max_async_level", str(k), "--strict_async_level", *FAST]
        + (NO_MASK_FLAGS if m == "nomask" else [])
        for k in (1, 4, 16)
        for m in ("nomask", "masks")
    },
    "k1_inflight_masks": ["--max_async_level", "1", *FAST],
}
METRICS = ("reward", "offpolicy/masked_frac", "offpolicy/seq_masked_frac", "offpolicy/token_masked_low_frac",
           "offpolicy/token_masked_high_frac", "offpolicy/geo_masked_low_frac", "offpolicy/geo_masked_high_frac",
           "offpolicy/ratio_mean", "offpolicy/ratio_max", "offpolicy/policy_lag_mean",
           "offpolicy/multi_version_seq_frac", "offpolicy/abs_log_ratio_mean", "entropy")  # fmt: skip
EVAL_PROMPTS, EVAL_SAMPLES = 64, 2


def common(steps: int, lr: str, seed: int | str, out: str) -> list[str]:
    return ["--reward", "happy_binary", "--model", "builtin", "--lr", lr, "--beta", "0", "--batch_size", "16",
            "--num_generations", "8", "--max_completion_length", "32", "--max_steps", str(steps),
            "--logging_steps", "1", "--save_strategy", "no", "--seed", str(seed), "--no_wandb",
            "--output_dir", out, "--disable_tqdm", "true"]  # fmt: skip


class PolicyEval(TrainerCallback):
    """Reward of the trained policy (not of the lagged batch) at fixed steps, on held-out prompts."""

    def __init__(self, prompt_ids, reward, tokenizer, eos_ids, max_new_tokens, marks):
        from trl_ext.interfaces import SamplingParams

        self.prompt_ids, self.reward, self.tokenizer, self.marks = prompt_ids * EVAL_SAMPLES, reward, tokenizer, marks
        self.params = SamplingParams(max_new_tokens, 1.0, 0, 1.0, tuple(eos_ids), tokenizer.pad_token_id)
        self.results: dict[int, float] = {}

    def evaluate(self, model, step):
        from trl_ext.offpolicy.worker import sample

        out = sample(model, self.prompt_ids, self.params, torch.Generator().manual_seed(1234))
        texts = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        self.results[step] = sum(self.reward(texts)) / len(texts)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.evaluate(model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step in self.marks:
            self.evaluate(model, state.global_step)


def train_one(name: str, steps: int, lr: str, seed: int) -> dict:

    from environments.stories import load_prompts
    from rewards.config import as_trl_reward
    from trl_ext.cli_train import build_plan
    from trl_ext.models import model_source, load_tokenizer, prepare_tokenizer
    from trl_ext.trainer import ExtGRPOTrainer

    torch.set_num_threads(2)
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    with tempfile.TemporaryDirectory() as out:
        plan = build_plan(common(steps, lr, seed, out) + RUNS[name])
        plan.cfg.report_to = []
        source = model_source("builtin")
        tok = prepare_tokenizer(load_tokenizer(source))
        prompts = load_prompts("builtin", tok, plan.run.prompt_length, "train", 1024, seed)
        held_out = load_prompts("builtin", tok, plan.run.prompt_length, "test", EVAL_PROMPTS, 0)["prompt"]
        happy = plan.reward_config.reward("happy_binary")
        trainer = ExtGRPOTrainer(model=source, reward_funcs=[as_trl_reward("happy_binary", happy)], args=plan.cfg,
                                 train_dataset=prompts, processing_class=tok)  # fmt: skip
        ids = tok(list(held_out), add_special_tokens=False)["input_ids"]
        evaluator = PolicyEval(ids, happy, tok, trainer.eos_token_ids, plan.cfg.max_completion_length,
                               marks={steps // 4, steps // 2, 3 * steps // 4, steps})  # fmt: skip
        trainer.add_callback(evaluator)
        start = time.time()
        trainer.train()
        wall = time.time() - start
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {"name": name, "flags": RUNS[name], "seed": seed, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "policy_reward": {str(s): v for s, v in sorted(evaluator.results.items())},
            "steps": [h["step"] for h in logs], **{m: [h.get(m) for h in logs] for m in METRICS}}  # fmt: skip


def window(values: list, end: int, width: int = 10) -> float | None:
    """Mean of the ``width`` values up to and including step ``end`` (1-based)."""
    part = [v for v in values[max(end - width, 0) : end] if v is not None]
    return sum(part) / len(part) if part else None


def mean(values: list) -> float | None:
    part = [v for v in values if v is not None]
    return sum(part) / len(part) if part else None


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def row(name: str, seeds: list[dict], marks: list[int], steps: int) -> list[str]:
    """Means over seeds; per-step metrics are first averaged over the run."""

    def over(fn):
        values = [fn(r) for r in seeds]
        return mean(values) if all(v is not None for v in values) else None

    def run_mean(key):
        return over(lambda r: mean(r[key]))

    geo = over(lambda r: mean([(a or 0) + (b or 0) for a, b in zip(r["offpolicy/geo_masked_low_frac"],
                                                                    r["offpolicy/geo_masked_high_frac"], strict=True)])
               if r["offpolicy/masked_frac"][0] is not None else None)  # fmt: skip
    return [
        name,
        str(len(seeds)),
        *[_fmt(over(lambda r, s=s: r["policy_reward"][str(s)])) for s in marks],
        _fmt(over(lambda r: window(r["reward"], steps))),
        _fmt(run_mean("offpolicy/masked_frac"), 3),
        _fmt(run_mean("offpolicy/seq_masked_frac"), 3),
        _fmt(run_mean("offpolicy/token_masked_low_frac"), 3),
        _fmt(run_mean("offpolicy/token_masked_high_frac"), 3),
        _fmt(geo, 3),
        _fmt(run_mean("offpolicy/abs_log_ratio_mean")),
        _fmt(over(lambda r: max((v for v in r["offpolicy/ratio_max"] if v is not None), default=None)), 0),
        _fmt(run_mean("offpolicy/policy_lag_mean"), 1),
        _fmt(run_mean("offpolicy/multi_version_seq_frac")),
        _fmt(over(lambda r: r["cpu_s"]), 0),
    ]


def report(saved: dict, steps: int, lr: str) -> None:
    marks = [0, steps // 4, steps // 2, 3 * steps // 4, steps]
    head = ["run", "seeds", *[f"policy reward @{s}" for s in marks], "batch reward, last 10", "masked tokens",
            "masked seqs", "tok < low", "tok > high", "geo out", "mean abs log-ratio", "max ratio", "lag",
            "multi-version seqs", "CPU s"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row(n, list(saved[n].values()), marks, steps)) + " |" for n in RUNS if n in saved]
    table = "\n".join(lines)
    per_run = ", ".join(f"{n}: `{' '.join(RUNS[n])}`" for n in RUNS if n in saved)
    seeds = ", ".join(sorted({s for n in saved for s in saved[n]}))
    text = (
        "# Off-policy experiment (generated by experiments/offpolicy_experiment.py)\n\n"
        f"Common flags: `{' '.join(common(steps, lr, '<seed>', '<tmp>'))}`; seeds {seeds}.\n\nPer run: "
        f"{per_run}.\n\nPolicy reward @s: happy_binary of the policy after s optimizer steps, 2 samples on each of "
        f"{EVAL_PROMPTS} held-out prompts. Batch reward: the completions trained on (sampled by the lagged behaviour "
        "policy). The mask / ratio / lag columns are per-step means over the run: fractions of loss tokens ('masked "
        "tokens', 'tok < low', 'tok > high') or of sequences ('masked seqs', 'geo out'); 'max ratio' is the largest "
        "token ratio seen. '-': k = 0 runs TRL's own loss. All columns are means over the seeds. CPU s = CPU seconds "
        "of the run on a shared 2-core machine.\n\n"
        f"{table}\n\n![policy reward, batch reward, log-ratio and masked fraction per step](offpolicy.png)\n"
    )
    (RESULTS / "offpolicy.md").write_text(text)
    plot(saved, marks)
    print(table)


def plot(saved: dict, marks: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(22, 4.8))
    colours = {"k0": "black", "k1": "tab:blue", "k4": "tab:orange", "k16": "tab:red"}
    for name in [n for n in RUNS if n in saved]:
        seeds = list(saved[name].values())
        colour = "tab:green" if "inflight" in name else colours[name.split("_")[0]]
        style = ":" if "inflight" in name else "--" if name.endswith("nomask") else "-"
        policy = [mean([r["policy_reward"][str(s)] for r in seeds]) for s in marks]
        axes[0].plot(marks, policy, style, marker="o", color=colour, label=name)
        steps = seeds[0]["steps"]
        batch = [mean([window(r["reward"], i + 1) for r in seeds]) for i in range(len(steps))]
        axes[1].plot(steps, batch, style, color=colour, label=name)
        if name != "k0":
            for ax, key in ((axes[2], "offpolicy/abs_log_ratio_mean"), (axes[3], "offpolicy/masked_frac")):
                ax.plot(steps, [mean([r[key][i] for r in seeds]) for i in range(len(steps))], style, color=colour)
    axes[0].set(title="policy reward (held-out prompts)", xlabel="optimizer step", ylabel="happy_binary")
    axes[1].set(title="batch reward (10-step mean, behaviour policy)", xlabel="step")
    axes[2].set(title="mean |log ratio| trainer vs behaviour", xlabel="step", yscale="log")
    axes[3].set(title="fraction of loss tokens masked", xlabel="step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "offpolicy.png", dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", default="1e-3")
    ap.add_argument("--seeds", default="42", help="comma-separated seeds")
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    ap.add_argument("--report", action="store_true", help="only rebuild the table and plot from offpolicy.json")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    store = RESULTS / "offpolicy.json"
    saved = json.loads(store.read_text()) if store.is_file() else {}
    if not args.report:
        names = [n for n in args.only.split(",") if n] or list(RUNS)
        unknown = [n for n in names if n not in RUNS]
        if unknown:
            raise SystemExit(f"unknown runs {unknown}; runs: {', '.join(RUNS)}")
        for seed in [int(s) for s in args.seeds.split(",")]:
            for name in names:
                print(f"=== {name} seed {seed} (load average {os.getloadavg()[0]:.2f})", flush=True)
                saved.setdefault(name, {})[str(seed)] = train_one(name, args.steps, args.lr, seed)
                store.write_text(json.dumps(saved, indent=1))
    report(saved, args.steps, args.lr)


if __name__ == "__main__":
    main()
