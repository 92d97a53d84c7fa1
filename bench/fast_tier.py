"""Wall time of the README's fast test tier (`uv run pytest`) on cold clones, as a contributor or CI meets it.

Each round clones the repository's HEAD into a fresh directory, with a fresh model cache (TRL_EXT_CACHE) and no
virtual environment (uv builds it from its package cache, as on a machine that has run uv before), then times
`uv run pytest -q` there. Prints and writes bench/results/fast_tier.json: every round's seconds and test counts,
min / median / max, the load average before and after each round and the CPU model.

    uv run python bench/fast_tier.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def one_round(commit: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "checkout", "-q", commit], cwd=clone, check=True)
        env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
        env["TRL_EXT_CACHE"] = str(Path(tmp) / "model-cache")
        load_before = os.getloadavg()[0]
        t0 = time.time()
        proc = subprocess.run(["uv", "run", "pytest", "-q", "-p", "no:cacheprovider"], cwd=clone, env=env,
                              capture_output=True, text=True)  # fmt: skip
        seconds = time.time() - t0
        summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|deselected|skipped|error)", summary)}
        return {"seconds": round(seconds, 1), "exit_code": proc.returncode, "summary": summary, **counts,
                "load_1m_before": round(load_before, 2), "load_1m_after": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()  # fmt: skip
    rounds = []
    for i in range(args.rounds):
        rounds.append(one_round(commit))
        print(f"round {i + 1}: {rounds[-1]}", flush=True)
    secs = [r["seconds"] for r in rounds]
    report = {"commit": commit, "cpu": cpu_model(), "cores": os.cpu_count(), "rounds": rounds,
              "seconds_min": min(secs), "seconds_median": statistics.median(secs), "seconds_max": max(secs)}
    text = json.dumps(report, indent=2)
    print(text)
    (ROOT / "bench" / "results" / "fast_tier.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
