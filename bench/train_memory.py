"""Peak resident memory (RSS) per process of whole ``train.py`` runs on 2 CPU processes (torchrun, gloo), DDP against
FSDP2 (``--fsdp``), at max_async_level k = 0 and k = 1 (optionally k = 1 with vLLM's CPU build as the generator).

The policy is a random Llama of about 154M float32 parameters (transformers' ``LlamaConfig``, no hub) with the builtin
model's tokenizer, saved once to a temporary folder; each arm is one ``torchrun --nproc_per_node 2`` launch of this
file (``--entry``), which runs ``train.py`` in-process (``runpy``) for a 3-step full fine-tune and, at exit, writes the
rank's ``ru_maxrss`` (its own peak RSS, and separately the largest peak of the child processes it waited for, e.g.
vLLM's engine) and exit code. Reported per arm: both ranks' peaks, the largest, the wall time, and FSDP2/DDP at each
k; the numbers issue 41 measured before its change are kept beside them for comparison. Writes
``bench/results/train_memory.json`` and prints a table.

    .venv/bin/python bench/train_memory.py            # 4 arms (twice within --budget_s), 6+ minutes a pass
    .venv/bin/python bench/train_memory.py --vllm     # and the 2 vLLM arms once
    .venv/bin/python bench/train_memory.py --append --repeats 1   # one more pass beside the recorded ones
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fsdp_memory import cpu_model, machine  # noqa: E402  (bench/ is the script's directory)
OUT = ROOT / "bench" / "results" / "train_memory.json"
LLAMA = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12, "num_attention_heads": 16,
         "num_key_value_heads": 16, "max_position_embeddings": 512, "tie_word_embeddings": False}  # fmt: skip
TRAIN = ["--reward", "happy_binary", "--prompts", "builtin", "--max_steps", "3", "--batch_size", "8",
         "--num_generations", "4", "--max_completion_length", "16", "--no_wandb", "--save_strategy", "no",
         "--logging_steps", "1", "--gradient_checkpointing", "False", "--bf16", "False"]  # fmt: skip
ASYNC = ["--max_async_level", "1", "--disable_dropout"]
VLLM = ["--use_vllm", "--vllm_enforce_eager"]
ARMS = {"k0-ddp": [], "k0-fsdp2": ["--fsdp"], "k1-ddp": ASYNC, "k1-fsdp2": [*ASYNC, "--fsdp"]}
VLLM_ARMS = {"k1-vllm-ddp": [*ASYNC, *VLLM], "k1-vllm-fsdp2": [*ASYNC, *VLLM, "--fsdp"]}
ENV = {"WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
BEFORE = {"note": "issue 41, before its change; NOT measured by this script", "unit": "GB, largest process's peak RSS",
          "k0": {"ddp": 4.72, "fsdp2": 3.82, "fsdp2_over_ddp": 0.81},
          "k1": {"ddp": 5.93, "fsdp2": 6.82, "fsdp2_over_ddp": 1.15}}  # fmt: skip
GB = 1e9


def entry(argv: list[str]) -> None:
    """torchrun's entry point: run train.py with ``argv`` on this rank, then record its peak RSS and exit code."""
    import resource
    import runpy

    code = 0
    try:
        sys.argv = [str(ROOT / "train.py"), *argv]
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        code = 1
        raise
    finally:
        rank = int(os.environ.get("RANK", "0"))
        row = {"rank": rank, "exit_code": code,  # ru_maxrss: KiB on Linux
               "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "children_ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}  # fmt: skip
        (Path(os.environ["TRAIN_MEMORY_DIR"]) / f"rank{rank}.json").write_text(json.dumps(row))
    sys.exit(code)


