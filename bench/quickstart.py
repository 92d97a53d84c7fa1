"""Acceptance check of the README quickstart, timed from a cold model cache.

Runs the quickstart command in a subprocess with an empty TRL_EXT_CACHE (so the builtin model's pinned build is
installed first, as on a fresh machine), then reads the run's reward curve and samples fresh completions from the
final checkpoint on held-out prompts. Prints the report and writes it to bench/results/quickstart.json.

    uv run python bench/quickstart.py     # wall time, reward curve summary, sample diversity
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ["--reward", "happy_binary", "--model", "builtin", "--lr", "3e-4", "--max_steps", "120",
              "--logging_steps", "5"]  # fmt: skip
RUN = "happy_binary_builtin_lr3e-4_b0.02_bs32_ng16_full_st120_s42"


def sample_final(ckpt: Path, n: int = 64) -> dict:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from transformers import AutoModelForCausalLM

    from environments.stories import load_prompts
    from rewards.config import load_reward_config
    from trl_ext.diversity import mean_pairwise_jaccard, unique_fraction
    from trl_ext.models import load_tokenizer, prepare_tokenizer

    tok = prepare_tokenizer(load_tokenizer(ckpt))
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    prompts = list(load_prompts("builtin", tok, 8, "test", n, seed=0)["prompt"])
    enc = tok(prompts, add_special_tokens=False, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, max_new_tokens=64, top_k=0, top_p=1.0)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    happy = load_reward_config(ROOT / "config.yaml").reward("happy_binary")(texts)
    return {
        "n": n,
        "happy_rate": sum(happy) / n,
        "unique_fraction": unique_fraction(texts),
        "mean_pairwise_jaccard": mean_pairwise_jaccard(texts),
        "samples": [f"{p} ||| {t}" for p, t in zip(prompts[:3], texts[:3], strict=True)],
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TRL_EXT_CACHE": str(Path(tmp) / "cache")}
        t0 = time.time()
        cmd = [sys.executable, "train.py", *QUICKSTART, "--output_dir", str(Path(tmp) / "output")]
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.time() - t0
        run_dir = Path(tmp) / "output" / RUN
        state = json.loads((run_dir / "checkpoint-120" / "trainer_state.json").read_text())
        build = json.loads((Path(tmp) / "cache" / "builtin-v1" / "build_info.json").read_text())
        pinned = json.loads((ROOT / "trl_ext" / "models" / "pinned" / "builtin-v1" / "build_info.json").read_text())
        curve = [(h["step"], h["reward"]) for h in state["log_history"] if "reward" in h]
        last20 = [r for _, r in curve[-20:]]
        first09 = next((s for s, r in curve if r >= 0.9), None)
        report = {
            "wall_s_from_empty_cache": round(wall, 1),
            "model": "pinned build" if build["weights_sha256"] == pinned["weights_sha256"] else "built",
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
            "first_logged_reward": curve[0],
            "first_step_reward_ge_0.9": first09,
            "mean_last20_logged": round(sum(last20) / len(last20), 4),
            "final_samples": sample_final(run_dir / "checkpoint-120"),
        }
    text = json.dumps(report, indent=2)
    print(text)
    (ROOT / "bench" / "results" / "quickstart.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
