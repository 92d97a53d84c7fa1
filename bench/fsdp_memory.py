"""Per-process memory of FSDP2 (``fully_shard``) against DDP on 2 CPU processes (gloo), after one AdamW step of a random
Llama of a few hundred million float32 parameters (no hub: transformers' ``LlamaConfig``).

Each arm is one ``torchrun --nproc_per_node 2`` launch of this file (``--worker``). Every rank builds the whole model
on CPU, as train.py does (transformers' ``from_pretrained`` on every rank), then

- ``ddp``: wraps it in ``DistributedDataParallel`` (replicated parameters, gradients and optimizer state);
- ``fsdp2``: ``fully_shard`` on every decoder layer, then on the root (the layers accelerate's TRANSFORMER_BASED_WRAP
  wraps, and the rest in the root's unit), so that parameters, gradients and AdamW's state are DTensor shards;

and takes one forward/backward/AdamW step on 2 sequences of 32 tokens per process. Counted per process: the bytes of
its parameters, gradients and AdamW state tensors (a DTensor counts its local shard, ``DTensor.to_local()``), and the
process's peak RSS (``ru_maxrss``, which includes the whole model built before sharding, activations, DDP's gradient
buckets and Python/torch itself). Writes ``bench/results/fsdp_memory.json`` and prints a table.

    uv run python bench/fsdp_memory.py              # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results" / "fsdp_memory.json"
LLAMA = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 20, "num_attention_heads": 16,
         "num_key_value_heads": 16, "vocab_size": 32000, "max_position_embeddings": 512,
         "tie_word_embeddings": False}  # fmt: skip
BATCH, TOKENS, LR = 2, 32, 1e-4
ARMS = ("ddp", "fsdp2")
MiB = 2**20


def local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def nbytes(tensors) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def worker(arm: str, out: Path) -> None:
    """One arm on this process (a torchrun rank): build, wrap, one AdamW step, count; rank 0 writes ``out``."""
    import resource

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    start = time.time()
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).float()  # the whole model on every rank, as from_pretrained
    n_params = sum(p.numel() for p in model.parameters())
    if arm == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        wrapped = model
        assert sum(isinstance(m, FSDPModule) for m in model.modules()) == LLAMA["num_hidden_layers"] + 1
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    torch.manual_seed(rank + 1)
    ids = torch.randint(0, LLAMA["vocab_size"], (BATCH, TOKENS))
    loss = wrapped(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss: KiB on Linux
    grads = [p.grad for p in params if p.grad is not None]
    row = {"rank": rank, "param_bytes": nbytes(params), "grad_bytes": nbytes(grads),
           "adamw_state_bytes": nbytes(state), "peak_rss_bytes": peak_rss, "loss": loss.item(),
           "wall_s": round(time.time() - start, 1)}  # fmt: skip
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        out.write_text(json.dumps({"arm": arm, "processes": world, "parameters": n_params, "ranks": rows}))
    dist.barrier()
    dist.destroy_process_group()


def run_arm(arm: str, tmp: Path) -> dict:
    from trl_ext.launch.command import torchrun_command

    out = tmp / f"{arm}.json"
    cmd = torchrun_command([__file__, "--worker", arm, "--out", str(out)])
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    lines = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return lines[0] if lines else platform.machine()


def machine(load_before) -> dict:
    """The machine a memory benchmark ran on: CPU model, cores, torch, the load average before and after."""
    import torch

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
            "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()]}


def table(result: dict) -> str:
    cols = ("param_bytes", "grad_bytes", "adamw_state_bytes", "params+adamw", "peak_rss_bytes")
    lines = [f"{'arm':6} {'rank':>4} " + " ".join(f"{c.removesuffix('_bytes') + ' MiB':>18}" for c in cols)]
    for arm in ARMS:
        for r in result["arms"][arm]["ranks"]:
            values = {**r, "params+adamw": r["param_bytes"] + r["adamw_state_bytes"]}
            lines.append(f"{arm:6} {r['rank']:>4} " + " ".join(f"{values[c] / MiB:>18,.0f}" for c in cols))
    return "\n".join(lines)


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.out)
    load_before, start = os.getloadavg(), time.time()
    with tempfile.TemporaryDirectory() as tmp:
        arms = {arm: run_arm(arm, Path(tmp)) for arm in ARMS}
    ddp, fsdp = ({k: max(r[k] for r in arms[a]["ranks"]) for k in arms[a]["ranks"][0]} for a in ARMS)
    result = {
        "what": "per-process bytes after one AdamW step, 2 CPU processes (gloo), random Llama, float32",
        "llama_config": LLAMA, "parameters": arms["ddp"]["parameters"], "batch_per_process": [BATCH, TOKENS],
        "arms": arms,
        "fsdp2_over_ddp": {k: round(fsdp[k] / ddp[k], 3) for k in ("param_bytes", "grad_bytes", "adamw_state_bytes",
                                                                   "peak_rss_bytes")},
        "machine": machine(load_before), "wall_s": round(time.time() - start, 1),
    }  # fmt: skip
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"FSDP2 / DDP (largest rank): {result['fsdp2_over_ddp']}; {result['parameters']:,} parameters; "
          f"{result['wall_s']} s; wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
