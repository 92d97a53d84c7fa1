"""GPU readiness check: one script a lent GPU machine runs in under 10 minutes, printing one table.

Arms, each a real train.py run (``torchrun --nproc_per_node 1`` for the FSDP2 arms), ``--steps`` steps of which the
first ``--warmup`` are dropped; per arm the median (min-max) of train.py's logged ``step_time`` and the process's
peak GPU memory (``torch.cuda.max_memory_allocated``):

1. the builtin model's whole GRPO step (batch 32, 16 generations, 64 tokens) with each generation backend:
   TRL's generation, the fast backend, and the fast backend as the off-policy generator (k = 1);
2. a ~0.5B random Qwen2 (Qwen2.5-0.5B's shape with the builtin tokenizer's vocabulary; bf16, built offline) with
   PEFT LoRA (rank 16) and with gradient routing (dual LoRA r8);
3. FSDP2 on the one GPU (world size 1): the same model's plain full fine-tune and its routed step.

vLLM has no arm: the GPU machine's image carries neither TRL nor vLLM, and vLLM is larger than what a call can carry.

    python bench/gpu_check.py                  # on the GPU machine (TRL and the project's dependencies installed)
    uv run python bench/gpu_check.py --smoke   # CPU: a tiny model, FSDP arms skipped (they need CUDA): a code check
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "intermediate_size": 4864, "max_position_embeddings": 1024}  # fmt: skip
SMOKE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 128, "max_position_embeddings": 512}  # fmt: skip
BUILTIN_STEP = ["--reward", "happy_binary", "--model", "builtin", "--batch_size", "32", "--num_generations", "16",
                "--max_completion_length", "64"]  # fmt: skip
ROUTED = ["--reward", "sentence_length_5_with_happy", "--gradient_routing", "--routing_mode", "shared",
          "--lora_config", "r8", "--eval_routing_steps", "0"]  # fmt: skip
CHILD = """import sys, torch
from trl_ext.cli_train import main
code = main(sys.argv[1:])
peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else float("nan")
print(f"PEAK_MIB {peak:.0f}", flush=True)
sys.exit(code)
"""


def random_qwen(out: Path, shape: dict) -> Path:
    """A random Qwen2 of ``shape`` with the builtin model's tokenizer, saved to ``out`` (bfloat16 weights)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from trl_ext.models.builtin import ensure_builtin

    builtin = ensure_builtin()
    tok = AutoTokenizer.from_pretrained(builtin)
    cfg = Qwen2Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                      bos_token_id=None, tie_word_embeddings=True, **shape)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"random Qwen2: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters at {out}", flush=True)
    return out


def run_arm(name: str, flags: list[str], steps: int, warmup: int, out: Path, fsdp: bool) -> dict:
    """One train.py run; its median / min / max step time over the steps after ``warmup`` and its peak memory."""
    run_out = out / name.replace(" ", "_")
    script = out / "child.py"
    script.write_text(CHILD)
    argv = [*flags, "--max_steps", str(steps), "--logging_steps", "1", "--save_steps", str(steps), "--no_wandb",
            "--output_dir", str(run_out)]  # fmt: skip
    if fsdp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", str(script), "--fsdp", *argv]
    else:
        cmd = [sys.executable, str(script), *argv]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"arm": name, "error": (proc.stdout + proc.stderr).strip().splitlines()[-1][:200]}
    (state,) = run_out.glob(f"*/checkpoint-{steps}/trainer_state.json")
    times = [r["step_time"] for r in json.loads(state.read_text())["log_history"] if "step_time" in r][warmup:]
    peak = next((float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("PEAK_MIB")), None)
    return {"arm": name, "median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times),
            "peak_mib": peak}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a tiny model on any device, FSDP arms only with CUDA")
    ap.add_argument("--out", default=None, help="also write the rows as JSON to this file")
    a = ap.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not a.smoke:
        print("no CUDA device: run with --smoke for a CPU code check", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        large = str(random_qwen(work / "qwen", SMOKE if a.smoke else QWEN_05B))
        large = ["--model", large, "--prompts", "builtin", "--batch_size", "16", "--num_generations", "8",
                 "--max_completion_length", "64", *(["--bf16"] if cuda else [])]  # fmt: skip
        big, routed = ["--reward", "happy_binary", *large], [*ROUTED, *large]
        size = "tiny qwen2 (smoke)" if a.smoke else "qwen2-0.5B shape"
        arms = [("builtin, TRL generation", BUILTIN_STEP, False),
                ("builtin, fast backend", [*BUILTIN_STEP, "--generation_backend", "fast"], False),
                ("builtin, fast backend k=1", [*BUILTIN_STEP, "--generation_backend", "fast", "--max_async_level", "1"],
                 False),
                (f"{size}, LoRA r16", [*big, "--lora_rank", "16", "--lr", "1e-4"], False),
                (f"{size}, routing r8", [*routed, "--lr", "1e-4"], False),
                (f"{size}, FSDP2 x1 full", [*big, "--lr", "1e-6"], True),
                (f"{size}, FSDP2 x1 routing", [*routed, "--lr", "1e-4"], True)]  # fmt: skip
        rows = []
        for name, flags, fsdp in arms:
            if fsdp and not cuda:
                rows.append({"arm": name, "error": "skipped: FSDP2 on one process needs CUDA"})
                continue
            rows.append(run_arm(name, flags, a.steps, a.warmup, work, fsdp))
            print(rows[-1], flush=True)
        device = torch.cuda.get_device_name(0) if cuda else "CPU (smoke)"
        print(f"\n{device}, torch {torch.__version__}; {a.steps} steps, first {a.warmup} dropped")
        print(f"| {'arm':<36} | s/step median (min-max) | peak GPU MiB |")
        print(f"|{'-' * 38}|{'-' * 25}|{'-' * 14}|")
        for r in rows:
            if "error" in r:
                print(f"| {r['arm']:<36} | {r['error']} | |")
            else:
                print(f"| {r['arm']:<36} | {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}) | {r['peak_mib']:.0f} |")
        if a.out:
            Path(a.out).write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1))
        return 1 if any("error" in r and not r["error"].startswith("skipped") for r in rows) else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
