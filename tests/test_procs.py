"""Several processes as ONE run (torchrun, 2 CPU processes, gloo): the parse-time refusals of what is not yet verified
there, the equivalence of 2 processes x B/2 with 1 process x B (full, LoRA, distillation, dual LoRA, routing), the
run directory written once, train.py runs of the features (routing, distillation with the fast backend and saved
rollouts, --dataset columns with --eval_rewards), and a failing rank ending the whole launch.

Equivalence design: sampling differs between 1 and 2 processes (each rank draws from its own generator state), so the
completions are scripted: `ScriptedTrainer._generate_single_turn` returns token ids that are a function of the prompt
and of the sample's position in the GLOBAL generation batch (rank x local size + local index; accelerate hands each
rank a contiguous slice). The reward is the completion's length, which differs within a group, so every group has a
learning signal. One optimizer step must then give the same parameters within 1e-5 (DDP averages the ranks' mean
losses' gradients: the mean over the global batch of TRL's "grpo" loss). This file is also the driver the test
launches (``python tests/test_procs.py equivalence OUT MODEL`` under torchrun or alone).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import zygote

from trl_ext.launch.command import torchrun_command
from trl_ext.launch.processes import (
    check_cfg_processes, check_run_processes, describe_launch, launched_processes, multi_process_settings,
)
from trl_ext.registry import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TWO = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
GLOBAL_BATCH, GROUP, LR = 8, 4, 1.0  # plain SGD (see run_equivalence)
PROMPTS = ["Once upon a time", "There was a dog", "The sun was", "A girl named Mia"]


# ------------------------------------------------------------------------------------------ parse-time rules (pure)
def _parse(argv: list[str]):
    from trl_ext.cli_train import parser

    run, cfg = parser().parse_args_into_dataclasses(args=argv)
    return run, cfg


@pytest.mark.parametrize("flag, value, message", [
    ("use_transformers_continuous_batching", True,
     r"--use_transformers_continuous_batching: continuous-batching generation"),
])  # fmt: skip
def test_cfg_features_refused_on_two_processes(flag, value, message):
    """The flags not yet verified on several processes name themselves and the feature (checked on the parsed
    values, before devices are set up)."""
    _, cfg = _parse(["--reward", "happy_binary"])
    check_cfg_processes(cfg, TWO)  # the default story run is allowed
    setattr(cfg, flag, value)
    check_cfg_processes(cfg, {})  # one process: every feature allowed
    with pytest.raises(ConfigError, match=message + r" runs on one process for now; this launch has 2 processes "
                                                    r"\(WORLD_SIZE=2\)"):
        check_cfg_processes(cfg, TWO)


def test_parsed_flag_refused_while_parsing(monkeypatch):
    """ExtGRPOConfig checks before TrainingArguments starts a process group (WORLD_SIZE alone: none could start)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"--use_transformers_continuous_batching: continuous-batching generation "
                                          r"runs on one process for now"):
        _parse(["--reward", "happy_binary", "--use_transformers_continuous_batching"])


@pytest.mark.parametrize("kwargs, message", [
    ({"rebuild_builtin": True}, r"--rebuild_builtin: rebuilding the builtin model"),
])  # fmt: skip
def test_run_features_refused_on_two_processes(kwargs, message, monkeypatch):
    from trl_ext.config import RunArgs

    RunArgs(reward="happy_binary", **kwargs)  # one process: allowed
    monkeypatch.setenv("WORLD_SIZE", "2")  # RunArgs checks while it parses (no process group: RunArgs starts none)
    with pytest.raises(ConfigError, match=message + r".*runs on one process for now"):
        RunArgs(reward="happy_binary", **kwargs)
    monkeypatch.delenv("WORLD_SIZE")
    check_run_processes(RunArgs(reward="happy_binary"), TWO)


