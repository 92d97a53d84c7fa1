"""GPU readiness check for a lent GPU machine (PyTorch there, neither TRL nor vLLM): one script, one JSON, < 8 min.

A random Qwen2 of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, tied
embeddings) with Qwen2.5's vocabulary size, 151,936 rows, is built offline and saved in bf16 with the builtin
tokenizer (336 tokens): the rows beyond the tokenizer are padding, as in Qwen2.5 (151,936 rows, 151,665 tokens).
Padding rows and EOS are zeroed (logit 0), the real tokens' logits spread (`LOGIT_STD`): padding and EOS are hardly
ever sampled and every completion is full length; the logits are real-vocabulary sized, so their memory shows. Arms
(`ARMS`), each in its own process (FSDP2: torchrun, a process per visible GPU), the device pinned
(``CUDA_VISIBLE_DEVICES`` for one process, ``torch.cuda.set_device(LOCAL_RANK)`` in each):

1. one process, LoRA r16, k = 0;  2. FSDP2 in bf16 over NCCL, LoRA r16;  3. FSDP2 full fine-tune at in-flight
k = 1 (``--max_async_level 1``, not strict: the generator thread's copy takes each version between decoding steps,
on its CUDA stream);  4. one process, LoRA r16, ``--long_tokens`` (512) completion tokens (fast sampler).

Each is assembled as train.py assembles it (`build_plan`, `assemble`) and trained by ExtGRPOTrainer in bf16. Per
arm: s/step (median/min/max after ``--warmup``), ``torch.cuda.max_memory_allocated`` per process, the device of each
model copy (policy, reference, generator copy), the process group's backend, the parameters' dtypes after prepare
(FSDP2's mixed-precision policy), the losses, the lag-0 sampling gap (k = 1: ``offpolicy/abs_log_ratio_mean`` where
``offpolicy/policy_lag_max`` is 0) and pass/fail checks. Arms that would end after ``--budget_s`` are skipped.

On the lent machine, from the repository root, with ``wheels/`` carried (made here: ``uv run python
bench/gpu_check.py --wheels wheels/``; `wheel_plan` lists them):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        wheels/*.whl && PYTHONPATH=/tmp/site python3 bench/gpu_check.py --out $OUT/gpu_check.json

Here (CPU code check, the same code path: a tiny model, vocabulary 1024 > 336, FSDP2 over gloo on 2 processes):

    uv run python bench/gpu_check.py --smoke --out /tmp/gpu_check_smoke.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QWEN_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "intermediate_size": 4864, "max_position_embeddings": 32768, "vocab_size": 151936}  # fmt: skip
SMOKE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 128, "max_position_embeddings": 1024, "vocab_size": 1024}  # fmt: skip
LOGIT_STD = 8.0
"""Spread of the real tokens' logits (padding and EOS sit at 0, far below the top token: 3e-5 of the probability at
the 0.5B shape). The final norm's scale is negative: a tied random model otherwise repeats its last token (its own
embedding dominates the residual stream); so the samples vary and the reward has a spread."""
LORA = ["--lora_rank", "16", "--lr", "1e-4"]
ARMS = [  # (name, train.py flags, FSDP2, long completions)
    ("1 proc, LoRA r16, k=0", LORA, False, False),
    ("FSDP2 xN, LoRA r16, k=0", LORA, True, False),
    ("FSDP2 xN, full, in-flight k=1", ["--lr", "1e-6", "--max_async_level", "1", "--disable_dropout"], True, False),
    ("1 proc, LoRA r16, long", [*LORA, "--generation_backend", "fast"], False, True),
]  # fmt: skip
GAP, LAG, TRL_GAP = "offpolicy/abs_log_ratio_mean", "offpolicy/policy_lag_max", "sampling/sampling_logp_difference/mean"
HEADER = ("processes:", "off-policy", "train prompts")  # train.log's launch lines


def random_qwen(out: Path, shape: dict) -> dict:
    """The random model (module docstring) saved to ``out``; returns its description."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_ext.models import load_tokenizer, model_source

    tok = load_tokenizer(model_source("builtin"))
    if shape["vocab_size"] <= len(tok):
        raise ValueError(f"vocab_size {shape['vocab_size']} must exceed the tokenizer's {len(tok)} tokens")
    cfg = Qwen2Config(eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, bos_token_id=None,
                      tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, **shape)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    emb = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr(), "embeddings not tied"
    with torch.no_grad():
        emb[len(tok):] = 0  # padding rows and EOS: logit exactly 0
        emb[tok.eos_token_id] = 0
        ids = tok("once upon a time there was a little dog who liked the sun", return_tensors="pt").input_ids
        real = [i for i in range(len(tok)) if i != tok.eos_token_id]
        model.model.norm.weight.mul_(-LOGIT_STD / model(ids).logits[0][:, real].std().item())
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    info = {"vocab_size": cfg.vocab_size, "tokenizer_len": len(tok), "tied": True, "dtype": "bfloat16",
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
            **{k: v for k, v in shape.items() if k != "vocab_size"}}  # fmt: skip
    print(f"random Qwen2: {info}", flush=True)
    return info


