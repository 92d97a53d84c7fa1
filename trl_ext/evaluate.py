"""eval_run.py: fresh samples from a checkpoint, their diversity and rewards, the run's reward history,
and the routing ablations of a dual-LoRA checkpoint (seed 004's "Checking Model Output").

Checkpoint kind is read from the files, never guessed: ``dual_lora_layout.json`` (the routing feature's
layout: ranks, alpha, targets, stride) = dual LoRA, full or adapter-only (``dual_lora_adapter.safetensors``; the
layout names the base model's path and weight fingerprint, checked on load); ``adapter_config.json`` (PEFT: rank, alpha, targets,
base model) = PEFT LoRA; ``config.json`` with weights = plain model.

Diversity is measured on the completions only (``trl_ext.diversity``): unique fraction and mean pairwise
Jaccard similarity of lower-cased word sets; ``degenerate`` when unique < ``--min_unique`` or Jaccard >
``--max_jaccard`` (small-rl's thresholds 0.5 / 0.7; they can miss template collapse: read the samples too).
Prompts are held-out ("test" split) story prefixes; prompt length, prompt source, reward and sampling
settings default to the training run's own (``run_config.yaml`` beside or above the checkpoint). ``--dataset``
(``--dataset_split``, ``--prompt_column``; default: the run's ``--eval_dataset``) takes ``--n_samples`` rows of a
prompt dataset instead (``trl_ext.data.load``), and each reward gets the rows' columns as in training.
Routing eval (dual LoRA): both (1,1), retain_only (1,0), forget_only (0,1) adapter scales, same prompts
and seed (Gradient Routing, Cloud et al. 2024).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from trl_ext.data.load import CONVERSATIONAL, PROMPT, eval_data_choice, has_chat_template, load_prompt_data, row_scorer
from trl_ext.diversity import mean_pairwise_jaccard, unique_fraction
from trl_ext.registry import ConfigError
from trl_ext.routing.adapter_layout import LAYOUT_FILENAME
from trl_ext.routing.adapters import ABLATION_SCALES as ABLATION

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")  # fmt: skip
SAMPLING_KEYS = ("top_p", "top_k", "min_p", "repetition_penalty")  # taken from the run's config when known
GENERATION_BATCH = 64


def _help(text: str, default=None):
    return field(default=default, metadata={"help": text})


@dataclass
class EvalArgs:
    model_path: str = _help("Checkpoint directory (plain, PEFT LoRA or dual LoRA: detected from its files).")
    n_samples: int = _help("Held-out prompts sampled (one completion each).", 20)
    eval_rewards: str = _help("Comma-separated reward bindings scored besides the run's reward.", "")
    reward: str | None = _help("Main reward binding (default: the run's --reward).")
    config: str | None = _help("Reward YAML (default: the run's --config).")
    rh_detector: str | None = _help("RH detector binding for rh_rate (default: the run's, else the reward's own).")
    no_routing_eval: bool = _help("Skip the both / retain_only / forget_only ablations of a dual-LoRA model.", False)
    prompt_source: str | None = _help("Held-out prompts of 'builtin' or a hub model id (default: the run's, as train.py "
                                      "chose them from its --prompts and --model).")
    prompt_length: int | None = _help("Prompt length in tokens (default: the run's).")
    dataset: str | None = _help("Prompts from a dataset (a .jsonl/.json/.csv/.parquet file, a save_to_disk directory "
                                "or a hub id: trl_ext/data/load.py) instead of the story prompts: --n_samples rows in "
                                "an order shuffled by --seed, their other columns passed to the rewards as train.py "
                                "passes them. Default: the run's --eval_dataset (and split) when it had one.")
    dataset_split: str | None = _help("Split of --dataset (default: the run's --eval_dataset_split for its eval "
                                      "dataset, else 'train').")
    prompt_column: str | None = _help("Prompt column of --dataset (default: the run's --prompt_column, else 'prompt').")
    max_new_tokens: int | None = _help("Completion tokens (default: the run's max_completion_length).")
    temperature: float | None = _help("Sampling temperature (default: the run's).")
    seed: int = _help("Seed of the prompt order and of sampling.", 0)
    min_unique: float = _help("Degenerate when the unique fraction is below this.", 0.5)
    max_jaccard: float = _help("Degenerate when the mean pairwise Jaccard similarity is above this.", 0.7)
    n_print: int = _help("Samples printed (and kept in the report).", 5)
    output_dir: str | None = _help("Report directory (default: the checkpoint's parent, next to it).")
    device: str = _help("'cpu', 'cuda' or 'auto' (cuda when available).", "auto")


# ------------------------------------------------------------------------------------------ pure parts
def diversity_report(completions: list[str], min_unique: float, max_jaccard: float) -> dict:
    """Unique fraction, mean pairwise Jaccard, and the degenerate flag (unique < min or Jaccard > max)."""
    u, j = unique_fraction(completions), mean_pairwise_jaccard(completions)
    return {"unique_fraction": u, "mean_pairwise_jaccard": j, "degenerate": u < min_unique or j > max_jaccard,
            "min_unique": min_unique, "max_jaccard": max_jaccard}  # fmt: skip


def detect_checkpoint(path: str | Path) -> str:
    """``plain`` / ``peft_lora`` / ``dual_lora`` from the saved files; ConfigError when it is none or both."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"--model_path is not a directory: {path}")
    dual, peft = (path / LAYOUT_FILENAME).is_file(), (path / "adapter_config.json").is_file()
    if dual and peft:
        raise ConfigError(f"{path} holds both {LAYOUT_FILENAME} and adapter_config.json: ambiguous checkpoint")
    if dual or peft:
        return "dual_lora" if dual else "peft_lora"
    if (path / "config.json").is_file() and any((path / f).is_file() for f in WEIGHT_FILES):
        return "plain"
    raise ConfigError(f"--model_path {path} is not a checkpoint: no {LAYOUT_FILENAME}, adapter_config.json, "
                      f"or config.json with weights ({', '.join(WEIGHT_FILES)})")  # fmt: skip