def test_allowed_runs_pass_and_get_gloo():
    """The project's features: allowed; on CPU they get use_cpu + gloo, which is what makes accelerate's PartialState
    choose MULTI_CPU (parallel_mode DISTRIBUTED) instead of an unused group."""
    for extra in ([], ["--lora_rank", "4"], ["--generation_backend", "trl", "--beta", "0"],
                  ["--generation_backend", "fast", "--save_rollouts"],
                  ["--lora_rank", "4", "--teacher_tau", "0.1", "--teacher_context", "x", "--kl_only_incorrect"],
                  ["--gradient_routing", "--routing_mode", "shared", "--lora_config", "r4"],
                  ["--max_async_level", "1", "--strict_async_level"], ["--eval_strategy", "steps"]):
        run, cfg = _parse(["--reward", "happy_binary", *extra])
        check_run_processes(run, TWO)
        check_cfg_processes(cfg, TWO)
    assert (cfg.use_cpu, cfg.ddp_backend) == (False, None)  # one process: unchanged
    multi_process_settings(cfg, {}, cuda=False)
    assert (cfg.use_cpu, cfg.ddp_backend) == (False, None)
    multi_process_settings(cfg, TWO, cuda=True)  # accelerate's MULTI_GPU path: untouched
    assert (cfg.use_cpu, cfg.ddp_backend) == (False, None)
    multi_process_settings(cfg, TWO, cuda=False)
    assert (cfg.use_cpu, cfg.ddp_backend) == (True, "gloo")
    cfg.ddp_backend = "nccl"
    with pytest.raises(ConfigError, match="--ddp_backend nccl: 2 processes on CPU communicate through gloo"):
        multi_process_settings(cfg, TWO, cuda=False)


def test_name_tag_and_launch_record():
    """A 2-process run's name and run_config.yaml say so (its global batch differs from a one-process run's);
    one-process names and configs are unchanged."""
    from trl_ext.launch.processes import launch_record, name_tag

    assert (name_tag({}), launch_record({})) == ("", None)
    assert (name_tag(TWO), launch_record(TWO)) == ("_procs2", {"launch": {"num_processes": 2}})


def test_header_names_processes_and_global_batch():
    _, cfg = _parse(["--reward", "happy_binary", "--batch_size", "8", "--num_generations", "4"])
    assert describe_launch(cfg) == "processes: 1; batch: 8 completions per process = 8 per optimizer step"


@pytest.mark.parametrize("env,expected", [
    ({}, (1, None)), ({"WORLD_SIZE": "2"}, (2, "WORLD_SIZE")), ({"PMI_SIZE": "3"}, (3, "PMI_SIZE")),
])  # fmt: skip
def test_launched_processes(env, expected):
    assert launched_processes(env) == expected