# ------------------------------------------------------------------------------------------ one arm (child process)
def _devices(module) -> list[str]:
    return sorted({str(p.device) for p in module.parameters()})


def inspect_trainer(trainer, expected: str) -> dict:
    """Where every model copy lives, the process group, the prepared parameters' dtypes (read at the first step)."""
    from collections import Counter

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    model = trainer.model_wrapped if trainer.model_wrapped is not None else trainer.model
    offpolicy = trainer.components.offpolicy
    worker, ref = offpolicy.worker if offpolicy else None, getattr(trainer, "ref_model", None)
    devices = {"policy": _devices(model),
               "reference": _devices(ref) if ref is not None else "policy, adapters off" if trainer.beta else "none",
               "generator copy": _devices(worker.model) if worker is not None and worker.model is not None else "none"}
    mp = str(model._get_fsdp_state()._mp_policy) if isinstance(model, FSDPModule) else None  # torch's FSDP2 state
    params, on, dev = list(model.parameters()), dist.is_initialized(), trainer.accelerator.device
    if dev.type == "cuda" and dev.index is None:  # accelerate's one-process device: the current one
        dev = torch.device("cuda", torch.cuda.current_device())
    dev = "cpu" if dev.type == "cpu" else str(dev)
    return {"expected_device": expected, "devices": devices, "accelerator_device": dev,
            "current_device": torch.cuda.current_device() if torch.cuda.is_available() else None,
            "backend": dist.get_backend() if on else None, "world_size": dist.get_world_size() if on else 1,
            "parallelism": trainer.parallelism.describe() if getattr(trainer, "parallelism", None) else None,
            "mixed_precision": trainer.accelerator.mixed_precision, "fsdp_mp_policy": mp,
            "dtypes": {"trainable": dict(Counter(str(p.dtype) for p in params if p.requires_grad)),
                       "frozen": dict(Counter(str(p.dtype) for p in params if not p.requires_grad))}}  # fmt: skip


