"""The shipped accelerate configs load with accelerate's own config reader and ask for what their names say; under
FSDP / DeepSpeed (what `accelerate launch --config_file ...` exports) the project's features exit 2 at parse time."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trl_ext.launch.sharding import sharded_training

CONFIGS = Path(__file__).resolve().parents[1] / "accelerate_configs"
EXPECTED = {  # file -> (distributed_type, machines, extra checks)
    "multi_gpu_ddp.yaml": ("MULTI_GPU", 1, {}),
    "multinode_ddp.yaml": ("MULTI_GPU", 2, {}),
    "fsdp2.yaml": ("FSDP", 1, {"fsdp_config": {"fsdp_version": 2, "fsdp_state_dict_type": "FULL_STATE_DICT"}}),
    "deepspeed_zero2.yaml": ("DEEPSPEED", 1, {"deepspeed_config": {"zero_stage": 2}}),
    "deepspeed_zero3.yaml": ("DEEPSPEED", 1, {"deepspeed_config": {"zero_stage": 3, "zero3_save_16bit_model": True}}),
}


def test_every_config_is_listed():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_with_accelerate(name):
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = ClusterConfig.from_yaml_file(str(CONFIGS / name))  # accelerate's reader: unknown keys raise
    kind, machines, extra = EXPECTED[name]
    assert str(cfg.distributed_type).endswith(kind) and cfg.num_machines == machines
    assert cfg.mixed_precision == "no" and not cfg.use_cpu  # precision is train.py's --bf16
    raw = yaml.safe_load((CONFIGS / name).read_text())
    for section, values in extra.items():
        assert {k: raw[section][k] for k in values} == values


@pytest.mark.parametrize("env,flags,kind", [
    ({"ACCELERATE_USE_FSDP": "true"}, {}, "FSDP"),
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, {}, "DeepSpeed"),
    ({}, {"fsdp": "full_shard auto_wrap"}, "FSDP"),
    ({}, {"deepspeed": "ds.json"}, "DeepSpeed"),
    ({"ACCELERATE_USE_FSDP": "false"}, {}, None),
    ({}, {}, None),
])  # fmt: skip
def test_sharded_training(env, flags, kind):
    class Cfg:
        fsdp = flags.get("fsdp", "")
        deepspeed = flags.get("deepspeed")

    assert sharded_training(Cfg, env) == kind


@pytest.mark.parametrize("var,kind", [("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")])  # FSDP2 runs them: test_fsdp*.py
@pytest.mark.parametrize("flags,feature", [
    (["--max_async_level", "1"], "off-policy training"),
    (["--generation_backend", "fast"], "the fast generation backend"),
    (["--gradient_routing", "--routing_mode", "shared", "--lora_config", "r4"], "gradient routing"),
    (["--teacher_tau", "0.5", "--teacher_context", "A happy story."], "distillation"),
])  # fmt: skip
def test_features_refused_under_sharding(train_cli_error, monkeypatch, var, kind, flags, feature):
    monkeypatch.setenv(var, "true")
    err = train_cli_error("--reward", "happy_binary", *flags)
    assert feature in err and f"has not been run under {kind}" in err
