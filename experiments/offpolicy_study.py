"""The off-policy study in miniature (seed 000): how a strict policy lag k hurts GRPO without masks, and what the
default masks, TIS (token_clip_high), MIS (token mask windows) and kl_tau do at k = 16; on single-turn math and on
multi-turn search (``--task math|search``).

Every run is a train.py run planned by a sweep file (one per command group, resumable, each reproducible alone);
TASK is math or search:

    uv run sweep.py --config sweeps/offpolicy_TASK_calibration.yaml   # the premise: k = 16 without masks vs k = 0
    uv run sweep.py --config sweeps/offpolicy_TASK_lag_nomask.yaml    # k in {0, 1, 4, 8, 16, 32, 64}, masks off
    uv run sweep.py --config sweeps/offpolicy_TASK_defaults.yaml      # default masks: strict 1/8/16, in-flight 1/4
    uv run sweep.py --config sweeps/offpolicy_TASK_k16_rescues.yaml   # TIS, MIS, kl_tau, MIS + kl_tau at k = 16
    uv run sweep.py --config sweeps/offpolicy_TASK_kl_long_lag.yaml   # kl_tau 1e-3 / 1e-2 at k = 32 and 64
    uv run python experiments/offpolicy_study.py --task TASK   # table and plot from the run directories

``--task search_gpu`` is the search study's replication on one GPU: one command group,
``offpolicy_search_gpu_replication`` (k = 0 against strict k = 16 without masks, with the default masks and with
kl_tau 1). ``--jobs N`` evaluates the checkpoints in N processes.

Math is experiments/math_learns.py's "rl" arm (arithmetic with small operands from builtin_env, 600 GRPO steps, batch 32
x 8 generations, beta 0, fast backend) at lr 2e-4, twice its rate: the calibration group shows why (at 1e-4 k = 16
without masks is not measurably worse than k = 0). Search is the search environment (3 turns: search, read, answer; 400
pages, top 3 results) from a pinned builtin_search build (experiments/models/), 150 steps of the same batch, at the rate
its own calibration group chose. Per run: greedy success (math: accuracy) of the trained policy on N_EVAL held-out
levels at every saved checkpoint (the policy itself, not the lagged batch; search's held-out levels ask about pages no
training level asks about), the batch reward and success of the logged steps (sampled by the behaviour policy, k steps
older under strict lag), and the run means of the masked and clipped fractions, mean |log r| and mismatch-KL (prime-rl's
k3 estimate of KL(behaviour || trainer)). Arms are mean ± standard error over seeds. A run that did not finish (e.g.
stopped on a non-finite loss) is listed with its status and counted in no mean. Evaluations are cached in the task's
output directory (evals.json). A planned run whose directory is not on this machine is read from the previous report's
JSON (``merge``), so a study can be continued on a new machine; ``--groups`` previews a subset.

Writes experiments/results/offpolicy_{study,search}.md (tables, and the lag trend: the least-squares slope of
success per doubling of k + 1 over the lag group's runs), .json (per run: values, status, held-out curve,
batch windows, run means) and .png (math: offpolicy_study.*, search: offpolicy_search.*). Each table's last column is
the paired Δ in standard errors with experiments/stats.py's verdict (an effect at 2 SE or more); each table and the
lag trend sit between snippet section markers (the docs include ``offpolicy_search.md:<group>``). Where the task pins
its starting model (search), the report evaluates it once as "step 0" (cached like a checkpoint) and keeps the value
under the JSON's ``_start`` key.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # set before torch loads: spinning threads crawl on shared cores
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import argparse  # noqa: E402
import importlib.util
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SWEEPS = ROOT / "sweeps"
RESULTS = ROOT / "experiments" / "results"
N_EVAL = 400
GROUP_KINDS = ("calibration", "lag_nomask", "defaults", "k16_rescues", "kl_long_lag")


@dataclass(frozen=True)
class Task:
    """One task of the study: its sweep groups (``offpolicy_{name}_{kind}``), run outputs and held-out evaluation."""

    name: str
    title: str  # the report's heading
    env: str
    env_params: dict
    max_turns: int
    max_new_tokens: int  # per turn, as in training (--max_completion_length)
    window: int  # logged steps in (s - window, s] give the batch reward / success "at s"
    out: str  # the sweeps' output_dir (evals.json is cached there)
    results: str  # experiments/results/{results}.md, .json, .png
    metric: str  # what the held-out success is called ("accuracy" for single answers)
    kinds: tuple[str, ...] = GROUP_KINDS  # its command groups: sweeps/offpolicy_{name}_{kind}.yaml
    device: str = "CPU"  # where its runs trained (the report's heading)
    start: str | None = None  # the committed model every run starts from, evaluated as "step 0" (None: not pinned)

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(f"offpolicy_{self.name}_{kind}" for kind in self.kinds)

    @property
    def evals(self) -> Path:
        return ROOT / self.out / "evals.json"


SEARCH = Task("search", "search, 3 turns, builtin_search build 7693a12a", "search", {"k": 3, "n_pages": 400}, 3, 24,
              50, "output/offpolicy_search", "offpolicy_search", "success",
              start="experiments/models/builtin_search-7693a12a")  # fmt: skip
TASKS = {t.name: t for t in (
    Task("math", "arithmetic, small operands, builtin_env", "arithmetic", {"max_operand": 4, "max_factor": 3}, 1, 16,
         100, "output/offpolicy_study", "offpolicy_study", "accuracy"),
    SEARCH,
    replace(SEARCH, name="search_gpu", out="output/offpolicy_search_gpu", results="offpolicy_search_gpu",
            kinds=("replication",), device="one GPU", start=None),
)}  # fmt: skip
INVALID = {"arithmetic": "answers that are not an integer in the answer format",
           "search": "turns whose action is not search, read (a known title) or answer"}  # fmt: skip
BATCH = {"success": "env/success", "reward": "reward", "invalid": "env/invalid_frac"}  # logged, windowed at the end
COLLAPSED = 0.5  # "ended invalid": at least this share of invalid answers over the last window of logged steps
RUN_MEANS = ("masked_frac", "token_clipped_frac", "abs_log_ratio_mean", "mismatch_kl")
NO_MASK = {"token_mask_low": "0", "token_mask_high": "1e10", "sequence_mask_low": "0", "sequence_mask_high": "1e10",
           "geo_mask_low": "0", "geo_mask_high": "1e10", "sequence_clip_high": "1e10"}  # fmt: skip


def _load(name: str):
    """A module of experiments/ (not a package) by file name."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ml = _load("math_learns")  # mean_se, fmt, evaluate, checkpoints: one definition for both math experiments
