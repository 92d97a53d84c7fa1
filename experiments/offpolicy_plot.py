"""The off-policy study's figure (experiments/offpolicy_study.py writes it): held-out success at the last step against
the policy lag k (no masks; default masks, strict and in flight), per rescue at k = 16 and beyond, and against the
learning rate where the task has a calibration group."""

from __future__ import annotations

from pathlib import Path


def plot(title: str, metric: str, stats: dict[str, tuple[float, float]], end: int, path: Path) -> None:
    """``stats``: each arm's (mean, SE) over seeds at step ``end``, by the study's arm label (``arm_of``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lr_curves = [(label, sorted((float(a[len(prefix):]), st) for a, st in stats.items() if a.startswith(prefix)))
                 for label, prefix in (("k=0 sync", "k=0 sync, lr "),
                                       ("k=16 strict, no masks", "k=16 strict, no masks, lr "))]  # fmt: skip
    lr_curves = [(label, pts) for label, pts in lr_curves if pts]
    widths = [1, 1.3, 0.8] if lr_curves else [1, 1.3]  # the calibration panel only where a task has one
    fig, axes = plt.subplots(1, len(widths), figsize=(6.3 * sum(widths), 5.5), gridspec_kw={"width_ratios": widths})
    ax_k, ax_r = axes[:2]
    for label, pick in (("strict, no masks", lambda a: a.endswith("strict, no masks") or a == "k=0 sync"),
                        ("strict, default masks", lambda a: a.endswith("strict, default masks")),
                        ("in-flight, default masks", lambda a: a.endswith("in-flight, default masks"))):
        pts = sorted((int(a.split()[0][2:]), st) for a, st in stats.items() if pick(a))
        if pts:
            ax_k.errorbar([k for k, _ in pts], [m for _, (m, _) in pts], [se for _, (_, se) in pts], marker="o",
                          capsize=3, label=label)  # fmt: skip
    ax_k.set_xscale("symlog", linthresh=1)
    ax_k.set_xlabel("policy lag k (max_async_level)")
    ax_k.set_ylabel(f"held-out greedy {metric} @{end}")
    ax_k.legend(fontsize=8)
    rescues = [(a, st) for a, st in stats.items() if ("+" in a or "MIS" in a) and a[2:4] in ("16", "32", "64")
               and "lr" not in a]  # fmt: skip
    if rescues:
        ax_r.barh(range(len(rescues)), [m for _, (m, _) in rescues], xerr=[se for _, (_, se) in rescues], capsize=2)
        ax_r.set_yticks(range(len(rescues)), [a for a, _ in rescues], fontsize=7)
        ax_r.invert_yaxis()
        for ref, style in (("k=0 sync", "-"), ("k=16 strict, no masks", "--"), ("k=16 strict, default masks", ":")):
            if ref in stats:
                ax_r.axvline(stats[ref][0], color="k", linestyle=style, label=ref)
        ax_r.legend(fontsize=7)
    ax_r.set_xlabel(f"held-out greedy {metric} @{end}")
    if lr_curves:
        ax_lr = axes[2]
        for label, pts in lr_curves:
            ax_lr.errorbar([x for x, _ in pts], [m for _, (m, _) in pts], [se for _, (_, se) in pts], marker="o",
                           capsize=3, label=label)  # fmt: skip
        ax_lr.set_xscale("log")
        ax_lr.set_xlabel("learning rate (calibration)")
        ax_lr.set_ylabel(f"held-out greedy {metric} @{end}")
        ax_lr.legend(fontsize=8)
    fig.suptitle(f"Off-policy study on {title} (mean ± SE over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