def random_llama(out: Path) -> int:
    """A random float32 Llama of ``LLAMA`` with the builtin model's tokenizer, saved to ``out``; its parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trl_ext.models.builtin import ensure_builtin

    tok = AutoTokenizer.from_pretrained(ensure_builtin())
    cfg = LlamaConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                      bos_token_id=None, **LLAMA)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"random Llama: {n:,} parameters (vocab {len(tok)}) at {out}", flush=True)
    return n


def run_arm(name: str, flags: list[str], model: Path, tmp: Path, rep: int) -> dict:
    rss_dir, out_dir = tmp / f"{name}-{rep}-rss", tmp / f"{name}-{rep}-out"
    rss_dir.mkdir()
    cmd = [str(ROOT / ".venv" / "bin" / "python"), "-m", "torch.distributed.run", "--nproc_per_node", "2",
           __file__, "--entry", "--model", str(model), *TRAIN, *flags, "--output_dir", str(out_dir)]  # fmt: skip
    start = time.time()
    log = tmp / f"{name}-{rep}.log"  # a file, not a pipe: an orphaned vLLM engine would hold a pipe open for ever
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **ENV, "TRAIN_MEMORY_DIR": str(rss_dir)},
                              stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    ranks = sorted((json.loads(p.read_text()) for p in rss_dir.glob("rank*.json")), key=lambda r: r["rank"])
    row = {"arm": name, "repeat": rep, "returncode": proc.returncode, "wall_s": round(time.time() - start, 1),
           "ranks": ranks, "flags": flags}  # fmt: skip
    if ranks:
        row["largest_peak_rss_bytes"] = max(r["ru_maxrss_bytes"] for r in ranks)
    if proc.returncode != 0:
        row["error_tail"] = log.read_text(errors="replace").strip().splitlines()[-25:]
    print(line(row), flush=True)
    return row


def line(r: dict) -> str:
    ranks = " ".join(f"{x['ru_maxrss_bytes'] / GB:6.2f}" for x in r["ranks"]) or "-"
    kids = max((x["children_ru_maxrss_bytes"] for x in r["ranks"]), default=0) / GB
    largest = f"{r['largest_peak_rss_bytes'] / GB:8.2f}" if "largest_peak_rss_bytes" in r else f"{'-':>8}"
    return f"{r['arm']:14} {r['repeat']:>3} {largest} {ranks:>14} {kids:9.2f} {r['wall_s']:7.1f} {r['returncode']:>3}"


def ratios(runs: list[dict]) -> dict:
    """FSDP2/DDP of the largest process's peak RSS (mean over repeats) per k, where both arms succeeded."""
    def mean(arm):
        v = [r["largest_peak_rss_bytes"] for r in runs if r["arm"] == arm and r["returncode"] == 0]
        return sum(v) / len(v) if v else None

    out = {}
    for k in ("k0", "k1", "k1-vllm"):
        ddp, fsdp = mean(f"{k}-ddp"), mean(f"{k}-fsdp2")
        if ddp and fsdp:
            out[k] = {"ddp_gb": round(ddp / GB, 2), "fsdp2_gb": round(fsdp / GB, 2),
                      "fsdp2_over_ddp": round(fsdp / ddp, 2)}  # fmt: skip
    return out


def savings(runs: list[dict]) -> dict:
    """DDP minus FSDP2 (largest process's peak RSS, GB) per repeat where both arms succeeded, per k: each repeat's
    value, their mean and standard error, and at k = 1 the paired difference from k = 0 (same repeat)."""
    def per_repeat(k):
        peak = {(r["arm"], r["repeat"]): r["largest_peak_rss_bytes"] / GB for r in runs if r["returncode"] == 0}
        return {rep: peak[(f"{k}-ddp", rep)] - peak[(f"{k}-fsdp2", rep)]
                for (arm, rep) in peak if arm == f"{k}-ddp" and (f"{k}-fsdp2", rep) in peak}  # fmt: skip

    def stats(values):
        n = len(values)
        mean = sum(values) / n
        se = (sum((v - mean) ** 2 for v in values) / (n - 1) / n) ** 0.5 if n > 1 else None
        return {"n": n, "mean_gb": round(mean, 3), "se_gb": None if se is None else round(se, 3),
                "values_gb": [round(v, 2) for v in values]}  # fmt: skip

    out = {}
    for k in ("k0", "k1", "k1-vllm"):
        by_rep = per_repeat(k)
        if by_rep:
            out[k] = stats([by_rep[r] for r in sorted(by_rep)])
    k0, k1 = per_repeat("k0"), per_repeat("k1")
    common = sorted(set(k0) & set(k1))
    if common:
        out["k0_minus_k1_paired"] = stats([k0[r] - k1[r] for r in common])
    return out