# ------------------------------------------------------------------------------------------ the launcher
def torchrun(args: list[str], timeout: int = 240, real: bool = False) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 args`` from ROOT, its output captured: the real launcher with ``real`` (the tests
    of the launch itself), else its ranks forked with torchrun's environment (`zygote.torchrun`: no import per rank)."""
    if real:
        return subprocess.run(torchrun_command(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return zygote.torchrun(args, cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from trl_ext.models.tiny import build_tiny

    return build_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def tiny_llama_env(tmp_path_factory):
    from trl_ext.models.tiny import build_tiny

    return build_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama_env", tokenizer="builtin_env")


@pytest.mark.slow
def test_two_processes_equal_one_process(tiny_llama, tiny_llama_env, tmp_path):
    """One optimizer step, full fine-tune, LoRA, distillation (both paths, one group split over the processes), dual
    LoRA, gradient routing (single- and two-pass, labels drawn at recall 0.5), the off-policy IS loss with the
    default masks (k = 1, a scripted generator per process) and a multi-turn environment (frozenlake, 3 turns):
    2 processes x 4 completions == 1 process x 8, within 1e-5."""
    import json

    import torch

    one, two = tmp_path / "one", tmp_path / "two"
    single = zygote.run([sys.executable, __file__, "equivalence", str(one), str(tiny_llama), str(tiny_llama_env)],
                            capture_output=True, text=True, timeout=240, cwd=ROOT)  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    double = torchrun([__file__, "equivalence", str(two), str(tiny_llama), str(tiny_llama_env)])
    assert double.returncode == 0, double.stderr[-3000:]
    for variant in [v[0] for v in VARIANTS(None)]:
        init, a, b = (torch.load(p / f"{variant}.pt") for p in (one / "init", one, two))
        assert a.keys() == b.keys() and a.keys() == init.keys() and len(a) > 0
        moved = max((a[k] - init[k]).abs().max().item() for k in a)
        assert moved > 1e-2, f"{variant}: the step did not move the parameters ({moved})"
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst < 1e-5, f"{variant}: 2 processes differ from 1 process by {worst}"
    def gap(x: str, y: str) -> float:
        a, b = torch.load(one / f"{x}.pt"), torch.load(one / f"{y}.pt")
        return max((a[k] - b[k]).abs().max().item() for k in a)

    assert gap("distill_full", "lora") > 1e-2 and gap("distill_token", "lora") > 1e-2  # measured: 0.17, 0.22
    assert gap("routed_single", "dual_lora") > 1e-2  # routing changed the step (measured: 0.034)
    assert gap("routed_single", "routed_two_pass") < 1e-6  # the two backward modes agree (measured: 0)
    # one micro-batch per generation batch: bnpo's micro-batch tokens are dapo's generation-batch tokens, so the two
    # losses give one step, through different pass shares (the token fraction, and 1)
    assert gap("routed_two_pass_bnpo", "routed_two_pass") < 1e-6
    logs = [json.loads((d / "offpolicy.json").read_text()) for d in (one, two)]  # the IS loss masked some tokens
    assert 0 < logs[0]["offpolicy/masked_frac"] < 1 and logs[0]["offpolicy/policy_lag_max"] == 0  # measured: 0.357
    for name in ("offpolicy/masked_frac", "offpolicy/ratio_max", "offpolicy/mismatch_kl", "entropy"):
        assert abs(logs[0][name] - logs[1][name]) < 1e-5, name  # logged over both processes
    logs = [json.loads((d / "env_multiturn.json").read_text()) for d in (one, two)]  # measured: 0.25, 0.087, 2.875
    assert 0 < logs[0]["env/success"] < 1 and 0 < logs[0]["env/invalid_frac"] < 1 and 2 < logs[0]["env/turns"] < 3
    assert all(logs[0][k] == logs[1][k] for k in logs[0] if k.startswith("env/"))  # episodes of both processes


@pytest.mark.slow
def test_torchrun_train_py_is_one_run(tmp_path):
    """`torchrun --nproc_per_node 2 train.py`: one run directory, one train.log naming 2 processes and the global
    batch, checkpoints (each rank's RNG state, one marker), run_summary.json; exit 0. Then the run-directory guard
    (decided by the main process) and the process count on resume."""
    import json

    out = tmp_path / "out"
    args = ["train.py", "--reward", "happy_binary", "--max_steps", "2", "--batch_size", "4", "--num_generations", "4",
            "--max_completion_length", "8", "--save_steps", "2", "--logging_steps", "1", "--no_wandb"]  # fmt: skip
    proc = torchrun([*args, "--output_dir", str(out)], real=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    log = (run_dir / "train.log").read_text()
    assert log.count("$ train.py") == 1
    assert "processes: 2 (gloo backend, DDP); batch: 4 completions per process x 2 processes = 8 completions per " \
           "optimizer step (global)" in log
    assert "'num_tokens': '128'" in log  # step 1 counts both processes' 8 x (8 prompt + 8 completion) tokens
    ckpt = run_dir / "checkpoint-2"
    assert {"checkpoint_complete.json", "rng_state_0.pth", "rng_state_1.pth", "run_config.yaml"} <= {
        p.name for p in ckpt.iterdir()}
    assert json.loads((run_dir / "run_summary.json").read_text())["steps"] == 2
    assert sorted(p.name for p in out.iterdir()) == [run_dir.name]
    assert run_dir.name.endswith("_procs2")
    assert "launch:\n  num_processes: 2" in (run_dir / "run_config.yaml").read_text()
    # The same launch again (its ranks forked: the launcher's handling of a failed rank is the next tests'): the main
    # process finds the run and every rank receives its refusal (exit 2, none waits).
    again = torchrun([*args, "--output_dir", str(out)])
    assert again.returncode == 2
    assert f"train.py: error: {run_dir} already holds a run" in again.stderr
    # One process cannot continue it (half the global batch): refused while parsing, naming the difference.
    resume = zygote.run([sys.executable, *args, "--output_dir", str(tmp_path / "one"), "--resume_from_checkpoint",
                             str(ckpt)], capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert resume.returncode == 2
    assert "num_processes: checkpoint 2, command '<absent>'" in resume.stderr


BOOM = '''
import os


def boom(completions, trainer_state, **kwargs):
    if os.environ.get("RANK") == "1":
        raise RuntimeError(f"reward exploded on rank 1 at step {trainer_state.global_step + 1}")
    return [0.0 for _ in completions]
'''


@pytest.mark.slow
def test_a_failing_rank_ends_the_launch(tmp_path):
    """A reward that raises on rank 1 only: the launch ends non-zero within 60 s with the error named (torchrun's
    agent stops rank 0, which waits in a collective)."""
    (tmp_path / "boom.py").write_text(BOOM)
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent('rewards:\n  boom: {fn: "boom.py:boom"}\n'))
    start = time.time()
    proc = torchrun(["train.py", "--reward", "boom", "--config", str(config), "--max_steps", "2", "--batch_size", "4",
                     "--num_generations", "4", "--max_completion_length", "8", "--no_wandb",
                     "--output_dir", str(tmp_path / "out")], timeout=120, real=True)  # fmt: skip
    assert proc.returncode != 0
    assert time.time() - start < 60 + 30  # 60 s from the failure; the launch's own start-up is the rest
    assert "reward exploded on rank 1 at step 1" in proc.stderr


def _rank_pid(root_pid: int, rank: int) -> int | None:
    """The pid of the descendant of ``root_pid`` whose environment says RANK=``rank`` (a torchrun worker)."""
    children = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    todo, seen = [root_pid], []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += children.get(pid, [])
    for pid in seen[1:]:
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
    return None


@pytest.mark.slow
def test_a_killed_rank_ends_the_launch(tmp_path):
    """SIGKILL to rank 1 mid-training (a lost process: no Python exception, no message): torchrun's agent sees the
    worker die and stops rank 0, which would otherwise wait forever in the next collective; the launch exits non-zero
    within 60 s and no process of it is left."""
    import signal

    out = tmp_path / "out"
    cmd = torchrun_command(["train.py", "--reward", "happy_binary", "--max_steps", "500", "--save_steps", "1",
                            "--batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
                            "--no_wandb", "--output_dir", str(out)])  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 240
        while not list(out.glob("*/checkpoint-1/checkpoint_complete.json")):  # training is under way
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.2)
        victim, survivor = _rank_pid(proc.pid, 1), _rank_pid(proc.pid, 0)
        assert victim is not None and survivor is not None
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        _, err = proc.communicate(timeout=90)
        assert time.time() - killed_at < 60
        assert proc.returncode != 0
        assert "Signal 9 (SIGKILL)" in err or "exitcode  : -9" in err  # torchrun names the lost rank
        time.sleep(1)
        assert not (Path("/proc") / str(survivor)).exists() or "zombie" in (Path("/proc") / str(survivor) /
                                                                             "status").read_text()  # rank 0 ended
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_refused_feature_exits_2_before_any_process_group(monkeypatch, capsys):
    """train.py under a launcher with a refused flag: exit 2 while parsing (no process group, no model)."""
    import torch.distributed as dist

    from trl_ext.cli_train import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--reward", "happy_binary", "--use_transformers_continuous_batching"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: --use_transformers_continuous_batching: continuous-batching generation "
                          "runs on one process for now")
    assert not dist.is_initialized()


# ------------------------------------------------------------------------------------------ the equivalence driver
def _scripted(prompt: list[int], position: int, vocab: int, avoid: set[int]) -> list[int]:
    """A completion that is a function of the prompt and the sample's position in its group (length 2..5)."""
    j = position % GROUP
    ids = [(sum(prompt) * 31 + 7 * j + 13 * t) % (vocab - 10) + 5 for t in range(2 + j)]
    return [i + 1 if i in avoid else i for i in ids]


def _length_reward(completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


# Distillation (LoRA: the base weights with the teacher context teach) with ONE group of 8 over the global batch of 8:
# on 2 processes each holds half of the group, so its baseline needs the other process's log-probs.
DISTILL = {"num_generations": GLOBAL_BATCH, "teacher_tau": 0.5, "student_tau": 0.1, "teacher_context": "A happy tale."}


# Gradient routing (dual LoRA r4, exclusive, retain-only renormalisation) with recall 0.5: the labels are drawn over
# the whole batch, so 1 and 2 processes label the same samples; both backward modes, with TRL's default loss (dapo:
# divided by the generation batch's tokens) and the two-pass step with bnpo (each pass takes its share of the
# micro-batch's tokens; the scripted completions give both processes the same token count, so bnpo's per-process
# normalisation equals one process's).
ROUTED = {"lora_config": "r4", "gradient_routing": True, "routing_mode": "exclusive", "rh_detector_recall": 0.5,
          "eval_routing_steps": 0, "loss_type": "dapo"}


def _odd_length(completions: list[str]) -> list[bool]:
    return [len(c.split()) % 2 == 1 for c in completions]


def VARIANTS(lora):  # noqa: N802 (the table of run_equivalence: name, peft_config, config flags, trainer arguments)
    return (("full", None, {}, {}), ("lora", lora, {}, {}), ("distill_full", lora, DISTILL, {}),
            ("distill_token", lora, {**DISTILL, "use_full_reward_baseline": False}, {}),
            ("dual_lora", None, {"lora_config": "r4", "eval_routing_steps": 0}, {}),
            ("routed_single", None, ROUTED, {"rh_detector": _odd_length}),
            ("routed_two_pass", None, {**ROUTED, "routing_two_pass": True}, {"rh_detector": _odd_length}),
            ("routed_two_pass_bnpo", None, {**ROUTED, "routing_two_pass": True, "loss_type": "bnpo"},
             {"rh_detector": _odd_length}),
            ("offpolicy", None, {"max_async_level": 1}, {}),
            ("env_multiturn", None, ENV, {}))  # fmt: skip


# Multi-turn environment (frozenlake, 3 turns): the scripted agent's answer depends on the context and on how many
# identical contexts came before it in the call (group members share their prompt, and their histories until they
# differ), so 1 and 2 processes answer alike whatever episodes end early; the return differs within a group.
ENV = {"env": "frozenlake", "max_turns": 3, "max_completion_length": 96}
ENV_ANSWERS = ("<answer>left</answer>", "<answer>down</answer>", "<answer>zzz</answer>", "<answer>right</answer>")


def _env_answers(contexts: list[list[int]], tok) -> list[list[int]]:
    seen: dict[tuple, int] = {}
    out = []
    for c in contexts:
        k = seen[tuple(c)] = seen.get(tuple(c), -1) + 1
        out.append(tok(ENV_ANSWERS[(k + len(c)) % len(ENV_ANSWERS)], add_special_tokens=False)["input_ids"])
    return out


def _behaviour_logprob(t: int) -> float:
    """The scripted generator's behaviour log-prob of token t: far enough from the policy's (about -5.6 on the tiny
    model) that the default token mask [1/8, 8] drops some tokens and keeps others."""
    return -3.0 - 1.5 * (t % 4)


class ScriptedSampler:
    """The off-policy generator's sampler (a ``trl_ext.interfaces.ModelSampler`` of the generator's ``model``) with
    scripted completions (`_scripted`, global positions as in ScriptedTrainer) and `_behaviour_logprob` behaviour
    log-probs, stamped with the loaded policy version."""

    loads_versions = False

    def __init__(self, tokenizer, rank: int, model):
        self.tok, self.rank, self.model = tokenizer, rank, model

    def sample(self, prompt_ids, params, rng=None, before_step=None):
        from trl_ext.interfaces import Sampled

        version, first = before_step(0), self.rank * len(prompt_ids)
        avoid = {self.tok.eos_token_id, self.tok.pad_token_id}
        ids = [_scripted(list(p), first + i, len(self.tok), avoid) for i, p in enumerate(prompt_ids)]
        return Sampled(ids, [[_behaviour_logprob(t) for t in range(len(c))] for c in ids],
                       [[version] * len(c) for c in ids])  # fmt: skip


def run_equivalence(out: Path, model: str, env_model: str, only: tuple[str, ...] | None = None, **settings) -> None:
    """One optimizer step of each `VARIANTS` entry (those named in ``only``, if given) on ``model`` (``env_model``,
    with the environment tokenizer, for the environment), with the config ``settings`` added (``fsdp=True``:
    tests/test_fsdp.py); the main process saves the trainable parameters (their full values: an FSDP2 parameter is
    gathered from its DTensor shards) and, on one process, their initial values to ``out``. Plain SGD, so that the
    step compares the gradients: Adam's first step is lr * g / (|g| + eps), which turns float rounding of a near-zero
    gradient into up to lr differences (measured: 9e-6 at lr 1e-3 for the full model)."""
    import json

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from torch.distributed.tensor import DTensor

    from trl_ext.config import train_config
    from trl_ext.trainer import ExtGRPOTrainer

    class ScriptedTrainer(ExtGRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            tok = self.processing_class
            if self.args.env:
                return _env_answers(prompt_ids, tok), None
            avoid = {tok.eos_token_id, tok.pad_token_id}
            first = self.accelerator.process_index * len(prompt_ids)
            return [_scripted(list(p), first + i, len(tok), avoid) for i, p in enumerate(prompt_ids)], None

    torch.set_num_threads(1)
    n = int(os.environ.get("WORLD_SIZE", "1"))
    out.mkdir(parents=True, exist_ok=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    for variant, peft, extra, trainer_extra in VARIANTS(lora):
        if only is not None and variant not in only:
            continue
        cfg = train_config(output_dir=str(out / variant), per_device_train_batch_size=GLOBAL_BATCH // n,
                           max_steps=1, learning_rate=LR, optim="sgd", report_to=[], save_strategy="no",
                           logging_steps=1, seed=0, disable_dropout=True,
                           **{"num_generations": GROUP, "max_completion_length": 8, **extra, **settings})  # fmt: skip
        data = {"model": model, "reward_funcs": [_length_reward],
                "train_dataset": Dataset.from_dict({"prompt": PROMPTS * 4})}
        if cfg.env:  # the environment's levels and return, on the tiny model with the environment tokenizer
            from trl_ext.env.episodes import env_dataset, env_reward
            from trl_ext.models import load_tokenizer, prepare_tokenizer

            tok = prepare_tokenizer(load_tokenizer(env_model))
            data = {"model": env_model, "reward_funcs": [env_reward], "processing_class": tok,
                    "train_dataset": env_dataset(cfg.build_env(), 16, tok)}
        trainer = ScriptedTrainer(args=cfg, peft_config=peft, **data, **trainer_extra)
        assert trainer.args.world_size == n and trainer.accelerator.num_processes == n
        if cfg.max_async_level:  # the generator thread samples with the scripted sampler, whoever makes it
            from trl_ext.generation.backends import SAMPLERS

            rank = trainer.accelerator.process_index
            SAMPLERS[cfg.generation_backend] = lambda m, tok=trainer.processing_class: ScriptedSampler(tok, rank, m)
        model_ = trainer.accelerator.unwrap_model(trainer.model)  # FSDP2 shards this module in place

        def params() -> dict:  # on every process (gathering a DTensor's full value is a collective)
            full = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731
            return {k: full(p).detach().clone() for k, p in model_.named_parameters() if p.requires_grad}

        if n == 1:
            (out / "init").mkdir(exist_ok=True)
            torch.save(params(), out / "init" / f"{variant}.pt")
        trainer.train()
        final = params()
        if trainer.accelerator.is_main_process:
            torch.save(final, out / f"{variant}.pt")
            (out / f"{variant}.parallelism.json").write_text(json.dumps(dataclasses.asdict(trainer.parallelism)))
            (out / f"{variant}.json").write_text(json.dumps(trainer.state.log_history[0]))
        trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    from trl_ext.launch.processes import end_processes

    if sys.argv[1] == "equivalence":
        run_equivalence(Path(sys.argv[2]), sys.argv[3], sys.argv[4])
    end_processes()