def child(result: str, argv: list[str]) -> int:
    """One arm: train the run train.py would assemble from ``argv``; each process writes ``result.rankR.json``."""
    import torch
    from transformers import TrainerCallback, set_seed

    from trl_ext.cli_train import assemble, build_plan
    from trl_ext.launch.processes import end_processes
    from trl_ext.models import load_tokenizer, model_source, prepare_tokenizer
    from trl_ext.runs.rundir import add_launch_header
    from trl_ext.trainer import ExtGRPOTrainer

    rank, cuda = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    expected, sync = (f"cuda:{rank}", torch.cuda.synchronize) if cuda else ("cpu", lambda: None)

    class Probe(TrainerCallback):
        def __init__(self):
            self.times, self.info, self.trainer, self.version, self.t0 = [], None, None, None, 0.0

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            self.times.append(time.perf_counter() - self.t0)
            self.info = self.info or inspect_trainer(self.trainer, expected)

        def on_train_end(self, args, state, control, **kw):  # the version the generator's copy holds at the end
            offpolicy = self.trainer.components.offpolicy
            worker = offpolicy.worker if offpolicy else None
            self.version = worker.loaded_version if worker is not None else None

    plan = build_plan(argv)
    set_seed(plan.cfg.seed)
    model_path = model_source(plan.run.model)
    tokenizer = prepare_tokenizer(load_tokenizer(model_path))
    build = assemble(plan, model_path, tokenizer, main_process=rank == 0)
    probe = Probe()
    trainer = probe.trainer = ExtGRPOTrainer(model=build.model, **{**build.kwargs, "callbacks": [probe]})
    add_launch_header(plan, trainer)
    trainer.train()
    out = {"rank": rank, "times": probe.times, "info": probe.info, "generator_version": probe.version,
           "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
           "log_history": trainer.state.log_history if rank == 0 else None}  # fmt: skip
    Path(f"{result}.rank{rank}.json").write_text(json.dumps(out, default=str))
    end_processes()
    return 0


# ------------------------------------------------------------------------------------------ the arms (parent)
def _run(cmd: list[str], env: dict, timeout: float, log: Path) -> tuple[int | None, float]:
    """``cmd`` in its own process group (torchrun's workers included) with output to ``log``; None on timeout."""
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, time.perf_counter() - start


def run_arm(arm: tuple, common: list[str], a, work: Path, gpus: int, timeout: float) -> dict:
    name, flags, fsdp, long = arm
    procs = (2 if a.smoke else max(1, gpus)) if fsdp else 1
    name = name.replace("xN", f"x{procs}")
    slug = "".join(c if c.isalnum() else "_" for c in name)
    tokens = a.long_tokens if long else a.tokens
    argv = [*flags, *common, "--max_completion_length", str(tokens), "--output_dir", str(work / "runs" / slug)]
    me = [str(Path(__file__).resolve()), "--child", "--result", str(work / slug), "--"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs), *me,
           *argv, "--fsdp", "full_shard auto_wrap"] if fsdp else [sys.executable, *me, *argv]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if gpus and not fsdp:  # one process: pinned to the first visible GPU
        env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    elif not fsdp:
        cmd += ["--use_cpu", "True"]  # smoke: bf16 on one CPU process (several get it from trl_ext.launch)
    log = work / f"{slug}.log"
    code, wall = _run(cmd, env, timeout, log)
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    row = {"arm": name, "processes": procs, "completion_tokens": tokens, "flags": " ".join(flags + ["--fsdp"] * fsdp),
           "wall_s": round(wall, 1), "header": [x for x in lines if x.startswith(HEADER)]}  # fmt: skip
    ranks = [json.loads(p.read_text()) for p in sorted(work.glob(f"{slug}.rank*.json"))]
    if code == 0 and len(ranks) == procs:
        return {**row, **summarise(ranks, a, fsdp, gpus)}
    first = next((i for i, x in enumerate(lines) if x.startswith("Traceback")), max(0, len(lines) - 30))
    why = f"timed out after {timeout:.0f} s" if code is None else f"exit {code}"
    return {**row, "status": "error", "error": why, "log_tail": lines[first:][-30:]}