def latest_trainer_state(path: str | Path) -> Path | None:
    """``path/trainer_state.json``, else the one of the highest-step ``path/checkpoint-N``; None if neither."""
    path = Path(path)
    if (path / "trainer_state.json").is_file():
        return path / "trainer_state.json"
    ckpts = [p for p in path.glob("checkpoint-*") if p.name[11:].isdigit() and (p / "trainer_state.json").is_file()]
    return max(ckpts, key=lambda p: int(p.name[11:])) / "trainer_state.json" if ckpts else None


def reward_history(state_path: str | Path) -> list[dict]:
    """Logged steps of ``trainer_state.json`` with reward, reward_std, kl and the reward components."""
    rows = []
    for h in json.loads(Path(state_path).read_text())["log_history"]:
        if "reward" in h:
            parts = sorted(k for k in h if k.startswith("eval_rewards/"))
            keep = [k for k in ("reward", "reward_std", "kl") if k in h] + parts
            rows.append({"step": h["step"], **{k: h[k] for k in keep}})
    return rows


def format_table(rows: list[dict], max_rows: int | None = None) -> str:
    """Aligned text table; with ``max_rows`` an even subsample that keeps the first and last rows."""
    if not rows:
        return "(empty)"
    if max_rows and len(rows) > max_rows:
        rows = [rows[round(i * (len(rows) - 1) / (max_rows - 1))] for i in range(max_rows)]
    cols = list(dict.fromkeys(k for r in rows for k in r))
    cells = [cols] + [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def plot_curves(curves: dict[str, tuple[list, list]], path: Path, title: str, ylabel: str) -> Path:
    """One line per label (x = step); an empty plot says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, label=label)
    if curves:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no logged rewards", ha="center", va="center", transform=ax.transAxes)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------ settings
def find_run_config(model_path: Path) -> dict | None:
    for d in (model_path, model_path.parent):
        if (d / "run_config.yaml").is_file():
            return yaml.safe_load((d / "run_config.yaml").read_text())
    return None


def resolve_data(args: EvalArgs, run: dict):
    """--dataset's `trl_ext.data.load.PromptData` (``--n_samples`` rows shuffled by ``--seed``), or None for the story
    prompts; ConfigError for story-prompt flags given with a dataset."""
    choice = eval_data_choice(args.dataset, args.dataset_split, args.prompt_column, run)
    if choice is None:
        return None
    for flag, value in (("--prompt_source", args.prompt_source), ("--prompt_length", args.prompt_length)):
        if value is not None:
            raise ConfigError(f"{flag} picks story prompts: not with a dataset ({choice[0]})")
    data = load_prompt_data(*choice, flag="--dataset")
    if args.n_samples > len(data.dataset):
        raise ConfigError(f"--n_samples {args.n_samples} exceeds the {len(data.dataset)} rows of --dataset "
                          f"{data.source} (split {data.split!r})")  # fmt: skip
    data.dataset = data.dataset.shuffle(seed=args.seed).select(range(args.n_samples))
    return data


def resolve(args: EvalArgs) -> dict:
    """Everything the evaluation needs, checked before any model is loaded (ConfigError otherwise)."""
    from rewards.config import load_reward_config
    from trl_ext.cli_train import prompt_source
    from trl_ext.config import RunArgs

    if not args.model_path:
        raise ConfigError("--model_path is required")
    path = Path(args.model_path).expanduser()
    if not path.exists():
        raise ConfigError(f"--model_path does not exist: {path}")
    kind = detect_checkpoint(path)
    run_cfg = find_run_config(path) or {}
    run, cfg = run_cfg.get("RunArgs", {}), run_cfg.get("ExtGRPOConfig", {})

    def pick(flag, value, source, key):
        if value is not None:
            return value
        if key not in source:
            raise ConfigError(f"--{flag} is needed: no run_config.yaml beside or above {path} to take it from")
        return source[key]

    s = {"path": path, "kind": kind, "run_config_found": bool(run_cfg),
         "data": resolve_data(args, run), "prompt_source": None, "prompt_length": None}
    if s["data"] is None:
        s["prompt_source"] = args.prompt_source or prompt_source(RunArgs(
            model=pick("prompt_source", None, run, "model"), prompts=run.get("prompts")))  # as train.py chose them
        s["prompt_length"] = pick("prompt_length", args.prompt_length, run, "prompt_length")
    s |= {"generation": {"max_new_tokens": pick("max_new_tokens", args.max_new_tokens, cfg, "max_completion_length"),
                        "temperature": pick("temperature", args.temperature, cfg, "temperature"),
                        **{k: cfg[k] for k in SAMPLING_KEYS if k in cfg}}}  # fmt: skip
    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {args.device!r}")
    if args.n_samples < 2:
        raise ConfigError(f"--n_samples must be >= 2 (pairwise Jaccard), got {args.n_samples}")
    if not (0 <= args.min_unique <= 1 and 0 <= args.max_jaccard <= 1):
        raise ConfigError(f"--min_unique / --max_jaccard must lie in [0, 1], got {args.min_unique}, {args.max_jaccard}")
    config_path = Path(args.config or run.get("config") or RunArgs.__dataclass_fields__["config"].default)
    if not config_path.is_file():
        raise ConfigError(f"reward config does not exist: {config_path} (pass --config)")
    rc = load_reward_config(config_path)
    main_reward = args.reward or run.get("reward")
    names = (n.strip() for n in [main_reward or "", *args.eval_rewards.split(",")])
    s["rewards"] = {n: rc.reward(n) for n in dict.fromkeys(n for n in names if n)}
    if s["data"] is None:
        rc.check_columns(list(s["rewards"]), (), "the held-out story prompts")  # rewards get prompts=, no other column
    else:
        rc.check_columns(list(s["rewards"]), s["data"].reward_columns, f"--dataset {s['data'].source}")
    det = args.rh_detector or cfg.get("rh_detector") or (rc.default_detector(main_reward) if main_reward else None)
    s["detector"] = (det, rc.detector(det)) if det else None
    s["routing"] = kind == "dual_lora" and not args.no_routing_eval
    base = None
    if kind == "peft_lora" and not (base := json.loads((path / "adapter_config.json").read_text()).get(
            "base_model_name_or_path")):  # fmt: skip
        raise ConfigError(f"{path / 'adapter_config.json'} names no base model (base_model_name_or_path)")
    s["tokenizer"] = path if (path / "tokenizer_config.json").is_file() else base
    if s["tokenizer"] is None:
        raise ConfigError(f"{path} has no tokenizer (tokenizer_config.json)")
    if s["data"] is not None and s["data"].kind == CONVERSATIONAL and Path(s["tokenizer"]).is_dir() \
            and not has_chat_template(Path(s["tokenizer"])):
        raise ConfigError(f"--dataset {s['data'].source} holds conversational prompts, and the tokenizer of {path} "
                          "has no chat template")  # fmt: skip
    s["out_dir"] = Path(args.output_dir) if args.output_dir else path.resolve().parent
    return s


# ------------------------------------------------------------------------------------------ model parts
def load_model(path: Path, kind: str):
    """(model, layout) of a checkpoint of ``kind``; adapter shapes and scaling come from its saved files."""
    import torch
    from transformers import AutoModelForCausalLM

    if kind == "plain":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), None
    if kind == "peft_lora":
        from peft import AutoPeftModelForCausalLM

        layout = json.loads((path / "adapter_config.json").read_text())
        return AutoPeftModelForCausalLM.from_pretrained(path, dtype=torch.float32), layout
    from trl_ext.routing.adapter_layout import load_layout
    from trl_ext.routing.checkpoint import load_dual_lora_checkpoint

    dual, mode = load_layout(path)
    return load_dual_lora_checkpoint(path), {**dual.to_dict(), "routing_mode": mode}


def generation_config(tokenizer, gen: dict):
    """Sampling as in training (TRL's GRPOTrainer): do_sample with the run's settings, stop at EOS."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            **gen)  # fmt: skip


def evaluate(args: EvalArgs, s: dict) -> dict:
    import torch

    from environments.stories import load_prompts
    from rewards.bound import on_prompts
    from trl_ext.models import load_tokenizer, prepare_tokenizer
    from trl_ext.routing.evaluation import evaluate_modes, sample_completions, score_completions

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model, layout = load_model(s["path"], s["kind"])
    model = model.to(device).eval()
    tokenizer = prepare_tokenizer(load_tokenizer(s["tokenizer"]))
    data = s["data"]
    if data is None:
        prompts = list(load_prompts(s["prompt_source"], tokenizer, s["prompt_length"], "test", args.n_samples,
                                    args.seed)["prompt"])  # fmt: skip
        rewards = {n: on_prompts(fn, prompts) for n, fn in s["rewards"].items()}  # sampled one per prompt, in order
        texts_in = prompts
    else:  # the rows' columns reach the rewards as train.py's rewards get them (trl_ext.data.load.row_scorer)
        prompts = list(data.dataset[PROMPT])
        rewards = {n: row_scorer(fn, data, len(prompts)) for n, fn in s["rewards"].items()}
        texts_in = prompts if data.kind != CONVERSATIONAL else [  # rendered as TRL renders chat prompts
            tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    gen = generation_config(tokenizer, s["generation"])
    detector = s["detector"][1] if s["detector"] else None

    def sample() -> list[str]:
        return sample_completions(model, tokenizer, texts_in, gen, args.seed, GENERATION_BATCH)

    def summarize(texts: list[str]) -> dict:
        scores = score_completions(texts, rewards, detector)
        return {"texts": texts, "diversity": diversity_report(texts, args.min_unique, args.max_jaccard),
                "scores": {k: v for k, v in scores.items() if k.startswith("reward/") or k == "rh_rate"}}  # fmt: skip

    modes = evaluate_modes(model, sample, summarize) if s["routing"] else None
    main = modes["both"] if modes else summarize(sample())
    per_sample = {n: fn(main["texts"][: args.n_print]) for n, fn in rewards.items()}
    state = latest_trainer_state(s["path"])
    return {
        "model_path": str(s["path"]), "kind": s["kind"], "layout": layout, "n_samples": args.n_samples,
        "prompts": {"source": s["prompt_source"], "split": "test", "length": s["prompt_length"]} if data is None else
                   {"source": data.source, "split": data.split, "kind": data.kind, "columns": data.reward_columns},
        "generation": s["generation"], "seed": args.seed,
        "rh_detector": s["detector"][0] if s["detector"] else None,
        "diversity": main["diversity"], "scores": main["scores"],
        "samples": [{"prompt": p, "completion": c, "rewards": {n: v[i] for n, v in per_sample.items()}}
                    for i, (p, c) in enumerate(zip(prompts[: args.n_print], main["texts"]))],
        "routing": {m: {"scales": list(ABLATION[m]), "scores": r["scores"], "diversity": r["diversity"],
                        "samples": r["texts"][: args.n_print]} for m, r in modes.items()} if modes else None,
        "reward_history": {"source": str(state) if state else None, "rows": reward_history(state) if state else []},
    }  # fmt: skip


# ------------------------------------------------------------------------------------------ CLI
def print_report(report: dict, n_print: int) -> None:
    g, d = report["generation"], report["diversity"]
    print(f"checkpoint: {report['model_path']} ({report['kind']})")
    p = report["prompts"]
    what = f"{p['kind']} prompts" if "kind" in p else f"prompts of {p['length']} tokens"
    print(f"prompts: {report['n_samples']} held-out ({p['split']}) {what} from {p['source']}; generation {g}")
    for i, smp in enumerate(report["samples"][:n_print]):
        print(f"[sample {i + 1}] {smp['prompt']} ||| {smp['completion']}")
    print(f"diversity: unique {d['unique_fraction']:.3f} (degenerate below {d['min_unique']}), mean pairwise "
          f"Jaccard {d['mean_pairwise_jaccard']:.3f} (degenerate above {d['max_jaccard']}) -> "
          f"degenerate: {'YES' if d['degenerate'] else 'no'}")  # fmt: skip
    print("scores (mean over samples): " + (", ".join(f"{k} {v:.4g}" for k, v in report["scores"].items()) or "-"))
    if report["routing"]:
        rows = [{"mode": m, **r["scores"], "unique": r["diversity"]["unique_fraction"],
                 "jaccard": r["diversity"]["mean_pairwise_jaccard"], "degenerate": r["diversity"]["degenerate"]}
                for m, r in report["routing"].items()]  # fmt: skip
        print("routing eval:\n" + format_table(rows))
    hist = report["reward_history"]
    print(f"reward history ({hist['source'] or 'no trainer_state.json found'}):\n{format_table(hist['rows'], 15)}")


def write_report(report: dict, out_dir: Path, ckpt_name: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = report["reward_history"]["rows"]
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k == "reward" or k.startswith("eval_rewards/")]
    curves = {k: ([r["step"] for r in rows if k in r], [r[k] for r in rows if k in r]) for k in keys}
    png = plot_curves(curves, out_dir / f"eval_{ckpt_name}_reward_history.png", f"reward history: {ckpt_name}",
                      "reward")  # fmt: skip
    report["reward_history"]["plot"] = str(png)
    path = out_dir / f"eval_{ckpt_name}.json"
    path.write_text(json.dumps(report, indent=2))
    return path, png


def main(argv: list[str] | None = None) -> int:
    from transformers import HfArgumentParser

    from trl_ext.launch.processes import check_single_process

    argv = sys.argv[1:] if argv is None else argv
    try:
        check_single_process("eval_run.py")
        (args,) = HfArgumentParser(EvalArgs).parse_args_into_dataclasses(args=argv)
        settings = resolve(args)
    except ConfigError as e:
        print(f"eval_run.py: error: {e}", file=sys.stderr)
        return 2
    report = evaluate(args, settings)
    print_report(report, args.n_print)
    path, png = write_report(report, settings["out_dir"], settings["path"].resolve().name)
    print(f"report: {path}\nplot: {png}")
    return 0

