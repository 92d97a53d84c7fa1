"""The dry runs docs/layout.md shows ("First run on GPUs"), written to ``bench/results/dry_run-*.txt``: Qwen2.5-7B's
config alone (no weights) planned by ``layout.py --dry_run --plan_gpus`` on 8 x 80 GiB (fits) and with policy and
teacher on one 24 GiB GPU (refused, exit 2).

    uv run python bench/dry_run_examples.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"
TRAIN = ["--reward", "happy_binary", "--lora_rank", "16", "--bf16", "--teacher_tau", "1", "--temperature", "1",
         "--per_device_train_batch_size", "4", "--activation_checkpointing"]  # fmt: skip
RUNS = {  # name: (layout.py flags, extra train.py flags)
    "qwen2.5-7b-8x80": (["--plan_gpus", "8x80", "--inference_gpu_ids", "0", "--teacher_gpu_ids", "1",
                         "--trainer_gpu_ids", "2,3,4,5,6,7", "--max_model_len", "4096"],
                        ["--fsdp", "full_shard auto_wrap"]),
    "qwen2.5-7b-1x24-refused": (["--plan_gpus", "1x24,1x80", "--inference_gpu_ids", "0", "--teacher_gpu_ids", "0",
                                 "--trainer_gpu_ids", "1", "--max_model_len", "4096"], []),
}  # fmt: skip


def qwen7b(path: Path) -> Path:
    """Qwen2.5-7B's config (hidden 3584, 28 layers, 28 heads, 4 KV heads, MLP 18944, vocabulary 152064, untied)."""
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False,
                architectures=["Qwen2ForCausalLM"]).save_pretrained(path)  # fmt: skip
    return path


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model = qwen7b(Path(tmp) / "qwen2.5-7b-config")
        for name, (layout, train) in RUNS.items():
            cmd = [sys.executable, "layout.py", "--dry_run", *layout, "--", "--model", str(model), *TRAIN, *train]
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
            shown = " ".join(a if " " not in a else repr(a) for a in cmd[1:]).replace(str(model), "QWEN7B_CONFIG")
            text = f"$ {shown}\n{(out.stdout + out.stderr).replace(str(model), 'QWEN7B_CONFIG')}exit {out.returncode}\n"
            (OUT / f"dry_run-{name}.txt").write_text(text)
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
