"""Plots of the routing eval (small-rl plot_routing.py and plot_routing_comparison.py, HEAD 6f6e986): the curves
of one run per ablation mode over steps, and a comparison of several runs. Both read ``routing_eval.jsonl``.

    uv run python -m trl_ext.routing.plots output/<run>                       # -> output/<run>/routing_eval.png
    uv run python -m trl_ext.routing.plots output/<a> output/<b> --out cmp.png --metrics reward/sentence_length_5,rh_rate
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from trl_ext.routing.adapters import ABLATION_SCALES
from trl_ext.routing.evaluation import read_records

DEFAULT_METRICS = ("rh_rate",)
MODE_STYLE = {"both": "-", "retain_only": "--", "forget_only": ":"}


def curves(records: list[dict], metric: str) -> dict[str, tuple[list[int], list[float]]]:
    """mode -> (steps, values) of ``metric``; a record without the metric is an error (no silent gaps)."""
    out = {}
    for mode in ABLATION_SCALES:
        steps, values = [], []
        for r in records:
            if metric not in r["modes"][mode]:
                raise KeyError(f"step {r['step']} mode {mode} has no {metric!r}; metrics: {sorted(r['modes'][mode])}")
            steps.append(r["step"])
            values.append(r["modes"][mode][metric])
        out[mode] = (steps, values)
    return out


def _figure(n_rows: int, n_cols: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(n_rows, n_cols, figsize=(4.5 * n_cols, 3.2 * n_rows), squeeze=False)
    return plt, fig, axes


def plot_modes(run_dir: str | Path, out: str | Path, metrics: Sequence[str] = DEFAULT_METRICS) -> Path:
    """One panel per metric: the three modes of one run over steps."""
    records = read_records(run_dir)
    plt, fig, axes = _figure(1, len(metrics))
    for ax, metric in zip(axes[0], metrics):
        for mode, (steps, values) in curves(records, metric).items():
            ax.plot(steps, values, MODE_STYLE[mode], marker="o", label=mode)
        ax.set_xlabel("step")
        ax.set_title(metric)
        ax.legend()
    fig.suptitle(Path(run_dir).name[:120], fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def plot_comparison(runs: Mapping[str, str | Path], out: str | Path,
                    metrics: Sequence[str] = DEFAULT_METRICS) -> Path:
    """Rows = metrics, columns = modes; one line per run (``label -> run dir``), runs whose labels share their
    first word (an arm) share a colour."""
    plt, fig, axes = _figure(len(metrics), len(ABLATION_SCALES))
    arms = list(dict.fromkeys(label.split()[0] for label in runs))
    colours = {a: f"C{i}" for i, a in enumerate(arms)}
    for label, run_dir in runs.items():
        records = read_records(run_dir)
        for row, metric in zip(axes, metrics):
            for ax, (mode, (steps, values)) in zip(row, curves(records, metric).items()):
                ax.plot(steps, values, color=colours[label.split()[0]], alpha=0.8, marker=".",
                        label=label.split()[0] if label == next(k for k in runs if k.split()[0] == label.split()[0])
                        else None)
                ax.set_title(f"{mode}: {metric}", fontsize=9)
                ax.set_xlabel("step")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Plot routing_eval.jsonl of one run (per mode) or of several runs.")
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--out", default=None, help="PNG path (default: <run>/routing_eval.png for one run)")
    ap.add_argument("--metrics", default=",".join(DEFAULT_METRICS), help="comma-separated routing-eval metrics")
    args = ap.parse_args(argv)
    metrics = [m for m in args.metrics.split(",") if m]
    missing = [d for d in args.run_dirs if not (Path(d) / "routing_eval.jsonl").is_file()]
    if missing:
        print(f"routing_plots: error: no routing_eval.jsonl in {', '.join(missing)}", file=sys.stderr)
        return 2
    if len(args.run_dirs) == 1:
        path = plot_modes(args.run_dirs[0], args.out or Path(args.run_dirs[0]) / "routing_eval.png", metrics)
    else:
        if not args.out:
            print("routing_plots: error: several runs need --out", file=sys.stderr)
            return 2
        path = plot_comparison({Path(d).name: d for d in args.run_dirs}, args.out, metrics)
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
