"""The vLLM tier's train.py runs, all in one process: ``python tests/vllm_runs.py OUT NAME...`` (under torchrun for the
two-process runs) runs the named runs one after another through train.py's ``main``, so each engine (one per model
and settings) starts once and later runs reuse it (`trl_ext.vllm.engine.shared_llm`; an engine start is most of a
short run: bench/results/durations-vllm.log). Each run writes ``OUT/NAME/`` (its run directory, and ``status.json``:
exit code, seconds, the traceback of an exception); the tests (tests/test_vllm.py, tests/test_vllm_matrix.py) read
them through the session fixtures `vllm_runs` and `vllm_runs_x2`, which run only the runs the selected tests name.

A reused engine must not let a missing load pass: every run loads its own policy before its first generation, and
the resume's continuation (``resume_continue``) runs after the other k >= 1 runs, so an engine that skipped loading the
restored policy would hold another run's weights, not the checkpoint's."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SMALL = ["--batch_size", "16", "--num_generations", "8", "--max_completion_length", "32", "--logging_steps", "1",
         "--no_wandb"]  # fmt: skip
EAGER = ["--vllm_enforce_eager"]
"""Passed where vLLM's compilation (tens of seconds of CPU per engine start) is not what a run checks. Compiled, as by
default: the one-process k = 1 runs (`COMPILED`: one engine, shared; the strict run checks that every load reaches
it) and the two-process runs at k = 0 (one engine per process, shared by the DDP and the FSDP2 run)."""
COMPILED = ("resume_full", "k1_strict", "inflight", "resume_continue", "x2_k0_story", "x2_fsdp_k0_routed")
ACCELERATE_ENV = ("ACCELERATE_", "FSDP_")
"""Prefixes of the variables transformers' TrainingArguments exports for FSDP (``ACCELERATE_USE_FSDP``,
``FSDP_VERSION`` ...): restored after each run. The rest of the environment is kept, as a process running several
trainers keeps it (vLLM's settings from an earlier engine included: later engines start in process, faster)."""
CELL_BATCH = ["--batch_size", "8", "--num_generations", "4", "--max_completion_length", "16"]
"""The matrix's story cells' batch (tests/test_matrix.py): a run with it shares their k = 0 engine (TRL sizes the engine
by the batch)."""
RESUME = ["--reward", "happy_binary", "--use_vllm", "--max_async_level", "1", "--lora_rank", "8", "--lr", "3e-3",
          "--max_steps", "3", "--save_steps", "1"]  # fmt: skip
TASKS = {"story": ["--reward", "happy_binary"],
         "frozenlake": ["--env", "frozenlake", "--model", "builtin_env", "--max_turns", "2"],
         "tools": ["--env", "ml_task", "--model", "builtin_tools", "--max_turns", "7", "--batch_size", "8",
                   "--num_generations", "4", "--max_completion_length", "160", "--lr", "1e-4", "--save_rollouts"]}
"""The tool environment's runs: the sandboxed ML task on the builtin tool-calling model (real tool calls, real code
run in the sandbox: bubblewrap, which .ci/run installs)."""  # fmt: skip
RUNS: dict[str, list[str]] = {
    "resume_full": RESUME,
    "sync_k0": ["--reward", "happy_binary", "--use_vllm", "--lr", "3e-3", "--max_steps", "3", "--save_steps", "3",
                *CELL_BATCH],
    "adapter_k0": ["--reward", "happy_binary", "--use_vllm", "--lora_rank", "8", "--lr", "3e-3", "--max_steps", "3",
                   "--save_steps", "3", *CELL_BATCH],  # LoRA served as an adapter (--vllm_lora_sync auto)
    "k1_strict": ["--reward", "happy_binary", "--use_vllm", "--max_async_level", "1", "--strict_async_level", "--lr",
                  "3e-4", "--lr_scheduler_type", "constant", "--max_steps", "8", "--save_steps", "8"],
    "inflight": ["--reward", "happy_binary", "--use_vllm", "--max_async_level", "1", "--vllm_inflight_tokens", "4",
                 "--max_completion_length", "16", "--lr", "3e-4", "--max_steps", "3", "--save_steps", "3"],
    "tools_k0": [*TASKS["tools"], "--use_vllm", "--max_steps", "2", "--save_steps", "2"],
    "tools_k1": [*TASKS["tools"], "--use_vllm", "--max_async_level", "1", "--max_steps", "2", "--save_steps", "2"],
    "resume_continue": [*RESUME, "--resume_from_checkpoint", "latest"],
    "x2_k0_story": [*TASKS["story"], "--use_vllm", "--max_async_level", "0", "--lr", "3e-3", "--max_steps", "2",
                    "--save_steps", "2"],  # the compiled k = 0 engine: a policy that moves, so a lost sync shows
    "x2_k1_frozenlake": [*TASKS["frozenlake"], "--use_vllm", "--max_async_level", "1", "--max_steps", "2",
                         "--save_steps", "2"],
    "x2_k1_tools": [*TASKS["tools"], "--use_vllm", "--max_async_level", "1", "--max_steps", "2", "--save_steps", "2"],
    "x2_fsdp_k0_routed": ["--reward", "sentence_length_5_with_happy", "--gradient_routing", "--routing_mode",
                          "shared", "--lora_config", "r4", "--teacher_tau", "0.1", "--teacher_context",
                          "A happy story.", "--use_vllm", "--fsdp", "--lr", "3e-3", "--max_steps", "2",
                          "--save_steps", "2", "--eval_routing_steps", "2", "--eval_routing_prompts", "8"],
}  # fmt: skip
"""Each run's train.py flags (after `SMALL`), in the order they run; the matrix cells (``cell:ADAPTER-K-TASK-DISTILL``,
tests/test_vllm_matrix.py) run between ``inflight`` and ``resume_continue``, its FSDP2 cells (``fcell:...``, two
processes with ``--fsdp``) last."""
ORDER = ["resume_full", "adapter_k0", "sync_k0", "k1_strict", "inflight", "tools_k0", "tools_k1", "cell:",
         "resume_continue", "x2_fsdp_k0_routed", "x2_k0_story", "x2_k1_frozenlake", "x2_k1_tools", "fcell:"]  # fmt: skip
"""A run with LoRA comes before the runs without it that can share its engine (an engine started with LoRA serves
both: trl_ext.vllm.engine.shared_llm), so the process starts one engine for them, not two: the tier's memory."""


def ordered(names) -> list[str]:
    """``names`` in the order they must run (`ORDER`; cells keep theirs, those with adapters first)."""
    return sorted(names, key=lambda n: (ORDER.index(n.split(":")[0] + ":" if ":" in n else n),
                                        n.startswith(("cell:full", "fcell:full"))))  # fmt: skip


def argv_of(name: str, out: Path, processes: int) -> list[str]:
    """train.py's arguments of run ``name``, writing under ``out``."""
    if name.startswith(("cell:", "fcell:")):
        from test_matrix import cell_argv

        kind, cell = name.split(":")
        extra = ("--use_vllm", *EAGER, *(["--fsdp"] if kind == "fcell" else []))
        return cell_argv(*cell.split("-"), out, processes=processes, extra=extra)
    if name == "resume_continue":
        out = out.parent / "resume_full"  # the same output directory: the run resumes its own checkpoint
    return ["--output_dir", str(out), *SMALL, *RUNS[name], *([] if name in COMPILED else EAGER)]


def run_one(name: str, out: Path, processes: int) -> dict:
    """Run ``name`` through train.py's ``main`` (its own directory ``out``); its status."""
    from trl_ext import cli_train

    if name == "resume_continue":  # keep the uninterrupted run's history, then cut the run back to its checkpoint-2
        (run_dir,) = (p for p in (out.parent / "resume_full").iterdir() if p.is_dir())
        shutil.copy(run_dir / "checkpoint-3" / "trainer_state.json", out / "uninterrupted_state.json")
        shutil.rmtree(run_dir / "checkpoint-3")
    start, status = time.time(), {}
    accelerate = {k: v for k, v in os.environ.items() if k.startswith(ACCELERATE_ENV)}
    try:
        if name == "inflight":
            import test_offpolicy_trainer as t

            import trl_ext.offpolicy.component as offpolicy

            worker, offpolicy.RolloutWorker = offpolicy.RolloutWorker, t.InflightRecorder
            try:
                status["code"] = cli_train.main(argv_of(name, out, processes))
            finally:
                offpolicy.RolloutWorker = worker
            t.InflightRecorder.last.save(out / "record.pt")
        else:
            status["code"] = cli_train.main(argv_of(name, out, processes))
    except BaseException:  # noqa: BLE001 - recorded for the test that reads this run; the next run goes on
        status["code"], status["traceback"] = None, traceback.format_exc()
    finally:  # TrainingArguments exports a run's FSDP settings, which the next run's parse would read
        for key in [k for k in os.environ if k.startswith(ACCELERATE_ENV)]:
            del os.environ[key]
        os.environ.update(accelerate)
    status["seconds"] = round(time.time() - start, 1)
    return status


def main(out: Path, names: list[str]) -> int:
    from trl_ext.launch.processes import end_processes

    rank, n = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    for name in ordered(names):
        run_out = out / name
        run_out.mkdir(parents=True, exist_ok=True)
        status = run_one(name, run_out, n)
        if rank == 0:
            (run_out / "status.json").write_text(json.dumps(status))
            print(f"[vllm_runs x{n}] {name}: exit {status['code']} ({status['seconds']} s)", flush=True)
    end_processes()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