def summarise(ranks: list[dict], a, fsdp: bool, gpus: int) -> dict:
    """The arm's numbers and checks from its processes' results."""
    main = next(r for r in ranks if r["rank"] == 0)
    times, info, logs = main["times"][a.warmup:], main["info"], main["log_history"]
    losses = [h["loss"] for h in logs if "loss" in h]
    lag0 = [h[GAP] for h in logs if GAP in h and h.get(LAG) == 0] + [h[TRL_GAP] for h in logs if TRL_GAP in h]
    peaks = [r["peak_mib"] for r in ranks]

    def pinned(i: dict) -> bool:
        want = i["expected_device"]
        return (i["current_device"] == (int(want.split(":")[-1]) if ":" in want else None)
                and i["accelerator_device"] == want
                and all(v == [want] for v in i["devices"].values() if isinstance(v, list)))  # fmt: skip

    want = "gloo" if a.smoke or not gpus else "nccl"
    checks = {"steps": len(main["times"]) == a.steps, "device_pinned": all(pinned(r["info"]) for r in ranks),
              "backend_" + want: (want in str(info["backend"]) and "FSDP2" in str(info["parallelism"])) if fsdp
              else None, "loss_finite": len(losses) == a.steps and all(math.isfinite(x) for x in losses),
              "lag0_gap": max(lag0) < a.gap_tol if lag0 else None,
              "generator_took_each_version": main["generator_version"] == a.steps - 1
              if main["generator_version"] is not None else None}  # fmt: skip
    spread = {"median": round(statistics.median(times), 3), "min": round(min(times), 3), "max": round(max(times), 3),
              "n": len(times)} if times else None  # fmt: skip
    return {"status": "pass" if all(v is not False for v in checks.values()) else "fail", "s_per_step": spread,
            "peak_mib": round(max(peaks)) if peaks[0] is not None else None, "peak_mib_per_rank": peaks,
            **{k: info[k] for k in ("devices", "backend", "world_size", "parallelism", "mixed_precision",
                                    "fsdp_mp_policy", "dtypes")},
            "losses": losses, "lag0_gaps": lag0, "policy_lag_max": [h[LAG] for h in logs if LAG in h],
            "checks": checks}  # fmt: skip


def print_table(rows: list[dict]) -> None:
    widths = (32, 25, 10, 9, 38, 18, 11, 8)
    print(f"| {'arm':<30} | s/step median (min-max) | peak MiB | backend | policy / reference / generator copy "
          "| trainable dtypes | lag-0 gap | status |\n|" + "|".join("-" * w for w in widths) + "|")
    for r in rows:
        if r["status"] in ("error", "skipped"):
            print(f"| {r['arm']:<30} | {r['status']}: {r.get('error') or r.get('note')} |")
            continue
        s = r["s_per_step"] or {"median": 0, "min": 0, "max": 0}
        dev = " / ".join(",".join(v) if isinstance(v, list) else v for v in r["devices"].values())
        gap = f"{max(r['lag0_gaps']):.2e}" if r["lag0_gaps"] else "-"
        failed = ",".join(k for k, v in r["checks"].items() if v is False)
        print(f"| {r['arm']:<30} | {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}) | {r['peak_mib'] or '-'} | "
              f"{r['backend']} | {dev} | {r['dtypes']['trainable']} | {gap} | {r['status']} {failed} |")


# ------------------------------------------------------------------------------------------ wheels for the lent machine
SKIP = ("torch", "numpy", "triton", "sympy")
"""Never carried: PyTorch and its own needs (the image's PyTorch brings them), besides ``nvidia-*``/``cuda-*``."""
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system":
          "Linux", "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "extra": ""}  # fmt: skip
"""The lent machine's interpreter (CPython 3.12 on x86-64 Linux: /work/.library/device/KINDS.md)."""
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]


def _wheel(entry: dict) -> tuple[bool, float] | None:
    """(pure Python, MiB) of ``entry``'s wheel for `TARGET`, from uv.lock; None when it has none."""
    from packaging.tags import compatible_tags, cpython_tags
    from packaging.utils import parse_wheel_filename

    target = {*cpython_tags((3, 12), platforms=PLATFORMS), *compatible_tags((3, 12), "cp312", PLATFORMS)}
    found = []
    for w in entry.get("wheels", []):
        tags = parse_wheel_filename(w["url"].rsplit("/", 1)[-1])[3]
        if tags & target:
            found.append((not any(t.abi == "none" and t.platform == "any" for t in tags), w.get("size", 0) / 2**20))
    return (not min(found)[0], min(found)[1]) if found else None


