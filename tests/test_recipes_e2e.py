"""End-to-end: train.py from the recipes/ files, and a run again from its own run_config.yaml.

Trained here (``@ recipes/<file> --max_steps 3``), a subset: two recipes composed (the search task, multi-turn,
off-policy at strict k = 1, every mask off, the fast backend) and gradient routing with its eval. The other recipes
(offpolicy_math, distillation, the RAGEN environments with brpo, SFT mode, routing's baseline) differ from these in
settings that the fast tier's tests/test_recipes.py parses and other end-to-end tests train (CI's time).
"""

import sys
from pathlib import Path

import pytest
import yaml
import zygote

ROOT = Path(__file__).resolve().parents[1]
SEARCH_NO_MASKS = ["@", "recipes/offpolicy_search.toml", "@", "recipes/no_masks.toml", "--max_async_level", "1",
                   "--strict_async_level"]  # fmt: skip


def train(*argv: str, cwd: Path = ROOT) -> Path:
    """Run train.py (no wandb); return the one run directory under its --output_dir."""
    proc = zygote.run([sys.executable, str(ROOT / "train.py"), *argv, "--no_wandb"], cwd=cwd, capture_output=True,
                      text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = Path(argv[argv.index("--output_dir") + 1])
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    assert yaml.safe_load((run_dir / "run_summary.json").read_text())["status"] == "done"
    return run_dir


@pytest.mark.slow
def test_routing_recipe_trains(tmp_path):
    run_dir = train("@", "recipes/routing_happy.toml", "--max_steps", "3", "--output_dir", str(tmp_path))
    saved = yaml.safe_load((run_dir / "run_config.yaml").read_text())
    assert saved["flags"]["max_steps"] == 3 and saved["ExtGRPOConfig"]["max_steps"] == 3
    assert saved["flags"]["gradient_routing"] is True and saved["ExtGRPOConfig"]["lora_config"] == "r8"
    assert (run_dir / "routing_eval.jsonl").read_text().count('"step": 3') == 1  # the routing eval at the last step


@pytest.mark.slow
def test_a_run_config_reproduces_its_run(tmp_path):
    """Two recipes composed, then the run again from its run_config.yaml into another directory: the same
    completions, rewards and advantages at every step and the same weights after step 3, bit for bit (strict k = 1:
    the generator's lag is fixed, so the run is deterministic)."""
    import pandas as pd
    from safetensors.torch import load_file

    first = train(*SEARCH_NO_MASKS, "--max_steps", "3", "--save_steps", "3", "--save_rollouts", "--output_dir",
                  str(tmp_path / "a"))  # fmt: skip
    again = train("@", str(first / "run_config.yaml"), "--output_dir", str(tmp_path / "b"))
    assert again.name == first.name
    assert "start weights:" in (again / "train.log").read_text()
    for step in (1, 2, 3):
        a, b = (pd.read_parquet(d / "rollouts" / f"step-{step:06d}-rank0.parquet") for d in (first, again))
        assert len(a) == 32 and a.equals(b), step
    a, b = (load_file(d / "checkpoint-3" / "model.safetensors") for d in (first, again))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.fixture(scope="module")
def qwen3_stand_in(tmp_path_factory):
    """$HF_HOME whose hub cache holds a tiny random Qwen3 under the recipe's hub id ``Qwen/Qwen3-0.6B``, with the
    byte-level tokenizer and TRL's Qwen3 template (tool calls TRL parses): the recipe runs offline, unchanged."""
    from trl_ext.models.tiny import build_tiny_in_hub_cache, trl_template

    home = tmp_path_factory.mktemp("hf_home")
    build_tiny_in_hub_cache("qwen3", home / "hub", "Qwen/Qwen3-0.6B", tokenizer="bytes",
                            chat_template=trl_template("qwen3"), positions=2048)  # fmt: skip
    return home


@pytest.mark.slow
@pytest.mark.parametrize("masks", ["default", "none"])
def test_tool_search_recipe_runs_strict_k8(qwen3_stand_in, tmp_path, masks):
    """Seed 000's shape with tool calls: a chat model's tool-calling search at strict k = 8, with the default masks and
    with every mask off, from the recipe as written (the hub id resolved from the cache, offline). A random model calls
    no tool: this checks the run (lag, masks, the tool loop's plumbing), tests/test_tool_trainer.py the turns."""
    import json
    import os

    flags = ["@", "recipes/tool_search.toml", *(["@", "recipes/no_masks.toml"] if masks == "none" else []),
             "--max_steps", "2", "--batch_size", "8", "--num_generations", "4", "--num_prompts", "16",
             "--max_completion_length", "32", "--output_dir", str(tmp_path), "--bf16", "false", "--use_cpu"]  # fmt: skip
    env = {**os.environ, "HF_HOME": str(qwen3_stand_in), "HF_HUB_OFFLINE": "1"}
    proc = zygote.run([sys.executable, str(ROOT / "train.py"), *flags, "--no_wandb"], cwd=ROOT, env=env,
                      capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    saved = yaml.safe_load((run_dir / "run_config.yaml").read_text())["ExtGRPOConfig"]
    assert saved["max_async_level"] == 8 and saved["strict_async_level"] and saved["env"] == "search_tools"
    assert (saved["token_mask_high"] == 1e10) == (masks == "none")
    state = json.loads((run_dir / "run_summary.json").read_text())
    assert state["status"] == "done"
