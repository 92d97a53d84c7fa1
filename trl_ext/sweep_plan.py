"""Sweep planning: grids (command line and ``sweeps/*.yaml``) -> validated train.py runs.

The Cartesian product of the grid values (a sweep file may give a list of grids: the union of their
products, for values that must move together), plus the fixed values and bare boolean flags, gives one
train.py command per run. Flag names are resolved through train.py's own parser (aliases such as ``lr``
included), so a key set twice under two names is caught; every command is validated with
``trl_ext.cli_train.build_plan`` before anything launches, which also yields the run's directory, named
by ``trl_ext.naming`` from every defining hyperparameter (fixed ones included).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import itertools
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from trl_ext.compat import option_actions
from trl_ext.registry import ConfigError

FILE_KEYS = ("description", "needs", "recipe", "reward", "grid", "fixed", "train_flags", "baselines")
# Baseline arms a routing grid can add next to each routed run (small-rl sweep.py generate_baseline_runs, HEAD
# 6f6e986): the same run without routing, plus the arm's flag. "plain" (small-rl's regular baseline) also drops
# the labels; "filter", "reward_penalty" and "retain_penalty" keep them (same eligibility, recall, false
# positives and base reward as the routed run).
BASELINE_ARMS = ("plain", "filter", "reward_penalty", "retain_penalty")
ROUTING_ONLY = ("gradient_routing", "routing_mode", "routing_two_pass", "renormalization_mode")
LABEL_ONLY = ("rh_eligible_frac", "rh_detector_recall", "false_positive_rate")


@dataclass
class SweepSpec:
    grids: list[dict[str, list[str]]]  # runs = union of the Cartesian products of these grids
    fixed: dict[str, str]
    train_flags: list[str]
    baselines: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)  # arm -> its extra flags
    recipes: list[str] = dataclasses.field(default_factory=list)  # train.py recipes every run starts from

    @property
    def keys(self) -> list[str]:
        return list(dict.fromkeys(k for g in self.grids for k in g))


@dataclass
class PlannedRun:
    index: int
    values: dict[str, str]  # this run's grid values
    argv: list[str]
    run_dir: Path

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.values.items()) or "(single run)"


def flag_dest(key: str) -> str:
    """The train.py field a flag name (or alias: lr, batch_size) sets; unknown names raise ConfigError."""
    from trl_ext.cli_train import parser

    if not isinstance(key, str) or key.startswith("-"):
        raise ConfigError(f"write train.py flag names as plain names without dashes, got {key!r}")
    action = option_actions(parser()).get(f"--{key}")
    if action is None:
        raise ConfigError(f"unknown train.py flag --{key}")
    return action.dest


def _scalar(where: str, v) -> str:
    if isinstance(v, (list, dict)) or v in ("", None):
        raise ConfigError(f"{where} needs a scalar value, got {v!r}")
    return str(v)


def _grid(where: str, grid) -> dict[str, list[str]]:
    if not isinstance(grid, dict):
        raise ConfigError(f"{where} must map flag names to value lists, got {grid!r}")
    out = {}
    for k, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where} {k!r} needs a non-empty list of values, got {values!r}")
        out[flag_dest(k)] = vals = [_scalar(f"{where} {k!r}", v) for v in values]
        if len(set(vals)) != len(vals):
            raise ConfigError(f"{where} {k!r} repeats a value: {vals}")
    return out


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"{flag} expects KEY=VALUE, got {item!r}")
        if flag_dest(key) in out:
            raise ConfigError(f"{flag} sets {key!r} twice")
        out[flag_dest(key)] = value
    return out


def load_sweep_file(path: str | Path) -> SweepSpec:
    """A named sweep YAML (``sweeps/*.yaml``)::

        description: text
        needs: [flag, ...]          # train.py flags the sweep needs (checked first, one clear error)
        recipe: FILE                # or [FILE, ...]: train.py recipes (trl_ext.runs.recipe) under every run's flags
        reward: NAME
        grid: {flag: [v, ...]}      # or a list of such grids: the union of their products (linked values)
        fixed: {flag: value}
        train_flags: [flag, ...]    # bare booleans
        baselines: [arm, ...]       # or {arm: {flag: value}}: baseline arms next to every routed run
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config sweep file does not exist: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: malformed YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict) or set(data) - set(FILE_KEYS):
        raise ConfigError(f"{path}: a mapping with keys {', '.join(FILE_KEYS)} is expected, got {data!r:.200}")
    missing = []
    for flag in data.get("needs") or []:
        try:
            flag_dest(flag)
        except ConfigError:
            missing.append(f"--{flag}")
    if missing:
        raise ConfigError(f"{path} needs train.py flags this version does not have: {', '.join(missing)}")
    grid = data.get("grid") or {}
    grids = [_grid(f"{path}: grid", g) for g in (grid if isinstance(grid, list) else [grid])]
    fixed = data.get("fixed") or {}
    if not isinstance(fixed, dict):
        raise ConfigError(f"{path}: 'fixed' must be a mapping, got {fixed!r}")
    fixed = {**({"reward": data["reward"]} if data.get("reward") is not None else {}), **fixed}
    spec = SweepSpec(grids, {}, [flag_dest(f) for f in data.get("train_flags") or []],
                     parse_baselines(f"{path}: baselines", data.get("baselines")))
    for k, v in fixed.items():
        if flag_dest(k) in spec.fixed or any(flag_dest(k) in g for g in grids):
            raise ConfigError(f"{path}: {k!r} is set twice")
        spec.fixed[flag_dest(k)] = _scalar(f"{path}: fixed {k!r}", v)
    recipe = data.get("recipe") or []
    spec.recipes = [recipe] if isinstance(recipe, str) else recipe
    if not isinstance(spec.recipes, list) or not all(isinstance(r, str) for r in spec.recipes):
        raise ConfigError(f"{path}: 'recipe' must be a file or a list of files, got {recipe!r}")
    return spec


def parse_baselines(where: str, arms) -> dict[str, dict[str, str]]:
    """``[arm, ...]`` or ``{arm: {flag: value} | None}`` -> arm -> extra flags (e.g. reward_penalty_amount)."""
    if arms is None:
        return {}
    if isinstance(arms, list):
        arms = {a: None for a in arms}
    if not isinstance(arms, dict):
        raise ConfigError(f"{where} must be a list of arms or a mapping arm -> flags, got {arms!r}")
    out = {}
    for arm, extra in arms.items():
        if arm not in BASELINE_ARMS:
            raise ConfigError(f"{where}: unknown baseline arm {arm!r}; arms: {', '.join(BASELINE_ARMS)}")
        if extra is not None and not isinstance(extra, dict):
            raise ConfigError(f"{where} {arm!r}: flags must be a mapping, got {extra!r}")
        out[arm] = {flag_dest(k): _scalar(f"{where} {arm!r} {k!r}", v) for k, v in (extra or {}).items()}
    return out


def build_spec(args) -> SweepSpec:
    """Merge the sweep file ``args.config`` (if any) with ``args.grid/fixed/reward/train_flags`` (a SweepArgs):
    a command-line key replaces the file's key (in every grid); a command-line grid is crossed with each of
    the file's grids."""
    spec = load_sweep_file(args.config) if args.config else SweepSpec([{}], {}, [])
    grid = _grid("--grid", {k: v.split(",") for k, v in _pairs(args.grid, "--grid").items()})
    fixed = _pairs(args.fixed, "--fixed")
    if args.reward is not None:
        if "reward" in fixed or "reward" in grid:
            raise ConfigError("give the reward once: --reward, or reward in --grid/--fixed")
        fixed["reward"] = args.reward
    if both := sorted(set(grid) & set(fixed)):
        raise ConfigError(f"{', '.join(both)} given both in --grid and in --fixed")
    for key in (*grid, *fixed):
        spec.fixed.pop(key, None)
        for g in spec.grids:
            g.pop(key, None)
    spec.grids = [{**g, **grid} for g in spec.grids]
    spec.fixed.update(fixed)
    if args.baselines:
        spec.baselines = parse_baselines("--baselines", list(args.baselines))
    if args.recipe:
        spec.recipes = list(args.recipe)
    check_recipes(spec)
    for flag in [flag_dest(f) for f in args.train_flags]:
        if flag in spec.train_flags or flag in spec.fixed or flag in spec.keys:
            raise ConfigError(f"train flag {flag!r} is given twice")
        spec.train_flags.append(flag)
    return spec


def check_recipes(spec: SweepSpec) -> None:
    """The recipes load; with baseline arms, the routing and label flags that an arm drops are not in a recipe (an arm
    removes them from the sweep's flags, and could not remove them from a file)."""
    from trl_ext.cli_train import parser
    from trl_ext.runs.recipe import load_recipe, options

    known = options(parser())  # one parser for every key (train.py checks the keys when each run is planned)
    for path in spec.recipes:
        recipe = load_recipe(Path(path))
        dests = {known[k].dest for k in (str(k).replace("-", "_") for k in recipe.flags) if k in known}
        pinned = sorted(dests & {*ROUTING_ONLY, *LABEL_ONLY})
        if spec.baselines and pinned:
            raise ConfigError(f"recipe {path} sets {', '.join(pinned)}, which the baseline arms drop: give them in the "
                              "sweep's fixed or grid instead")


def _recipe_args(spec: SweepSpec) -> list[str]:
    return [a for path in spec.recipes for a in ("--recipe", path)]


def _build_plan_quietly(argv: list[str]):
    """``cli_train.build_plan`` with argparse's exit turned into ConfigError carrying its one-line message."""
    from trl_ext.cli_train import build_plan

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_plan(argv)
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
        raise ConfigError(lines[-1].split("error:", 1)[1].strip() if lines else "train.py rejected the flags") from None


def _argv(fixed: dict[str, str], values: dict[str, str], flags: list[str]) -> list[str]:
    fixed_items = sorted(fixed.items(), key=lambda kv: kv[0] != "reward")  # reward first, then as given
    grid_items = [(k, v) for k, v in values.items() if k != "baseline"]  # the arm's label, not a flag
    return [a for k, v in [*fixed_items, *grid_items] for a in (f"--{k}", v)] + [f"--{f}" for f in flags]


def _baseline(arm: str, extra: dict[str, str], spec: SweepSpec, values: dict[str, str]):
    """(fixed, values, flags) of ``arm`` next to the routed run with grid ``values``."""
    drop = set(ROUTING_ONLY) | (set(LABEL_ONLY) if arm == "plain" else set())
    fixed = {k: v for k, v in spec.fixed.items() if k not in drop}
    vals = {k: v for k, v in values.items() if k not in drop}
    if arm == "plain" and "base_reward" in {**fixed, **vals} and "hack_frac" not in {**fixed, **vals}:
        fixed.pop("base_reward", None)  # only the eligibility needed it
        vals.pop("base_reward", None)
    flags = [f for f in spec.train_flags if f not in drop]
    if arm != "plain":
        flags.append(f"{arm}_baseline")
    return {**fixed, **extra}, {"baseline": arm, **vals}, flags


@contextlib.contextmanager
def planned_processes(n: int):
    """train.py's parse as a launch of ``n`` processes sees it, without starting a process group here: for the
    duration, `trl_ext.launch.processes.launched_processes` (read by every parse-time check of several processes
    and by the ``_procsN`` run-name tag) answers ``n``, while TrainingArguments, which reads WORLD_SIZE from the
    environment itself, still sets up one process. So each run is refused, or named, as under torchrun. The CPU
    settings of several processes (``use_cpu``, gloo; `processes.multi_process_settings`) are checked on a copy of
    the config: applied here, they would make accelerate look for a process group that this process has not. TRL's
    own batch checks (``generation_batch_size`` divisible by ``num_generations``) read ``world_size``: it answers
    ``n`` for the duration."""
    if n == 1:
        yield
        return
    from trl_ext import config
    from trl_ext.launch import processes

    saved = processes.launched_processes, config.multi_process_settings
    processes.launched_processes = lambda environ=None: (n, "--procs_per_run")
    config.multi_process_settings = lambda cfg, *a, **k: saved[1](copy.copy(cfg), *a, **k)
    config.ExtGRPOConfig.world_size = property(lambda self: n)  # TRL's batch checks count n processes too
    try:
        yield
    finally:
        processes.launched_processes, config.multi_process_settings = saved
        del config.ExtGRPOConfig.world_size


def plan_runs(spec: SweepSpec, procs: int = 1) -> list[PlannedRun]:
    """One validated run per grid combination (raises ConfigError naming the run and the problem), then the
    ``spec.baselines`` arms of every routed run (identical arms, e.g. of routing_mode shared and exclusive,
    planned once). ``procs`` > 1: each run is validated and named as a launch of that many processes."""
    with planned_processes(procs):
        return _plan_runs(spec)


def _plan_runs(spec: SweepSpec) -> list[PlannedRun]:
    runs, seen = [], {}
    combos = [dict(zip(g, c)) for g in spec.grids for c in itertools.product(*g.values())]
    jobs = [(spec.fixed, values, spec.train_flags, None) for values in combos]
    while jobs:
        fixed, values, flags, arm = jobs.pop(0)
        label = " ".join(f"{k}={v}" for k, v in values.items()) or "single run"
        try:
            plan = _build_plan_quietly(argv := _recipe_args(spec) + _argv(fixed, values, flags))
        except ValueError as e:
            raise ConfigError(f"run {len(runs) + 1} ({label}): {e}") from None
        run = PlannedRun(len(runs), values, argv, plan.run_dir)
        if run.run_dir in seen:
            if arm is not None and seen[run.run_dir].values.get("baseline") == arm:
                continue  # the same arm of another routed run
            raise ConfigError(f"runs '{seen[run.run_dir].label}' and '{run.label}' map to one directory {run.run_dir}")
        seen[run.run_dir] = run
        runs.append(run)
        if arm is None and spec.baselines and plan.cfg.gradient_routing:
            jobs.extend((*_baseline(a, extra, spec, values), a) for a, extra in spec.baselines.items())
    if spec.baselines and not any(r.values.get("baseline") for r in runs):
        raise ConfigError("baseline arms were asked for, but no run of the grid uses --gradient_routing")
    return runs


def sweep_dir_for(runs: list[PlannedRun], spec: SweepSpec, name: str | None, config: str | None = None) -> Path:
    """``{output_dir}/sweeps/NAME``; the default NAME (sweep file stem or grid keys, run count, a hash of the
    run names) is the same whenever the same runs are planned, so a re-run finds its logs and summary."""
    parents = {r.run_dir.parent for r in runs}
    if len(parents) != 1:
        raise ConfigError(f"the runs write to several output dirs {sorted(map(str, parents))}; sweep one output_dir")
    digest = hashlib.sha1("\n".join(sorted(r.name for r in runs)).encode()).hexdigest()[:8]
    prefix = Path(config).stem if config else f"sweep_{'-'.join(spec.keys) or 'single'}"
    name = name or f"{prefix}_{len(runs)}runs_{digest}"
    return parents.pop() / "sweeps" / name


# ------------------------------------------------------------------------------------------ shards
SHARD_ENV = "env"  # --shard env: a Slurm job array's task
SLURM_ARRAY = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX", "SLURM_ARRAY_TASK_COUNT")


def parse_shard(text: str, environ: dict) -> tuple[int, int]:
    """``--shard K/N`` -> (K, N) with 1 <= K <= N. ``--shard env`` reads a Slurm job array: K is the task's place in
    the array (``(SLURM_ARRAY_TASK_ID - MIN) / STEP + 1``, so ``--array=0-3`` and ``--array=1-4`` both give 1..4),
    N is SLURM_ARRAY_TASK_COUNT; an array that is not an evenly stepped range (``--array=1,5,6``) is refused."""
    if text == SHARD_ENV:
        missing = [v for v in SLURM_ARRAY if not environ.get(v, "").isdigit()]
        if missing:
            raise ConfigError(f"--shard env reads a Slurm job array's task, but {', '.join(missing)} is not set "
                              "(to a number); outside a job array give --shard K/N")
        task, lo, hi, count = (int(environ[v]) for v in SLURM_ARRAY)
        step = int(environ.get("SLURM_ARRAY_TASK_STEP", "1") or 1)
        if step < 1 or (hi - lo) % step or (hi - lo) // step + 1 != count or (task - lo) % step:
            raise ConfigError(f"--shard env needs a job array that is a range (--array=A-B or A-B:S); this one has "
                              f"{count} tasks from {lo} to {hi} in steps of {step}")
        return (task - lo) // step + 1, count
    k, sep, n = text.partition("/")
    if not (sep and k.isdigit() and n.isdigit()) or not 1 <= int(k) <= int(n):
        raise ConfigError(f"--shard expects K/N with 1 <= K <= N (the K-th of N slices), or env; got {text!r}")
    return int(k), int(n)


def shard_runs(runs: list[PlannedRun], k: int, n: int) -> list[PlannedRun]:
    """The K-th of N slices of a plan: runs whose place in the plan is K-1 modulo N. The plan's order is the grid's
    (flags as given, values as given, the last flag varying fastest, then each routed run's baseline arms), the
    same on every machine given the same command; every run is in exactly one slice, and round robin keeps the
    slices' sizes within one of each other and mixes the grid's slow and fast values."""
    return [r for r in runs if r.index % n == k - 1]