def main() -> None:
    if sys.argv[1:2] == ["--entry"]:
        return entry(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="runs of each arm (the 2nd only within --budget_s)")
    ap.add_argument("--budget_s", type=float, default=720, help="skip further repeats predicted to end past this")
    ap.add_argument("--vllm", action="store_true", help="also k = 1 with --use_vllm --vllm_enforce_eager, once each")
    ap.add_argument("--append", action="store_true", help="add the runs to those already in the results file "
                    "(the same random model: seed 0), numbering their repeats on")
    ap.add_argument("--summarise", action="store_true", help="recompute the summaries of the results file's runs "
                    "and print them (runs nothing)")
    a = ap.parse_args()
    if a.summarise:
        result = json.loads(OUT.read_text())
        result["after (this script)"], result["sharding saves (DDP - FSDP2)"] = ratios(result["runs"]), savings(result["runs"])
        OUT.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: result[k] for k in ("after (this script)", "sharding saves (DDP - FSDP2)")}, indent=1))
        return
    load_before, start = os.getloadavg(), time.time()
    print(f"cpu: {cpu_model()}; load average at start: {load_before}", flush=True)
    old = json.loads(OUT.read_text()) if a.append else {"runs": []}
    runs, first = old["runs"], 1 + max((r["repeat"] for r in old["runs"]), default=0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        n_params = random_llama(tmp / "model")
        print(f"{'arm':14} {'rep':>3} {'max GB':>8} {'rank0/1 GB':>14} {'child GB':>9} {'wall s':>7} {'rc':>3}")
        for rep in range(first, first + a.repeats):
            done = rep - first
            if done and (time.time() - start) * (done + 1) / done > a.budget_s:
                print(f"repeat {rep} skipped: predicted past --budget_s {a.budget_s:.0f}", flush=True)
                break
            runs += [run_arm(name, flags, tmp / "model", tmp, rep) for name, flags in ARMS.items()]
        if a.vllm:
            runs += [run_arm(name, flags, tmp / "model", tmp, first) for name, flags in VLLM_ARMS.items()]
    result = {
        "what": "peak RSS (ru_maxrss) per process of whole train.py runs, 2 CPU processes (torchrun), DDP vs FSDP2",
        "llama_config": LLAMA, "parameters": n_params, "train_flags": TRAIN, "env": ENV,
        "runs": runs, "after (this script)": ratios(runs), "sharding saves (DDP - FSDP2)": savings(runs),
        "before (issue 41)": BEFORE,
        "machine": machine(load_before), "wall_s": round(time.time() - start, 1),
    }  # fmt: skip
    if a.append:
        result["earlier passes"] = [*old.get("earlier passes", []), {"machine": old["machine"], "wall_s": old["wall_s"]}]
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    for k, v in result["after (this script)"].items():
        b = BEFORE.get(k)
        was = f" (before, issue 41: {b['fsdp2']} vs {b['ddp']} GB, {b['fsdp2_over_ddp']}x)" if b else ""
        print(f"{k}: FSDP2 {v['fsdp2_gb']} GB vs DDP {v['ddp_gb']} GB = {v['fsdp2_over_ddp']}x{was}")
    for r in runs:
        if r["returncode"] != 0:
            tail = "\n  ".join(r["error_tail"][-8:])
            print(f"{r['arm']} (repeat {r['repeat']}) failed, rc {r['returncode']}:\n  {tail}")
    print(f"load average at end: {result['machine']['load_after']}; {result['wall_s']} s; "
          f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