stats = _load("stats")  # the reports' standard: SE units and the 2 SE verdict
_archive = _load("offpolicy_archive")  # the summaries of runs whose directories were on other machines
archived, merge, start_weights_line = _archive.archived, _archive.merge, _archive.start_weights_line


# --- pure: arms, windows, aggregation (tests/test_offpolicy_study.py) ----------------------------------------------


def arm_of(values: dict[str, str]) -> str:
    """The arm of a run from its sweep values (seed left out): lag, strictness, the masks (seed 000's "no mask"
    flags, the token mask window alone over them = MIS, or the defaults), then TIS and kl_tau."""
    k = values["max_async_level"]
    lr = f", lr {values['learning_rate']}" if "learning_rate" in values else ""
    if k == "0":
        return f"k=0 sync{lr}"
    mode = "strict" if values.get("strict_async_level", "").lower() == "true" else "in-flight"
    token = ("token_mask_low", "token_mask_high")
    others = {f: v for f, v in NO_MASK.items() if f not in token}
    window = tuple(values.get(f, NO_MASK[f]) for f in token)
    if all(values.get(f) == v for f, v in others.items()):
        masks = "no masks" if window == tuple(NO_MASK[f] for f in token) else f"MIS [{window[0]}, {window[1]}]"
    elif not any(f in values for f in NO_MASK):
        masks = "default masks"
    else:
        masks = "masks " + ", ".join(f"{f} {values[f]}" for f in NO_MASK if f in values)
    extra = [f"TIS {values['token_clip_high']}"] if "token_clip_high" in values else []
    extra += [f"kl_tau {values['kl_tau']}"] if "kl_tau" in values else []
    return f"k={k} {mode}, {' + '.join([masks, *extra])}{lr}"


def window_mean(logs: list[dict], key: str, end: int, width: int) -> float | None:
    """Mean of ``key`` over the log entries with step in (end - width, end]; None when there is none."""
    vals = [h[key] for h in logs if end - width < h["step"] <= end and key in h]
    return sum(vals) / len(vals) if vals else None


def run_mean(logs: list[dict], key: str) -> float | None:
    vals = [h[key] for h in logs if key in h]
    return sum(vals) / len(vals) if vals else None


