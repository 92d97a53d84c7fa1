"""GPU readiness check (issue 41): one script a lent GPU machine runs in under 10 minutes, printing one table.

Every arm trains a ~0.5B random Qwen2 (Qwen2.5-0.5B's shape with the builtin tokenizer's vocabulary, bf16, built
offline) for ``--steps`` steps on the story prompts (batch 16, 8 generations, 64 tokens), in its own process (the
FSDP2 arms under ``torchrun --nproc_per_node 1``: FSDP2 over nccl, world size 1). The run is assembled as train.py
assembles it (`trl_ext.cli_train.build_plan` / `assemble`), then trained by TRL's own ``GRPOTrainer`` (the "TRL" arms,
same arguments, model, adapters and prompts) or by ``ExtGRPOTrainer``; one callback times each step (CUDA
synchronised) and, at the first step, reads the device of every model copy: the policy, TRL's reference model and
the off-policy generator's copy. Per arm: the median (min-max) s/step over the steps after ``--warmup``, the ratio of
medians to the TRL arm it is paired with, ``torch.cuda.max_memory_allocated`` and the devices. One run per arm: a
readiness check, not a benchmark (``bench/bench_gpu.py`` alternates rounds).

vLLM has no arm: the machine's image carries neither TRL nor vLLM, and vLLM's wheel is larger than a call can carry
(its placement is unit-tested: ``trl_ext.vllm.placement``).

    python bench/gpu_check.py --out bench/results/gpu_check.json   # on the GPU machine
    uv run python bench/gpu_check.py --smoke                       # CPU code check: a tiny model, FSDP2 on 2 processes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "intermediate_size": 4864, "max_position_embeddings": 1024}  # fmt: skip
SMOKE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 128, "max_position_embeddings": 512}  # fmt: skip
LORA = ["--reward", "happy_binary", "--lora_rank", "16", "--lr", "1e-4"]
ROUTED = ["--reward", "sentence_length_5_with_happy", "--gradient_routing", "--routing_mode", "shared",
          "--lora_config", "r8", "--eval_routing_steps", "0", "--lr", "1e-4"]  # fmt: skip
K1 = ["--max_async_level", "1", "--disable_dropout"]
ARMS = [  # (name, trainer, flags, FSDP2, the TRL arm it is compared with)
    ("TRL, LoRA r16", "trl", LORA, False, None),
    ("ext, LoRA r16", "ext", LORA, False, "TRL, LoRA r16"),
    ("ext, routing r8", "ext", ROUTED, False, "TRL, LoRA r16"),
    ("TRL, FSDP2 x1, LoRA r16", "trl", LORA, True, None),
    ("ext, FSDP2 x1, LoRA r16", "ext", LORA, True, "TRL, FSDP2 x1, LoRA r16"),
    ("ext, FSDP2 x1, routing r8", "ext", ROUTED, True, "TRL, FSDP2 x1, LoRA r16"),
    ("ext, FSDP2 x1, LoRA r16, k=1", "ext", [*LORA, *K1], True, "TRL, FSDP2 x1, LoRA r16"),
    ("ext, FSDP2 x1, full, k=1", "ext", ["--reward", "happy_binary", "--lr", "1e-6", *K1], True, None),
]  # fmt: skip


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


def _devices(module) -> list[str]:
    return sorted({str(p.device) for p in module.parameters()}) if module is not None else []


def child(kind: str, argv: list[str], result: str) -> int:
    """One arm: the run train.py would assemble from ``argv``, trained by TRL's GRPOTrainer (``kind`` "trl") or by
    ExtGRPOTrainer ("ext"); step times, peak memory and model devices written to ``result`` (JSON) by process 0."""
    import copy
    import inspect

    import torch
    from transformers import TrainerCallback, set_seed

    from trl_ext.cli_train import assemble, build_plan
    from trl_ext.models import load_tokenizer, model_source, prepare_tokenizer

    class Probe(TrainerCallback):
        def __init__(self):
            self.times, self.devices, self.trainer, self._t = [], None, None, 0.0

        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            self.times.append(time.perf_counter() - self._t)
            if self.devices is None:
                t = self.trainer
                worker = getattr(t, "_rollout_worker", None)
                self.devices = {"policy": _devices(t.model), "reference": _devices(getattr(t, "ref_model", None)),
                                "generator copy": _devices(worker.model if worker is not None else None)}  # fmt: skip

    plan = build_plan(argv)
    set_seed(plan.cfg.seed)
    model_path = model_source(plan.run.model)
    tokenizer = prepare_tokenizer(load_tokenizer(model_path))
    build = assemble(plan, model_path, tokenizer)
    kwargs = dict(build.kwargs)
    probe = Probe()
    kwargs["callbacks"] = [*kwargs.get("callbacks", []), probe]
    if kind == "trl":
        from trl import GRPOTrainer

        accepted = inspect.signature(GRPOTrainer.__init__).parameters
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}  # the project's own keywords dropped
        vanilla = copy.deepcopy(tokenizer)  # the project tokenizes prompts without the [EOS] the builtin adds
        vanilla._tokenizer.post_processor = None
        kwargs["processing_class"] = vanilla
        trainer = GRPOTrainer(model=build.model, **kwargs)
    else:
        from trl_ext.trainer import ExtGRPOTrainer

        trainer = ExtGRPOTrainer(model=build.model, **kwargs)
    probe.trainer = trainer
    trainer.train()
    if trainer.accelerator.is_main_process:
        peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
        Path(result).write_text(json.dumps({"times": probe.times, "peak_mib": peak, "devices": probe.devices}))
    return 0


def run_arm(name, kind, flags, fsdp, model_flags, a, work: Path) -> dict:
    result = work / f"{name.replace(' ', '_').replace(',', '').replace('=', '')}.json"
    argv = [*flags, *model_flags, "--max_steps", str(a.steps), "--logging_steps", "1", "--save_strategy", "no",
            "--no_wandb", "--output_dir", str(work / "runs" / result.stem)]  # fmt: skip
    this = [str(Path(__file__).resolve()), "--child", kind, "--result", str(result), "--"]
    if fsdp:
        procs = "1" if not a.smoke else "2"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", procs, *this, *argv, "--fsdp"]
    else:
        cmd = [sys.executable, *this, *argv]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=a.arm_timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not result.exists():
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        first = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), max(0, len(lines) - 40))
        tail = [line for line in lines[first:] if line.strip()][:80]
        print("\n".join(tail), flush=True)
        tail = [line for line in tail if "Error" in line] or tail
        return {"arm": name, "error": tail[-1][:300] if tail else f"exit {proc.returncode}", "wall_s": wall}
    got = json.loads(result.read_text())
    times = got["times"][a.warmup :]
    return {"arm": name, "median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times),
            "peak_mib": got["peak_mib"], "devices": got["devices"], "wall_s": wall}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="CPU code check: a tiny model, the FSDP2 arms on 2 processes")
    ap.add_argument("--arm_timeout", type=int, default=240)
    ap.add_argument("--arms", nargs="*", help="only the arms whose names contain one of these")
    ap.add_argument("--out", default=None, help="also write the rows as JSON to this file")
    ap.add_argument("--child", choices=["trl", "ext"], help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a, rest = ap.parse_known_args()
    if a.child:
        return child(a.child, [x for x in rest if x != "--"], a.result)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not a.smoke:
        print("no CUDA device: run with --smoke for a CPU code check", file=sys.stderr)
        return 2
    os.environ.setdefault("WANDB_MODE", "disabled")
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        model = str(random_qwen(work / "qwen", SMOKE if a.smoke else QWEN_05B))
        model_flags = ["--model", model, "--prompts", "builtin", "--batch_size", "16", "--num_generations", "8",
                       "--max_completion_length", "64", "--bf16", str(cuda), "--gradient_checkpointing", "False"]
        rows = []
        for name, kind, flags, fsdp, _ in ARMS:
            if a.arms and not any(part in name for part in a.arms):
                continue
            rows.append(run_arm(name, kind, flags, fsdp, model_flags, a, work))
            print(json.dumps(rows[-1]), flush=True)
        medians = {r["arm"]: r["median"] for r in rows if "median" in r}
        pairs = {arm[0]: arm[-1] for arm in ARMS}
        for r in rows:
            paired = pairs[r["arm"]]
            if "median" in r and paired in medians:
                r["ratio"], r["paired_with"] = r["median"] / medians[paired], paired
        device = torch.cuda.get_device_name(0) if cuda else "CPU (smoke)"
        print(f"\n{device}, torch {torch.__version__}; {a.steps} steps per arm, first {a.warmup} dropped; one run per "
              "arm; ratio = this arm's median / its TRL arm's")
        print(f"| {'arm':<30} | s/step median (min-max) | ratio | peak GPU MiB | policy / reference / generator copy |")
        print(f"|{'-' * 32}|{'-' * 25}|{'-' * 7}|{'-' * 14}|{'-' * 37}|")
        for r in rows:
            if "error" in r:
                print(f"| {r['arm']:<30} | {r['error']} |")
                continue
            ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
            peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-"
            dev = " / ".join(",".join(v) or "none" for v in r["devices"].values())
            print(f"| {r['arm']:<30} | {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}) | {ratio} | {peak} | {dev} |")
        if a.out:
            Path(a.out).write_text(json.dumps({"device": device, "torch": torch.__version__, "steps": a.steps,
                                               "warmup": a.warmup, "rows": rows}, indent=1))  # fmt: skip
        return 1 if any("error" in r for r in rows) else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