def wheel_plan(lock: Path = ROOT / "uv.lock", max_binary_mib: float = 3.5) -> tuple[list, list]:
    """The project's runtime dependencies (uv.lock's closure for `TARGET`) to carry as wheels: ``(take, skipped)``,
    take = [(name, version, MiB, pure)], skipped = [(name, why)]. Pure-Python wheels are taken, a binary one only
    when it is at most ``max_binary_mib`` (the image holds the big ones); `SKIP`'s and a skipped one's needs are not
    walked."""
    import tomllib

    from packaging.markers import Marker

    packages: dict[str, list[dict]] = {}
    for p in tomllib.loads(lock.read_text())["package"]:
        packages.setdefault(p["name"], []).append(p)
    take, skipped, seen, todo = [], [], set(), list(packages["trl-ext"][0]["dependencies"])
    while todo:
        dep = todo.pop(0)
        if dep.get("marker") and not Marker(dep["marker"]).evaluate(TARGET):
            continue
        entry = next(p for p in packages[dep["name"]] if dep.get("version") in (None, p["version"]))
        for extra in dep.get("extra", []):
            todo += entry.get("optional-dependencies", {}).get(extra, [])
        if entry["name"] in seen:
            continue
        seen.add(entry["name"])
        wheel = _wheel(entry)
        if entry["name"] in SKIP or entry["name"].startswith(("nvidia-", "cuda-")):
            skipped.append((entry["name"], "PyTorch's own"))
        elif wheel is None:
            skipped.append((entry["name"], "no wheel for CPython 3.12 on x86-64 Linux"))
        elif not wheel[0] and wheel[1] > max_binary_mib:
            skipped.append((entry["name"], f"binary, {wheel[1]:.1f} MiB: the image's own"))
        else:
            take.append((entry["name"], entry["version"], wheel[1], wheel[0]))
            todo += entry.get("dependencies", [])
    return take, skipped


