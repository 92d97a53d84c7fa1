"""The comparisons the experiment pages (docs/experiments/) state, each with both sides' mean ± standard error and n,
the difference with its standard error (paired by seed where the seeds pair), that difference in standard errors,
and the verdict of the reports' rule (experiments/stats.py): an effect only at 2 standard errors or more, else "no
measurable difference"; counts (runs that ended invalid) by Fisher's exact test, an effect at p < 0.05.

    uv run python experiments/effects.py

Reads only what the experiment scripts already wrote under experiments/results/ (no model, no training): the
off-policy studies' JSON (offpolicy_study, offpolicy_search, offpolicy_search_gpu, offpolicy_search_first_build,
offpolicy), distill.json, the raw JSON block of environments.md, and the per-seed (or per-cell) tables of
math_learns*.md, routing*.md, routing_env_*.md and distill_env.md. Writes experiments/results/effects_{offpolicy,
routing,distillation,environments}.md, one table per study between snippet section markers (the pages include
``effects_<page>.md:<section>``).

Where the result files keep no per-seed pairing (routing_arms*.md keep the median and range of 3 seeds, which are
the 3 values but not which seed gave which), the difference is unpaired. Where a study ran one seed, the standard
error is the binomial one of a rate over its evaluation prompts (sqrt(p (1 - p) / n)): it covers the evaluation's
sampling, not the spread between training seeds, which one seed cannot measure.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, when imported by path (tests)

from effects_rows import (  # noqa: E402
    against,
    md_tables,
    paired,
    rates,
    read,
    RESULTS,
    section,
    st,
    three,
    unpaired,
)
from effects_offpolicy import (  # noqa: E402
    offpolicy_page,
)


# --- gradient routing -------------------------------------------------------------------------------------------------


def routing_page() -> list[str]:
    one = read("routing.md")
    n = int(re.search(r"Final routing eval on (\d+) held-out prompts", one).group(1))
    t = {(r["arm"], r["mode"]): r for r in md_tables(one)[0]}
    hk, task = "hack rate (happy detector)", "task reward (sentence_length_5)"
    rate = lambda arm, mode: float(t[(arm, mode)][hk])  # noqa: E731
    base = ("base model (no adapters)", "-")
    one_seed = [
        rates("R1", "hack rate: routed retain_only vs base model", rate("routed", "retain_only"), n, rate(*base), n),
        rates("R2", "hack rate: routed both vs baseline both", rate("routed", "both"), n, rate("baseline", "both"), n),
        rates("R3", "hack rate: routed retain_only vs routed both", rate("routed", "retain_only"), n,
              rate("routed", "both"), n),
    ]

    def cells(name: str) -> dict[tuple[str, str], dict[str, list[float]]]:
        rows = md_tables(read(name))[0]
        return {(r["arm"], r["mode"]): {hk: three(r[hk]), task: three(r[task])} for r in rows}

    c, r5 = cells("routing_arms.md"), cells("routing_arms_recall0.5.md")
    arms = [
        unpaired("R4", "hack rate: plain LoRA both vs base model (plain LoRA forget_only)",
                 c[("plain_lora", "both")][hk],
                 c[("plain_lora", "forget_only")][hk]),
        *[unpaired(f"R{5 + i}", f"hack rate, both: {arm} vs plain LoRA", c[(arm, "both")][hk],
                   c[("plain_lora", "both")][hk]) for i, arm in enumerate(("routed", "filter", "reward_penalty"))],
        unpaired("R8", "hack rate: routed both vs base model", c[("routed", "both")][hk],
                 c[("plain_lora", "forget_only")][hk]),
        unpaired("R9", "hack rate: routed retain_only vs routed both", c[("routed", "retain_only")][hk],
                 c[("routed", "both")][hk]),
        *[unpaired(f"R{10 + i}", f"task reward: {arm} retain_only vs both", c[(arm, "retain_only")][task],
                   c[(arm, "both")][task]) for i, arm in enumerate(("routed", "filter", "reward_penalty"))],
        unpaired("R18", "hack rate: routed retain_only vs base model", c[("routed", "retain_only")][hk],
                 c[("plain_lora", "forget_only")][hk]),
        unpaired("R19", "hack rate: routed retain_only vs plain LoRA both", c[("routed", "retain_only")][hk],
                 c[("plain_lora", "both")][hk]),
    ]
    recall = [
        unpaired("R13", "recall 0.5, hack rate: routed retain_only vs routed both", r5[("routed", "retain_only")][hk],
                 r5[("routed", "both")][hk]),
        unpaired("R14", "recall 0.5, hack rate, both: routed vs plain LoRA", r5[("routed", "both")][hk],
                 r5[("plain_lora", "both")][hk]),
        unpaired("R15", "recall 0.5, hack rate, both: filter vs plain LoRA", r5[("filter", "both")][hk],
                 r5[("plain_lora", "both")][hk]),
        unpaired("R16", "recall 0.5, hack rate, both: reward penalty vs filter", r5[("reward_penalty", "both")][hk],
                 r5[("filter", "both")][hk]),
        unpaired("R17", "hack rate, routed retain_only: recall 0.5 vs recall 1", r5[("routed", "retain_only")][hk],
                 c[("routed", "retain_only")][hk]),
        unpaired("R20", "recall 0.5, hack rate, both: reward penalty vs plain LoRA", r5[("reward_penalty", "both")][hk],
                 r5[("plain_lora", "both")][hk]),
        unpaired("R21", "recall 0.5, hack rate: routed retain_only vs plain LoRA both",
                 r5[("routed", "retain_only")][hk],
                 r5[("plain_lora", "both")][hk]),
    ]
    note = ("routing_arms*.md keep the median and range of seeds 1, 2, 3 per cell, i.e. its three values, but not "
            "which seed gave which: these differences are unpaired.")
    return (section("one_seed", "Routed vs baseline, one seed (binomial SE over the held-out prompts)", one_seed)
            + section("arms", "Routing vs the baseline arms, perfect labels (3 seeds)", arms, note)
            + section("recall", "Half the hacks unlabelled (recall 0.5, 3 seeds)", recall, note))  # fmt: skip


# --- context distillation ---------------------------------------------------------------------------------------------


def distillation_page() -> list[str]:
    d = json.loads(read("distill.json"))
    n = int(re.search(r"fraction of (\d+) held-out prompts", read("distill.md")).group(1))
    m, runs = d["models"], d["runs"]
    r = lambda name: runs[name]["heldout_happy"]  # noqa: E731
    mood = [
        rates("D1", "builtin: teacher (context) vs student (happy rate)", m["builtin"]["teacher_happy"], n,
              m["builtin"]["student_happy"], n),
        rates("D2", "builtin_mood: teacher vs student", m["builtin_mood"]["teacher_happy"], n,
              m["builtin_mood"]["student_happy"], n),
        rates("D3", "pure distillation, 40 steps vs the student before training", r("pure distillation"), n,
              m["builtin_mood"]["student_happy"], n),
        rates("D4", "pure distillation, 160 steps vs the teacher", r("pure distillation, 160 steps"), n,
              m["builtin_mood"]["teacher_happy"], n),
        rates("D5", "hybrid (taus 1) vs pure distillation, 40 steps", r("hybrid"), n, r("pure distillation"), n),
        rates("D6", "hybrid, gated KL vs pure task RL", r("hybrid, gated KL"), n, r("pure task RL"), n),
        rates("D7", "token-level KL vs pure task RL", r("token-level KL"), n, r("pure task RL"), n),
        rates("D8", "hybrid, gated KL vs the teacher", r("hybrid, gated KL"), n, m["builtin_mood"]["teacher_happy"], n),
        rates("D9", "token-level KL vs the teacher", r("token-level KL"), n, m["builtin_mood"]["teacher_happy"], n),
    ]
    env = read("distill_env.md")
    k = int(re.search(r"(\d+) held-out maps", env).group(1))
    rows = {row["model"]: row for row in md_tables(env)[0]}
    sg = lambda model, col: [float(x) for x in re.findall(r"\d+\.\d+", rows[model][col])]  # noqa: E731
    stu, tea = "student (no hint): sampled / greedy", "teacher (hint): sampled / greedy"
    first = re.search(r"teacher (\d\.\d+) / (\d\.\d+) against student (\d\.\d+) /\s*(\d\.\d+)", env)
    ft, fs = (float(first.group(1)), float(first.group(2))), (float(first.group(3)), float(first.group(4)))
    envrows = []
    for i, (j, mode) in enumerate(((0, "sampled"), (1, "greedy"))):
        envrows += [
            rates(f"D{10 + 5 * i}", f"builtin_env: teacher (hint) vs student, {mode}", sg("builtin_env (no fine-tune)",
                  tea)[j], k, sg("builtin_env (no fine-tune)", stu)[j], k),
            rates(f"D{11 + 5 * i}", f"hint model: teacher vs student, {mode}", sg("hint model, step 0", tea)[j], k,
                  sg("hint model, step 0", stu)[j], k),
            rates(f"D{12 + 5 * i}", f"student after 80 steps of distillation vs before, {mode}",
                  sg("pure distillation, step 80", stu)[j], k, sg("hint model, step 0", stu)[j], k),
            rates(f"D{13 + 5 * i}", f"student after 80 steps vs the teacher, {mode}", sg("pure distillation, step 80",
                  stu)[j], k, sg("hint model, step 0", tea)[j], k),
            rates(f"D{14 + 5 * i}", f"first fine-tune (loss on every token): teacher vs student, {mode}", ft[j], k,
                  fs[j], k),
        ]
    return (section("mood", "builtin_mood (one seed per configuration; 256 held-out prompts)", mood)
            + section("frozenlake", "FrozenLake (one seed; 200 held-out maps)", envrows))  # fmt: skip


# --- environments -----------------------------------------------------------------------------------------------------


def per_seed_rows(name: str) -> list[dict[str, str]]:
    """The per-seed table (first table with a 'seed' column) of a result file."""
    return next(t for t in md_tables(read(name)) if t and "seed" in t[0])


def math_learns(name: str) -> dict[str, dict[str, dict[str, float]]]:
    """arm -> seed -> {greedy_before, sampled_before, greedy_after, sampled_after} from math_learns*.md."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in per_seed_rows(name):
        gb, sb = (float(x) for x in re.findall(r"\d+\.\d+", r["before"])[:2])
        ga, sa = (float(x) for x in re.findall(r"\d+\.\d+", r["after"])[:2])
        out.setdefault(r["arm"], {})[r["seed"]] = {"greedy_before": gb, "sampled_before": sb, "greedy_after": ga,
                                                   "sampled_after": sa}  # fmt: skip
    return out