def cell(values: list[float | None]) -> str:
    """mean ± SE over the seeds that have the value; '-' when none has it, the count when some lack it."""
    have = [v for v in values if v is not None]
    if not have:
        return "-"
    text = f"{have[0]:.3f}" if len(have) == 1 else ml.fmt(have)
    return text if len(have) == len(values) else f"{text} (n={len(have)})"


def paired_deltas(runs: list[dict], reference: list[dict], step: int) -> list[float]:
    """Held-out success at ``step`` minus the reference arm's, paired by seed (seeds both arms have at that step)."""
    ref = {r["values"]["seed"]: r["heldout"][step] for r in reference if step in r["heldout"]}
    return [r["heldout"][step] - ref[r["values"]["seed"]] for r in runs
            if step in r["heldout"] and r["values"]["seed"] in ref]  # fmt: skip


def ols_slope(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ys on xs and its standard error, sqrt(SSE / (n - 2) / Sxx) (any regression text, e.g.
    Wasserman, All of Statistics, 13.1); needs 3 or more points and two distinct xs."""
    n = len(xs)
    if n < 3 or len(set(xs)) < 2:
        raise ValueError(f"a slope with a standard error needs >= 3 points at >= 2 distinct x, got {n}")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    sse = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    return slope, (sse / (n - 2) / sxx) ** 0.5


def lag_trend(arms: dict[str, list[dict]], key) -> tuple[float, float, int] | None:
    """Slope of ``key(run)`` per doubling of k + 1 (x = log2(k + 1)) over the finished runs of k = 0 and strict k
    without masks (the main learning rate), its SE and the number of runs; None below 3 runs or 2 lags."""
    lag = [(math.log2(int(a.split()[0][2:]) + 1), done) for a, done in arms.items()
           if a == "k=0 sync" or a.endswith(" strict, no masks")]  # fmt: skip
    pts = [(x, v) for x, done in lag for r in done if (v := key(r)) is not None]
    if len(pts) < 3 or len({x for x, _ in pts}) < 2:
        return None
    return (*ols_slope([x for x, _ in pts], [y for _, y in pts]), len(pts))


def reference_arm(arm: str) -> str:
    """The synchronous arm an arm is compared with: k = 0 at the same learning rate."""
    return "k=0 sync" + (arm[arm.index(", lr "):] if ", lr " in arm else "")


# --- run directories ------------------------------------------------------------------------------------------------


def planned(group: str):
    from trl_ext.sweep import SweepArgs
    from trl_ext.sweep_plan import build_spec, plan_runs

    return plan_runs(build_spec(SweepArgs(config=str(SWEEPS / f"{group}.yaml"))))


def heldout_success(task: Task, ckpt: Path, n_eval: int) -> float:
    """Greedy success of a checkpoint on the first ``n_eval`` held-out levels (math: experiments/math_learns.py's
    evaluation; otherwise ``trl_ext.sft.validate``, the SFT mode's held-out rollouts)."""
    if task.env == "arithmetic":
        return ml.evaluate(str(ckpt), task.env_params, n_eval, modes=("greedy",))["greedy"]
    from trl_ext.models import load_model_and_tokenizer
    from trl_ext.sft import validate

    model, tok = load_model_and_tokenizer(str(ckpt))
    return validate(model, tok, task.env, n_eval, task.max_turns, task.max_new_tokens,
                    env_params=task.env_params)["success_rate"]  # fmt: skip


def run_path(run) -> Path:
    return ROOT / run.run_dir if not Path(run.run_dir).is_absolute() else Path(run.run_dir)


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of a run's checkpoints that were written to the end (``trl_ext.runs.checkpoints``), by step."""
    from trl_ext.runs.checkpoints import list_checkpoints

    return [(step, path) for step, path, complete in list_checkpoints(run_dir) if complete]


def eval_key(ckpt: Path, n_eval: int) -> str:
    """The evaluation cache's key (evals.json): the checkpoint relative to the repository, and the level count."""
    return f"{ckpt.relative_to(ROOT)}|{n_eval}"


def pending(runs, evals: dict, n_eval: int) -> dict[str, Path]:
    """The complete checkpoints of ``runs`` that the cache ``evals`` has no evaluation of, by cache key."""
    todo = {eval_key(c, n_eval): c for run in runs for _, c in complete_checkpoints(run_path(run))}
    return {key: c for key, c in todo.items() if key not in evals}


def _evaluate_one(job: tuple[str, str, int]) -> float:
    """``heldout_success`` in a worker process of ``evaluate_pending`` (one torch thread each)."""
    import torch

    torch.set_num_threads(1)
    name, ckpt, n_eval = job
    return heldout_success(TASKS[name], Path(ckpt), n_eval)


def _cache(task: Task, evals: dict, key: str, value: float, done: int, total: int) -> None:
    evals[key] = value
    task.evals.write_text(json.dumps(evals, indent=1))
    print(f"[evaluate] {done}/{total} {key}: {value:.3f}", flush=True)


def evaluate_pending(task: Task, todo: dict[str, Path], evals: dict, n_eval: int, jobs: int) -> None:
    """Evaluate the pending checkpoints ``todo`` (in this process, or in ``jobs`` spawned ones), caching each result
    in ``evals`` and evals.json as it arrives (an interrupted report keeps what it finished)."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from multiprocessing import get_context

    if jobs == 1:
        for done, (key, ckpt) in enumerate(todo.items(), 1):
            _cache(task, evals, key, heldout_success(task, ckpt, n_eval), done, len(todo))
        return

    # A spawned worker imports this module by the name it has here: __main__ as a script, else "offpolicy_study"
    # (the tests'), which it finds on the sys.path it copies from this process when it starts.
    here = str(Path(__file__).resolve().parent)
    added = here not in sys.path
    if added:
        sys.path.append(here)
    try:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(_evaluate_one, (task.name, str(c), n_eval)): key for key, c in todo.items()}
            for done, fut in enumerate(as_completed(futures), 1):
                _cache(task, evals, futures[fut], fut.result(), done, len(todo))
    finally:
        if added:
            sys.path.remove(here)


def run_record(run, evals: dict, n_eval: int) -> dict:
    """Status, logs and held-out greedy success (from ``evals``, filled by ``evaluate_pending``) at each complete
    checkpoint of one planned run."""
    from trl_ext.runs.checkpoints import latest_complete
    from trl_ext.runs.provenance import read_start_weights, start_id

    run_dir = run_path(run)
    summary = run_dir / "run_summary.json"
    status = json.loads(summary.read_text()).get("status") if summary.is_file() else "not finished"
    start = read_start_weights(run_dir)  # a distillation run's teacher is part of its start (provenance.start_id)
    rec = {"dir": run_dir.name, "values": run.values, "status": status, "logs": [], "heldout": {},
           "start_weights": None if start is None else start_id(start)}  # fmt: skip
    last = latest_complete(run_dir) if run_dir.is_dir() else None
    if last is None:
        return rec
    rec["logs"] = [h for h in json.loads((last / "trainer_state.json").read_text())["log_history"] if "reward" in h]
    for step, ckpt in complete_checkpoints(run_dir):
        if (key := eval_key(ckpt, n_eval)) in evals:
            rec["heldout"][step] = evals[key]
        else:  # completed after the evaluation pass (a run still training): the next report evaluates it
            print(f"[evaluate] {key}: completed after the evaluation pass, left out of this report", flush=True)
    return rec


def run_summary(rec: dict, end: int, width: int) -> dict:
    """What the JSON keeps of a run: its values, status, held-out curve, the batch windows at ``end`` and the run
    means (the per-step logs stay in the run directory's trainer_state.json). The report's tables read these."""
    return {**{k: rec[k] for k in ("dir", "values", "status", "heldout", "start_weights")},
            **{f"batch_{k}@{end}": window_mean(rec["logs"], key, end, width) for k, key in BATCH.items()},
            **{k: run_mean(rec["logs"], f"offpolicy/{k}") for k in RUN_MEANS}}  # fmt: skip


# --- report ---------------------------------------------------------------------------------------------------------


def section(name: str, edge: str) -> str:
    """A snippet section marker (pymdownx.snippets: the docs include ``file.md:name``); an HTML comment elsewhere."""
    return f"<!-- --8<-- [{edge}:{name}] -->"


def arm_rows(records: list[dict]) -> list[tuple[str, list[dict], list[dict]]]:
    """(arm, finished runs, unfinished runs) in plan order."""
    arms: dict[str, tuple[list, list]] = {}
    for r in records:
        values = {k: v for k, v in r["values"].items() if k != "seed"}
        done, not_done = arms.setdefault(arm_of(values), ([], []))
        (done if r["status"] == "done" else not_done).append(r)
    return [(a, d, n) for a, (d, n) in arms.items()]


def delta_z(deltas: list[float]) -> str:
    """The paired Δ in standard errors with the reports' verdict (experiments/stats.py): '2.13 (effect)',
    '0.41 (no measurable difference)'; '-' for fewer than two pairs."""
    if len(deltas) < 2:
        return "-"
    m, se = ml.mean_se(deltas)
    return f"{stats.fmt_z(m, se)} ({stats.verdict(m, se, len(deltas))})"


def table(records: list[dict], marks: list[int], arms: dict[str, list[dict]], metric: str) -> list[str]:
    """One group's rows from the runs' summaries (``run_summary``, batch windows at ``marks[-1]``); ``arms``: every
    arm's finished runs, for the paired difference to k = 0 (last column: that difference in standard errors)."""
    short = "acc" if metric == "accuracy" else metric
    head = (["arm", "runs"] + [f"held-out {short} @{s}" for s in marks] + [f"Δ vs k=0 @{marks[-1]} (paired)"]
            + [f"batch {k} @{marks[-1]}" for k in BATCH] + ["ended invalid"]
            + ["masked tok", "clipped tok", "mean abs log r", "mismatch-KL", "Δ/SE"])  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, done, not_done in arm_rows(records):
        cells = [cell([r["heldout"].get(s) for r in done]) for s in marks]
        ref = arms.get(reference_arm(arm), [])
        deltas = [] if arm.startswith("k=0") else paired_deltas(done, ref, marks[-1])
        cells.append("-" if arm.startswith("k=0") else cell(deltas))
        cells += [cell([r[f"batch_{k}@{marks[-1]}"] for r in done]) for k in BATCH]
        invalid = [r[f"batch_invalid@{marks[-1]}"] for r in done]
        cells.append(f"{sum(v is not None and v >= COLLAPSED for v in invalid)}/{len(done)}")
        cells += [cell([r[k] for r in done]) for k in RUN_MEANS]
        cells.append(delta_z(deltas))
        runs = f"{len(done)}" + (f" (+{len(not_done)} {', '.join(sorted({r['status'] for r in not_done}))})"
                                 if not_done else "")  # fmt: skip
        lines.append(f"| {arm} | {runs} | " + " | ".join(cells) + " |")
    return lines


def final_stats(done: list[dict], step: int) -> tuple[float, float] | None:
    """Mean and SE (0 for one run) of the held-out success at ``step`` over the runs that have it."""
    vals = [r["heldout"][step] for r in done if step in r["heldout"]]
    if not vals:
        return None
    m, se = ml.mean_se(vals)
    return m, 0.0 if len(vals) == 1 else se


def plot(task: Task, by_group: dict[str, list[dict]], marks: list[int], path: Path) -> None:
    """The report's figure (experiments/offpolicy_plot.py) from every arm's held-out mean and SE at the last step."""
    end = marks[-1]
    arms = {a: done for g in by_group.values() for a, done, _ in arm_rows(g)}
    stats = {a: st for a, done in arms.items() if (st := final_stats(done, end))}
    _load("offpolicy_plot").plot(f"{task.title}, {task.device}", task.metric, stats, end, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=list(TASKS), default="math")
    p.add_argument("--groups", nargs="+", choices=[g for t in TASKS.values() for g in t.groups],
                   help="print a subset of the task's groups and write nothing (default: all, written)")  # fmt: skip
    p.add_argument("--n_eval", type=int, default=N_EVAL, help="held-out levels per evaluation")
    p.add_argument("--jobs", type=int, default=1, help="processes evaluating checkpoints at once (one thread each)")
    args = p.parse_args()
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    task = TASKS[args.task]
    groups = args.groups or list(task.groups)
    if not set(groups) <= set(task.groups):
        p.error(f"--groups of --task {task.name} are {', '.join(task.groups)}")
    import torch

    torch.set_num_threads(1)
    evals = json.loads(task.evals.read_text()) if task.evals.is_file() else {}
    task.evals.parent.mkdir(parents=True, exist_ok=True)
    plans = {g: planned(g) for g in groups}
    todo = pending([r for rs in plans.values() for r in rs], evals, args.n_eval)
    if task.start and (key := eval_key(ROOT / task.start, args.n_eval)) not in evals:
        todo[key] = ROOT / task.start  # the starting model, evaluated once like a checkpoint ("step 0")
    evaluate_pending(task, todo, evals, args.n_eval, args.jobs)
    start = evals[eval_key(ROOT / task.start, args.n_eval)] if task.start else None
    records = {g: [run_record(run, evals, args.n_eval) for run in rs] for g, rs in plans.items()}
    archive = archived(RESULTS / f"{task.results}.json")
    steps = max((max(r["heldout"]) for rs in records.values() for r in rs if r["heldout"]), default=0)
    steps = max([steps] + [max(r["heldout"]) for r in archive.values() if r["heldout"]])
    if not steps:
        p.error(f"no finished checkpoint under {task.out} yet, and none archived: run the sweeps first")
    by_group = {g: [merge(r, run_summary(r, steps, task.window), archive.get((g, r["dir"])), steps) for r in rs]
                for g, rs in records.items()}  # fmt: skip
    n_archived = sum(r.get("from_archive", False) for rs in by_group.values() for r in rs)
    marks = [steps // 3, 2 * steps // 3, steps]
    short = "acc" if task.metric == "accuracy" else task.metric
    lines = [f"# Off-policy study in miniature ({task.title}, {task.device})", "",
             f"Generated by `uv run python experiments/offpolicy_study.py --task {task.name}`; numbers as measured, "
             f"mean ± standard error over seeds. Held-out {short} @s: greedy {task.metric} of the policy after s "
             f"steps on {args.n_eval} held-out levels. Batch success / reward / invalid @{steps}: logged steps in "
             f"({steps - task.window}, {steps}], sampled by the behaviour policy (k steps older under strict lag); "
             f"invalid: the share of {INVALID[task.env]} (reward -1); ended invalid: runs with invalid >= "
             f"{COLLAPSED} there. Masked tok, clipped tok, mean abs log r and mismatch-KL: means over the run's logged "
             f"steps ('-': k = 0 runs TRL's own loss). Δ vs k=0: held-out {task.metric} minus that of k = 0 at the "
             "same learning rate and seed, mean ± SE over the seeds.", "",
             f"{n_archived} of {sum(map(len, by_group.values()))} runs are read from the previous report's "
             f"experiments/results/{task.results}.json (their run directories were on an earlier machine); the "
             "others from their run directories under " + task.out + ".", "",
             start_weights_line([r for rs in by_group.values() for r in rs]), ""]  # fmt: skip
    if start is not None:
        lines += [section("start_model", "start"),
                  f"Before RL (step 0): the starting model `{task.start}` has held-out {task.metric} {start:.3f} "
                  f"(greedy, {args.n_eval} held-out levels, evaluated by this report).",
                  section("start_model", "end"), ""]  # fmt: skip
    arms = {a: done for g in by_group.values() for a, done, _ in arm_rows(g)}
    for group, summaries in by_group.items():
        spec = (SWEEPS / f"{group}.yaml").read_text().split("needs:")[0].replace("description: >", "").split()
        lines += [f"## {group}", "", " ".join(spec), "", f"`uv run sweep.py --config sweeps/{group}.yaml`", ""]
        lines += [section(group, "start")] + table(summaries, marks, arms, task.metric) + [section(group, "end"), ""]
    trends = [(f"held-out {task.metric} @{steps}", lag_trend(arms, lambda r: r["heldout"].get(steps))),
              (f"batch success @{steps}", lag_trend(arms, lambda r: r[f"batch_success@{steps}"]))]
    if any(t for _, t in trends):
        lines += ["## Lag trend", "", section("lag_trend", "start"),
                  "Least-squares slope per doubling of k + 1 (x = log2(k + 1)) over every finished "
                  "run of k = 0 and of strict k without masks (the lag group), with its standard error (runs taken as "
                  "independent):", ""]
        lines += [f"- {name}: {t[0]:+.4f} ± {t[1]:.4f} per doubling ({t[2]} runs; "
                  f"{stats.fmt_z(t[0], t[1])} SE, {stats.verdict(t[0], t[1])})" for name, t in trends if t]
        lines += [section("lag_trend", "end"), ""]
    print("\n".join(lines))
    if args.groups:
        return  # a preview: the results files always hold every group
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{task.results}.md").write_text("\n".join(lines) + f"\n![held-out {task.metric} per step, per group]"
                                                f"({task.results}.png)\n")
    kept = {g: [{k: v for k, v in r.items() if k != "from_archive"} for r in rs] for g, rs in by_group.items()}
    if start is not None:
        kept["_start"] = {"model": task.start, "n_eval": args.n_eval, "heldout": start}
    (RESULTS / f"{task.results}.json").write_text(json.dumps(kept, indent=1))
    plot(task, by_group, marks, RESULTS / f"{task.results}.png")


if __name__ == "__main__":
    main()