def download_wheels(dest: Path, max_mib: float) -> int:
    """`wheel_plan`'s wheels into ``dest`` with pip (``pip download --no-deps`` for `TARGET`); refused above
    ``max_mib`` in all (the working tree that travels, wheels included, is at most 64 MiB)."""
    import importlib.util

    take, skipped = wheel_plan()
    total = sum(mib for *_, mib, _ in take)
    for name, why in skipped:
        print(f"  not carried: {name} ({why})")
    for name, version, mib, pure in take:
        print(f"  {name}=={version}: {mib:.2f} MiB{'' if pure else ' (binary)'}")
    print(f"{len(take)} wheels, {total:.1f} MiB")
    if total > max_mib:
        print(f"refused: {total:.1f} MiB is above --wheels_max_mib {max_mib:g}", file=sys.stderr)
        return 1
    pip = ([sys.executable, "-m", "pip"] if importlib.util.find_spec("pip") else [shutil.which("pip3")]
           if shutil.which("pip3") else [shutil.which("uv") or "uv", "tool", "run", "pip"])  # fmt: skip
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation",
           "cp", *[x for p in PLATFORMS for x in ("--platform", p)], "-d", str(dest),
           *[f"{name}=={version}" for name, version, *_ in take]]  # fmt: skip
    if subprocess.run(cmd, check=False).returncode != 0:
        return 1
    got = sum(p.stat().st_size for p in dest.glob("*.whl")) / 2**20
    print(f"{dest}: {len(list(dest.glob('*.whl')))} wheels, {got:.1f} MiB{'' if got <= max_mib else ': too many'}")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=False).stdout.split(b"\0")  # fmt: skip
    paths = [ROOT / f.decode() for f in files if f]
    tree = sum(p.stat().st_size for p in paths if p.is_file() and not p.resolve().is_relative_to(dest.resolve()))
    if tree / 2**20 + got > 64:
        print(f"note: the working tree ({tree / 2**20:.1f} MiB) and the wheels pass the 64 MiB a device call carries")
    return 0 if got <= max_mib else 1


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="the JSON report")
    ap.add_argument("--smoke", action="store_true", help="CPU code check: a tiny model, FSDP2 on 2 gloo processes")
    ap.add_argument("--steps", type=int, help="steps per arm (default 6; smoke 3)")
    ap.add_argument("--warmup", type=int, help="first steps left out of s/step (default 2; smoke 1)")
    ap.add_argument("--tokens", type=int, default=64, help="completion tokens of the other arms")
    ap.add_argument("--long_tokens", type=int, help="completion tokens of the long arm (default 512; smoke 128)")
    ap.add_argument("--batch_size", type=int, help="completions per process and step (default 16; smoke 8)")
    ap.add_argument("--budget_s", type=float, default=420.0, help="skip the arms that would end after this")
    ap.add_argument("--arm_timeout", type=float, default=300.0)
    ap.add_argument("--gap_tol", type=float, default=1e-2, help="largest lag-0 sampling gap that passes (bf16)")
    ap.add_argument("--arms", nargs="*", help="only the arms whose names contain one of these")
    ap.add_argument("--wheels", metavar="DIR", help="download the wheels the lent machine needs into DIR, and exit")
    ap.add_argument("--wheels_max_mib", type=float, default=60.0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a, rest = ap.parse_known_args(argv)
    defaults = (3, 1, 128, 8) if a.smoke else (6, 2, 512, 16)
    for key, default in zip(("steps", "warmup", "long_tokens", "batch_size"), defaults, strict=True):
        setattr(a, key, default if getattr(a, key) is None else getattr(a, key))
    return a, [x for x in rest if x != "--"]


def main() -> int:
    a, rest = parse_args()
    if a.child:
        return child(a.result, rest)
    if a.wheels:
        return download_wheels(Path(a.wheels), a.wheels_max_mib)
    start = time.perf_counter()
    import torch

    gpus = torch.cuda.device_count()
    if not gpus and not a.smoke:
        print("no CUDA device: run with --smoke for a CPU code check", file=sys.stderr)
        return 2
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched (the lent machine reaches no hub: no retries)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        return run_arms(a, start, gpus, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_arms(a, start: float, gpus: int, work: Path) -> int:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    model = random_qwen(work / "qwen", SMOKE if a.smoke else QWEN_05B)
    common = ["--model", str(work / "qwen"), "--prompts", "builtin", "--reward", "sentence_length_10_smooth_with_happy",
              "--batch_size", str(a.batch_size), "--num_generations", str(a.batch_size // 2), "--bf16", "True",
              "--gradient_checkpointing", "False", "--max_steps", str(a.steps), "--logging_steps", "1",
              "--save_strategy", "no", "--no_wandb", "--seed", "42"]  # fmt: skip
    rows, walls = [], []
    for arm in [arm for arm in ARMS if not a.arms or any(part in arm[0] for part in a.arms)]:
        left = a.budget_s - (time.perf_counter() - start)
        if left < max(30.0, 0.6 * (statistics.mean(walls) if walls else 0.0)):
            rows.append({"arm": arm[0], "status": "skipped", "note": f"{left:.0f} s of --budget_s left"})
        else:
            rows.append(run_arm(arm, common, a, work, gpus, min(a.arm_timeout, left)))
            walls.append(rows[-1]["wall_s"])
        print(f"{rows[-1]['arm']}: {rows[-1]['status']}, {rows[-1].get('wall_s', 0):.0f} s (elapsed "
              f"{time.perf_counter() - start:.0f} s)", *("   " + x for x in rows[-1].get("log_tail", [])), sep="\n")
    versions = {}
    for pkg in ("torch", "transformers", "trl", "peft", "accelerate", "datasets"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    device, elapsed = torch.cuda.get_device_name(0) if gpus else "CPU (smoke)", round(time.perf_counter() - start, 1)
    print(f"\n{device} x{gpus}, {versions}; {a.steps} steps per arm, first {a.warmup} left out; elapsed {elapsed} s")
    print_table(rows)
    report = {"device": device, "gpus": gpus, "versions": versions, "smoke": a.smoke, "model": model,
              "steps": a.steps, "warmup": a.warmup, "batch_size": a.batch_size, "gap_tol": a.gap_tol,
              "budget_s": a.budget_s, "elapsed_s": elapsed, "arms": rows,
              "passed": all(r["status"] == "pass" for r in rows)}  # fmt: skip
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