def best_constant(name: str) -> float:
    return float(re.search(r"Best constant answer on these levels: (\d\.\d+)", read(name)).group(1))


def environments_page() -> list[str]:
    text = read("environments.md")
    raw = json.loads(re.search(r"```json\n(.*?)\n```", text, re.S).group(1))
    n_maps = raw["frozenlake_base"]["non-slippery"]["greedy"]["levels"]
    n_bandit = int(re.search(r"(\d+) held-out seeds", text).group(1))
    sft = raw["frozenlake_sft"]
    fl = lambda ice, mode: [sft[s][ice][mode]["success_rate"] for s in sorted(sft)]  # noqa: E731
    base = lambda ice, mode: raw["frozenlake_base"][ice][mode]["success_rate"]  # noqa: E731
    b_se = lambda p: st.binomial_se(p, n_maps)  # noqa: E731
    oracle = raw["frozenlake_oracle"]
    ragen = [
        against("E1", "FrozenLake non-slippery, greedy: after SFT vs before", fl("non-slippery", "greedy"),
                base("non-slippery", "greedy"), "before, greedy, same maps"),
        against("E2", "FrozenLake slippery, greedy: after SFT vs before", fl("slippery", "greedy"),
                base("slippery", "greedy"), "before, same maps, binomial", b_se(base("slippery", "greedy"))),
        against("E3", "FrozenLake slippery, greedy: after SFT vs the BFS-move oracle", fl("slippery", "greedy"),
                oracle["slippery"], "oracle, n=400, binomial", b_se(oracle["slippery"])),
        against("E4", "FrozenLake non-slippery, greedy: after SFT vs the BFS-move oracle",
                fl("non-slippery", "greedy"), oracle["non-slippery"], "oracle, deterministic, same maps"),
        against("E5", "bandit: share of the high-risk arm (dragon), after 30 steps vs before",
                [v["high"] for v in raw["bandit_after"].values()], raw["bandit_before"]["high"],
                "before, n=200, binomial",
                st.binomial_se(raw["bandit_before"]["high"], n_bandit)),
        against("E6", "bandit, names swapped: share of the high-risk arm (phoenix), after vs before",
                [v["high"] for v in raw["bandit_swapped_after"].values()], raw["bandit_swapped_before"]["high"],
                "before, n=200, binomial", st.binomial_se(raw["bandit_swapped_before"]["high"], n_bandit)),
    ]
    small, default = "math_learns.md", "math_learns_default_sft4096_st600.md"
    ms, md = math_learns(small), math_learns(default)
    col = lambda arms, arm, key, seeds=None: {s: v[key] for s, v in arms[arm].items()  # noqa: E731
                                               if seeds is None or s in seeds}
    arith = [
        paired("A1", "small operands, GRPO from builtin_env: greedy after vs before", col(ms, "rl", "greedy_after"),
               col(ms, "rl", "greedy_before")),
        paired("A2", "small operands, SFT then GRPO: greedy after vs before", col(ms, "sft_rl", "greedy_after"),
               col(ms, "sft_rl", "greedy_before")),
        paired("A3", "small operands, greedy after: SFT then GRPO vs GRPO from builtin_env (same seeds)",
               col(ms, "sft_rl", "greedy_after"), col(ms, "rl", "greedy_after")),
        against("A4", "small operands, GRPO from builtin_env, greedy after vs the best constant answer",
                list(col(ms, "rl", "greedy_after").values()), best_constant(small), "best constant",
                b_digits=4),
        against("A5", "as A4, seeds 1 and 2 only (the learning rate was chosen on seed 0)",
                list(col(ms, "rl", "greedy_after", {"1", "2"}).values()), best_constant(small), "best constant",
                b_digits=4),
        paired("A6", "default operands, GRPO from builtin_env: greedy after vs before", col(md, "rl", "greedy_after"),
               col(md, "rl", "greedy_before")),
        against("A7", "default operands, GRPO from builtin_env, greedy after vs the best constant answer",
                list(col(md, "rl", "greedy_after").values()), best_constant(default), "best constant",
                b_digits=4),
        paired("A8", "default operands, SFT then GRPO: greedy after vs before", col(md, "sft_rl", "greedy_after"),
               col(md, "sft_rl", "greedy_before")),
        paired("A9", "default operands, SFT then GRPO: sampled after vs before", col(md, "sft_rl", "sampled_after"),
               col(md, "sft_rl", "sampled_before")),
    ]

    def env_runs(name: str) -> dict[str, dict[str, dict[str, float]]]:
        out: dict[str, dict[str, dict[str, float]]] = {}
        for r in per_seed_rows(name):
            out.setdefault(r["arm"], {})[r["seed"]] = {k: float(v) for k, v in r.items()
                                                       if re.fullmatch(r"-?\d+\.\d+", v)}  # fmt: skip
        return out

    base_name = "routing_env_lr1e-3_bs32_st300_operand4_factor3"
    e1, e5 = env_runs(f"{base_name}.md"), env_runs(f"{base_name}_recall0.5.md")
    ex = env_runs(f"{base_name}_exclusive.md")
    e6 = env_runs("routing_env_lr3e-3_bs32_st600.md")
    v = lambda runs, arm, key: {s: r[key] for s, r in runs[arm].items()}  # noqa: E731
    routing = [
        paired("X1", "hack rate: baseline (trained) vs its forget_only (the base model)",
               v(e1, "baseline", "both hack"),
               v(e1, "baseline", "forget_only hack")),
        paired("X2", "retain_only hack rate: routed vs baseline", v(e1, "routed", "retain_only hack"),
               v(e1, "baseline", "retain_only hack")),
        paired("X3", "honest success: routed retain_only vs the base model", v(e1, "routed", "retain_only success"),
               v(e1, "baseline", "forget_only success")),
        paired("X4", "honest success: routed both vs the base model", v(e1, "routed", "both success"),
               v(e1, "baseline", "forget_only success")),
        paired("X5", "recall 0.5, hack rate: routed both vs baseline both", v(e5, "routed", "both hack"),
               v(e5, "baseline", "both hack")),
        paired("X6", "recall 0.5, hack rate: routed retain_only vs baseline", v(e5, "routed", "retain_only hack"),
               v(e5, "baseline", "retain_only hack")),
        paired("X7", "exclusive, hack rate: routed both vs baseline both", v(ex, "routed", "both hack"),
               v(ex, "baseline", "both hack")),
        paired("X8", "exclusive, hack rate: routed retain_only vs routed both", v(ex, "routed", "retain_only hack"),
               v(ex, "routed", "both hack")),
        paired("X9", "default operands (lr 3e-3, 600 steps), hack rate: baseline vs its forget_only",
               v(e6, "baseline", "both hack"), v(e6, "baseline", "forget_only hack")),
        paired("X10", "default operands, retain_only hack rate: routed vs baseline",
               v(e6, "routed", "retain_only hack"),
               v(e6, "baseline", "retain_only hack")),
        paired("X11", "default operands, honest success: routed retain_only vs the base model",
               v(e6, "routed", "retain_only success"), v(e6, "baseline", "forget_only success")),
    ]
    return (section("ragen", "RAGEN tasks (3 training seeds against one measurement before training)", ragen)
            + section("arithmetic", "Arithmetic that learns (3 seeds, paired by seed)", arith)
            + section("routing", "Routing on environments: a hackable grader (seeds 42, 43, 44, paired)", routing))


