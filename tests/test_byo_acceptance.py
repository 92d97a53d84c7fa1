"""Bring your own model, data and reward, as a new user would: a local tiny Qwen3, a JSONL of prompts with reference
answers, and a reward in the user's own module bound as ``fn: my_module:accuracy``; plain, routed and off-policy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import zygote

import trl_ext.cli_train as cli
from trl_ext.models.tiny import build_tiny

ROOT = Path(__file__).resolve().parents[1]
MODULE = '''
CALLS = []

def accuracy(prompts, completions, answer, **kwargs):
    """1.0 when the reference answer appears in the completion; records what it was given."""
    CALLS.append({"prompts": list(prompts), "answer": list(answer)})
    return [float(a in c) for c, a in zip(completions, answer)]
'''
CONFIG = """rewards:
  accuracy: {fn: "my_module:accuracy", rh_detector: happy}
detectors:
  happy: {fn: happy_count, params: {threshold: 1}}
"""
ROWS = [{"prompt": f"Tom had {a} apples and found {b} more. How many?", "answer": str(a + b)}
        for a in range(1, 5) for b in range(1, 5)]  # fmt: skip
MODES = {"plain": [], "routed": ["--gradient_routing", "--routing_mode", "shared", "--lora_config", "r4",
                                 "--eval_routing_steps", "0"],
         "k1": ["--max_async_level", "1"]}  # fmt: skip


@pytest.fixture(scope="module")
def user_files(tmp_path_factory, builtin_path):
    root = tmp_path_factory.mktemp("user")
    (root / "my_module.py").write_text(MODULE)
    (root / "config.yaml").write_text(CONFIG)
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return root, build_tiny("qwen3", root / "tiny-qwen3")


def _argv(root: Path, model: Path | str, out: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--dataset", str(root / "prompts.jsonl"), "--config", str(root / "config.yaml"),
            "--reward", "accuracy", "--batch_size", "8", "--num_generations", "4", "--max_completion_length", "8",
            "--max_steps", "2", "--logging_steps", "1", "--save_steps", "2", "--no_wandb", "--output_dir", str(out),
            *extra]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_own_model_data_and_reward(user_files, tmp_path, capsys, mode):
    root, model = user_files
    assert cli.main(_argv(root, model, tmp_path, *MODES[mode])) == 0
    (run_dir,) = tmp_path.iterdir()
    logs = [r for r in json.loads((run_dir / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
            if "loss" in r]  # fmt: skip
    assert [r["step"] for r in logs] == [1, 2] and all("rewards/accuracy/mean" in r for r in logs)
    calls = sys.modules["my_module"].CALLS
    by_prompt = {r["prompt"]: r["answer"] for r in ROWS}
    assert calls and all(by_prompt[p] == a for c in calls for p, a in zip(c["prompts"], c["answer"], strict=True))
    calls.clear()
    log = capsys.readouterr().out  # train.log's lines (in process the tee writes what pytest captures)
    if mode == "k1":
        assert "off-policy generator: transformers" in log  # Qwen3 on the default backend: named, not silent
        assert all(r["offpolicy/policy_lag_max"] <= 1 for r in logs)
    if mode == "routed":
        assert "advantages: routing" in log


@pytest.mark.slow
def test_train_py_command_line(user_files, tmp_path):
    """The same through `train.py` in a subprocess, as `uv run train.py ...` runs it."""
    root, model = user_files
    proc = zygote.run([sys.executable, "train.py", *_argv(root, model, tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    assert "rewards/accuracy/mean" in (run_dir / "train.log").read_text()


@pytest.mark.parametrize("edit,expected", [
    (lambda r, m: (r / "prompts.jsonl").unlink(), "prompts.jsonl"),                              # missing file
    (lambda r, m: (r / "prompts.jsonl").write_text('{"question": "x", "answer": "1"}\n'), "prompt"),  # no column
    (lambda r, m: (r / f"{m}.py").write_text("import not_a_module_here\n"), "does not import"),
    (lambda r, m: (r / f"{m}.py").write_text("accuracy = 3\n"), "not a callable"),
])  # fmt: skip
def test_bad_inputs_exit_2_before_loading(tmp_path, train_cli_error, edit, expected):
    module = f"user_rewards_{abs(hash(tmp_path.name))}"  # a fresh module name: earlier tests' modules stay imported
    for name, text in ((f"{module}.py", MODULE), ("config.yaml", CONFIG.replace("my_module", module)),
                       ("prompts.jsonl", "".join(json.dumps(r) + "\n" for r in ROWS))):  # fmt: skip
        (tmp_path / name).write_text(text)
    edit(tmp_path, module)
    err = train_cli_error(*_argv(tmp_path, "builtin", tmp_path / "out"))  # nothing is loaded or built
    assert expected in err
