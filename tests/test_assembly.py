"""Run assembly by registration (`trl_ext.parts`, `trl_ext.assembly`): the registries list the expected parts, each
part's ``supports`` answers for one / several processes and sharding as train.py always refused, `resolve` selects a
run's parts, a part registered in-process (a toy prompt source and feature) is picked up by train.py and the launch
checks without an edit, and `trl_ext.launch` imports no feature."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trl_ext.assembly import resolve
from trl_ext.launch.refusals import Launch
from trl_ext.parts import FEATURES, GENERATION_SOURCES, MODULES, PROMPT_SOURCES, Feature, PromptSource, registered
from trl_ext.registry import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TWO = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
ONE_PROCESS_ONLY = {"rebuild_builtin", "continuous_batching"}
UNSHARDED = {"routing", "distill", "offpolicy", "env", "sft", "fast", "saved_rollouts", "eval_loop", "vllm",
             "continuous_batching", "serve"}  # fmt: skip
FSDP2_TOO = {"saved_rollouts", "eval_loop", "routing", "distill", "offpolicy", "env", "fast", "sft",
             "vllm", "serve"}  # fmt: skip
# parts that run under FSDP2 (not DeepSpeed; fast: at k >= 1 only, its check_args): test_procs_runs.py,
# test_fsdp_features.py, test_fsdp_sft.py


def _parse(*argv: str):
    from trl_ext.cli_train import parser

    return parser().parse_args_into_dataclasses(args=list(argv))


def test_registries_list_the_parts():
    assert PROMPT_SOURCES.names() == ["dataset", "env", "stories"]
    assert GENERATION_SOURCES.names() == ["continuous_batching", "fast", "offpolicy", "trl", "vllm"]
    assert FEATURES.names() == ["distill", "env", "eval_loop", "lora", "offpolicy", "rebuild_builtin", "routing",
                                "saved_rollouts", "serve", "sft"]  # fmt: skip
    with pytest.raises(ConfigError, match="unknown feature 'nope'; registered: distill, env"):
        FEATURES.get("nope")
    order = [p.name for p in registered()]  # the order refusals are asked in (train.py's order before registries)
    assert order == ["routing", "lora", "rebuild_builtin", "distill", "offpolicy", "offpolicy", "env", "env", "sft",
                     "saved_rollouts", "stories", "dataset", "eval_loop", "fast", "trl", "continuous_batching",
                     "vllm", "serve"]  # fmt: skip


@pytest.mark.parametrize("launch", [Launch(), Launch(2, "WORLD_SIZE"), Launch(sharding="FSDP"),
                                    Launch(sharding="DeepSpeed"), Launch(4, "SLURM_NTASKS", "FSDP")])  # fmt: skip
def test_the_generator_refuses_only_where_offpolicy_training_does(launch):
    """The off-policy generator's flag is one of off-policy training's, which is asked before it and refuses the same
    launches: the first refusal (`check_launch`) never comes from the generator, wherever its parts stand among the
    others (``trl_ext/offpolicy/register.py`` registers both, so the generator is asked before env, sft and fast)."""
    feature, generator = FEATURES.get("offpolicy"), GENERATION_SOURCES.get("offpolicy")
    assert set(generator.flag_names()) <= set(feature.flag_names())
    order = registered()
    assert order.index(feature) < order.index(generator)
    assert (feature.supports(launch) is None) == (generator.supports(launch) is None)


@pytest.mark.parametrize("launch", [Launch(), Launch(2, "WORLD_SIZE"), Launch(sharding="FSDP"),
                                    Launch(sharding="DeepSpeed"), Launch(4, "SLURM_NTASKS", "FSDP")])  # fmt: skip
def test_supports_answers_as_before(launch):
    """One process: everything. Several: not continuous batching nor --rebuild_builtin. Sharded: none of the
    features nor engines that read or copy whole parameters (saved rollouts and TRL's eval loop: not under DeepSpeed);
    the plain parts (story / dataset prompts, TRL's generation, PEFT LoRA) everywhere."""
    for part in registered():
        reason = part.supports(launch)
        several = launch.processes > 1 and part.name in ONE_PROCESS_ONLY
        sharded = launch.sharding is not None and part.name in UNSHARDED and not isinstance(part, PromptSource)
        sharded = sharded and not (launch.sharding == "FSDP" and part.name in FSDP2_TOO)
        assert (reason is not None) == (several or sharded), (part.name, launch, reason)
        if several:
            assert reason.startswith(f"{part.what} runs on one process for now; this launch has {launch.processes} "
                                     f"processes ({launch.variable}={launch.processes})")  # fmt: skip
        elif sharded:
            assert reason.startswith(f"{part.what} has not been run under {launch.sharding}")


@pytest.mark.parametrize("argv, prompts, generation, features", [
    ([], "stories", ["trl"], ["routing"]),
    (["--lora_rank", "4", "--save_rollouts"], "stories", ["trl"], ["routing", "lora", "saved_rollouts"]),
    (["--generation_backend", "fast", "--max_async_level", "1"], "stories", ["offpolicy", "fast"],
     ["routing", "offpolicy"]),
    (["--use_vllm"], "stories", ["trl", "vllm"], ["routing"]),
    (["--teacher_tau", "0.1", "--teacher_context", "x", "--lora_rank", "4"], "stories", ["trl"],
     ["routing", "lora", "distill"]),
])  # fmt: skip
def test_resolve_selects_the_parts(argv, prompts, generation, features, monkeypatch):
    monkeypatch.setattr("trl_ext.vllm.args.vllm_installed", lambda: True)  # parses whether or not the extra is in
    run, cfg = _parse("--reward", "happy_binary", *argv)
    assembly = resolve(run, cfg)
    assert assembly.names() == {"prompts": [prompts], "generation": generation, "features": features}


def test_resolve_prompt_sources():
    run, cfg = _parse("--env", "sokoban", "--model", "builtin_env")
    assert resolve(run, cfg).prompts.name == "env"
    assert [p.name for p in resolve(run, cfg).features] == ["routing", "env"]
    run, cfg = _parse("--reward", "exact_match", "--dataset", "data.jsonl")
    assert resolve(run, cfg).prompts.name == "dataset"
    run, cfg = _parse("--env", "sokoban", "--dataset", "data.jsonl")  # env claims it; load_run_data refuses --dataset
    assert resolve(run, cfg).prompts.name == "env"


# ------------------------------------------------------------------------------------------ a part registered here
class ToyPrompts(PromptSource):
    """Prompts of the reward binding "toy" (the test's config.yaml)."""

    def __init__(self):
        self.calls = []

    def selected(self, run, cfg) -> bool:
        return run.reward == "toy"

    def check_args(self, run, cfg) -> None:
        self.calls.append("check_args")

    def check(self, plan) -> None:
        self.calls.append("check")
        if plan.run.num_prompts > 100:
            raise ConfigError("toy: at most 100 prompts")

    def build(self, build):
        return ["toy prompt"] * build.plan.run.num_prompts, {"reward_funcs": ["toy reward"]}


class ToyFeature(Feature):
    """A feature engaged by TrainingArguments' --torch_compile, on one process only."""

    what = "toy compilation"
    flags = ("torch_compile",)

    def supports(self, launch):
        return launch.one_process(self.what)

    def contribute(self, build) -> None:
        build.kwargs["toy"] = build.model


@pytest.fixture
def toys(tmp_path):
    source, feature = PROMPT_SOURCES.add("toy", ToyPrompts()), FEATURES.add("toy_compile", ToyFeature())
    (tmp_path / "config.yaml").write_text("rewards:\n  toy: {fn: happy_binary}\n")
    yield source, tmp_path
    PROMPT_SOURCES.remove("toy")
    FEATURES.remove("toy_compile")
    assert "toy" not in PROMPT_SOURCES and [p for p in registered() if p.name.startswith("toy")] == []


def test_registered_toy_parts_are_picked_up(toys, monkeypatch):
    """train.py's build_plan / assemble and the launch checks use a part registered in-process, unedited."""
    import trl_ext.cli_train as cli
    from trl_ext.launch import processes

    source, tmp = toys
    argv = ["--reward", "toy", "--config", str(tmp / "config.yaml"), "--num_prompts", "3", "--torch_compile",
            "--output_dir", str(tmp / "out")]  # fmt: skip
    plan = cli.build_plan(argv)
    assert plan.assembly.names() == {"prompts": ["toy"], "generation": ["trl"], "features": ["routing", "toy_compile"]}
    assert source.calls == ["check_args", "check"]
    assert plan.run_dir.name.startswith("toy_builtin")
    build = cli.assemble(plan, "model-path", tokenizer=None)
    assert build.kwargs["train_dataset"] == ["toy prompt"] * 3 and build.kwargs["reward_funcs"] == ["toy reward"]
    assert build.kwargs["toy"] == "model-path" and build.kwargs["rh_detector"] is None  # routing: no detector bound
    with pytest.raises(ConfigError, match="toy: at most 100 prompts"):
        cli.build_plan([*argv, "--num_prompts", "101"])
    assert ("torch_compile", "toy compilation") in processes.CFG_FLAGS
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^--torch_compile: toy compilation runs on one process for now; this "
                                          r"launch has 2 processes \(WORLD_SIZE=2\)"):
        _parse("--reward", "toy", "--torch_compile")


def test_processes_and_sharding_refusals_name_the_flag():
    from trl_ext.launch.processes import check_cfg_processes
    from trl_ext.launch.sharding import check_cfg_sharding

    _, cfg = _parse("--reward", "happy_binary", "--gradient_routing", "--routing_mode", "shared", "--lora_config",
                    "r4", "--save_rollouts")  # fmt: skip
    check_cfg_processes(cfg, TWO)  # allowed on several processes
    check_cfg_sharding(cfg, {**TWO, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                             "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"})  # and under FSDP2  # fmt: skip
    with pytest.raises(ConfigError, match=r"^--gradient_routing: gradient routing / dual LoRA has not been run under "
                                          r"DeepSpeed \(it reads or copies whole parameters"):
        check_cfg_sharding(cfg, {"ACCELERATE_USE_DEEPSPEED": "true"})


def test_launch_imports_no_feature():
    """trl_ext.launch knows processes and sharding: importing it loads no part module (the parts are loaded by name
    when a launch is checked)."""
    features = ("trl_ext.routing", "trl_ext.distill", "trl_ext.offpolicy", "trl_ext.env", "trl_ext.sft",
                "trl_ext.generation", "trl_ext.assembly")  # fmt: skip
    for path in (ROOT / "trl_ext" / "launch").glob("*.py"):
        assert not any(f"import {m}" in line or f"from {m}" in line for line in path.read_text().splitlines()
                       for m in features), path  # fmt: skip
    code = ("import sys, trl_ext.launch.processes, trl_ext.launch.sharding; "
            f"print([m for m in sys.modules if m.startswith({features!r})])")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


IMPORT_ALONE = """
import os, sys
import torch, transformers, trl, peft, datasets, accelerate  # third-party only: no project module is loaded here
assert not [m for m in sys.modules if m.split(".")[0] in ("trl_ext", "rewards", "environments")]
failed = []
for module in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:  # a child that has loaded no project module imports this one
        import importlib, traceback
        try:
            importlib.import_module(module)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1] != 0:
        failed.append(module)
print("failed:", failed)
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow
def test_each_module_imports_alone():
    """No import cycle: every registering module, the registries and train.py import alone, each in a process that
    has loaded no project module (forked from a fresh interpreter that imported the third-party libraries only, so
    torch and transformers are imported once, not once per module)."""
    modules = ("trl_ext.parts", "trl_ext.assembly", *MODULES, "trl_ext.cli_train")
    done = subprocess.run([sys.executable, "-c", IMPORT_ALONE, *modules], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "failed: []", (done.stdout[-500:], done.stderr[-3000:])