# --- report -----------------------------------------------------------------------------------------------------------

PAGES = {"offpolicy": offpolicy_page, "routing": routing_page, "distillation": distillation_page,
         "environments": environments_page}  # fmt: skip


def header(page: str) -> list[str]:
    return [f"# Effects: {page} (generated)", "",
            "Generated by `uv run python experiments/effects.py` from the result files of experiments/results/ (no "
            "training). A and B: mean ± standard error (n = seeds or runs; for one seed, the binomial SE of a rate "
            "over n evaluation items). A - B: paired by seed where the seeds pair, else unpaired (SE = sqrt(SE_A^2 + "
            "SE_B^2)). ±2 SE interval: A - B ± 2 SE. In SE: |A - B| / SE. Verdict: an effect at 2 SE or more, else "
            "no measurable difference, and no verdict on fewer than 3 values; counts of runs by Fisher's exact test "
            "(two-sided), an effect at p < 0.05. Values read from a table are its printed (rounded) values, so a "
            "difference can differ from the source table's in the last digit.", ""]  # fmt: skip


def render(page: str) -> str:
    """The text of experiments/results/effects_<page>.md."""
    return "\n".join(header(page) + PAGES[page]())


def main() -> None:
    for page in PAGES:
        (RESULTS / f"effects_{page}.md").write_text(render(page))
        print(f"wrote experiments/results/effects_{page}.md")


if __name__ == "__main__":
    main()
