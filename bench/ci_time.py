"""Wall time of CI (`bash .ci/run`, every tier, installs included) on a clean clone, as CI meets it.

Clones the repository's HEAD into a fresh directory and runs `bash .ci/run` there with a fresh model cache
(TRL_EXT_CACHE) and no virtual environment; with ``--cold``, also with an empty uv package cache (UV_CACHE_DIR), so
every package is downloaded and installed as on a new machine; with ``--env NAME=VALUE`` (repeatable), with
variables a user may have exported (``WANDB_MODE=disabled``, ``HF_HUB_OFFLINE=1``, ``CUDA_VISIBLE_DEVICES=``).
`.ci/run` records each stage's seconds (CI_TIMES). Appends a record to bench/results/ci_time.json (the commit, the
exported variables, each stage's seconds and test counts, the total, the load average before and after, the CPU
model and core count) and keeps CI's output in bench/results/ci_time-<commit>[-exported].log.

    uv run python bench/ci_time.py --cold
    uv run python bench/ci_time.py --cold --env WANDB_MODE=disabled --env HF_HUB_OFFLINE=1 --env CUDA_VISIBLE_DEVICES=
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from fast_tier import cpu_model

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^=+ (.*\d+ (passed|failed).*) in [\d.]+s")


def run_ci(commit: str, cold: bool, log: Path, exported: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        clone, times = Path(tmp) / "clone", Path(tmp) / "times.txt"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "checkout", "-q", commit], cwd=clone, check=True)
        env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
        env.update(exported)
        env.update(CI="true", CI_TIMES=str(times), TRL_EXT_CACHE=str(Path(tmp) / "model-cache"))
        if cold:
            env["UV_CACHE_DIR"] = str(Path(tmp) / "uv-cache")
        load_before = os.getloadavg()
        t0 = time.time()
        with log.open("w") as out:
            proc = subprocess.run(["bash", ".ci/run"], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)  # fmt: skip
        total = time.time() - t0
        stages = [line.split() for line in times.read_text().splitlines()] if times.exists() else []
    summaries = [m.group(1) for line in log.read_text().splitlines() if (m := SUMMARY.match(line))]
    return {"commit": commit, "cold_uv_cache": cold, "exported": exported, "exit_code": proc.returncode,
            "total_s": round(total, 1),
            "stages_s": {name: float(s) for name, s in stages}, "pytest_summaries": summaries,
            "load_avg_before": [round(x, 2) for x in load_before],
            "load_avg_after": [round(x, 2) for x in os.getloadavg()], "cpu": cpu_model(), "cores": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold", action="store_true", help="an empty uv package cache: every package downloaded")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a variable exported for the run (repeatable)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ci_time.json")
    parser.add_argument("--commit", default="HEAD", help="the commit to clone and run (an earlier one: a baseline "
                        "measured beside the newest on the same machine)")
    args = parser.parse_args()
    if any("=" not in e for e in args.env):
        parser.error(f"--env takes NAME=VALUE, got {[e for e in args.env if '=' not in e]}")
    commit = subprocess.run(["git", "rev-parse", "--short", args.commit], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()  # fmt: skip
    exported = dict(e.split("=", 1) for e in args.env)
    log = args.out.with_name(f"ci_time-{commit}{'-exported' if exported else ''}.log")
    record = run_ci(commit, args.cold, log, exported)
    print(json.dumps(record, indent=2))
    runs = json.loads(args.out.read_text())["runs"] if args.out.exists() else []
    args.out.write_text(json.dumps({"runs": [*runs, record]}, indent=2) + "\n")
    raise SystemExit(record["exit_code"])


if __name__ == "__main__":
    main()
