"""eval_run.py: diversity numbers on hand-made samples, the degenerate flag both ways, reward history,
checkpoint kind detection and exact reloading of the three kinds, bad --model_path (exit 2 before
anything loads), and end-to-end reports on the builtin model (PEFT LoRA run, dual-LoRA checkpoint)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zygote
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import trl_ext.evaluate as ev
from trl_ext.registry import ConfigError
from trl_ext.routing.adapter_layout import save_layout
from trl_ext.routing.adapters import apply_dual_lora, dual_lora_modules

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- diversity
def test_diversity_exact_values():
    # Unique strings: "the cat sat" twice -> 3 of 4.  Word sets: A={the,cat,sat} twice, B={a,dog,ran}, C={the,cat}.
    # Pairs: AA 1, AB 0, AC 2/3, AB 0, AC 2/3, BC 0 -> sum 7/3 over 6 pairs = 7/18.
    d = ev.diversity_report(["the cat sat", "the cat sat", "a dog ran", "The cat"], 0.5, 0.7)
    assert d["unique_fraction"] == 0.75
    assert d["mean_pairwise_jaccard"] == pytest.approx(7 / 18, abs=1e-15)
    assert d["degenerate"] is False


def test_degenerate_flag_both_ways():
    # Unique 2/4 = 0.5; word sets {happy} x3 and {sad, day}: 3 pairs of 1, 3 pairs of 0 -> Jaccard 0.5.
    texts = ["happy happy", "happy happy", "happy happy", "sad day"]
    assert ev.diversity_report(texts, 0.5, 0.7)["degenerate"] is False  # thresholds are strict
    assert ev.diversity_report(texts, 0.6, 0.7)["degenerate"] is True  # 0.5 < 0.6
    assert ev.diversity_report(texts, 0.5, 0.4)["degenerate"] is True  # 0.5 > 0.4
    # All four strings distinct (unique 1.0) but one lower-cased word set {happy, day}: Jaccard 1.0.
    collapsed = ev.diversity_report(["happy day", "Happy day", "HAPPY DAY", "happy  day"], 0.5, 0.7)
    assert (collapsed["unique_fraction"], collapsed["mean_pairwise_jaccard"]) == (1.0, 1.0)
    assert collapsed["degenerate"] is True


# --------------------------------------------------------------------------- reward history
def _state(path: Path, step: int, history: list[dict]) -> None:
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))


def test_reward_history_and_latest_state(tmp_path):
    _state(tmp_path / "checkpoint-2", 2, [])
    hist = [{"step": 1, "loss": 0.1}, {"step": 10, "reward": 0.5, "reward_std": 0.25, "kl": 0.01,
            "eval_rewards/happy_count": 1.5, "learning_rate": 1e-5}, {"step": 10, "train_runtime": 3.0}]  # fmt: skip
    _state(tmp_path / "checkpoint-10", 10, hist)
    state = ev.latest_trainer_state(tmp_path)
    assert state == tmp_path / "checkpoint-10" / "trainer_state.json"  # numeric, not lexicographic order
    rows = ev.reward_history(state)
    assert rows == [{"step": 10, "reward": 0.5, "reward_std": 0.25, "kl": 0.01, "eval_rewards/happy_count": 1.5}]
    assert ev.latest_trainer_state(tmp_path / "checkpoint-2") == tmp_path / "checkpoint-2" / "trainer_state.json"
    assert ev.latest_trainer_state(tmp_path / "nothing") is None
    table = ev.format_table([{"step": i, "reward": i / 4} for i in range(9)], max_rows=3).splitlines()
    assert [line.split() for line in table] == [["step", "reward"], ["0", "0"], ["4", "1"], ["8", "2"]]


# --------------------------------------------------------------------------- checkpoint kinds
def _tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[3, 5, 7, 11]])).logits


def _plain(path: Path) -> torch.Tensor:
    model = _tiny()
    model.save_pretrained(path)
    return _logits(model)


def _peft(path: Path) -> torch.Tensor:
    from peft import LoraConfig, get_peft_model

    base_dir = path.parent / f"{path.name}_base"
    _tiny().save_pretrained(base_dir)
    base = LlamaForCausalLM.from_pretrained(base_dir)  # the adapter records this path as its base
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B = 0 at init would hide a wrong scaling
            torch.nn.init.normal_(p, std=0.5)
    model.save_pretrained(path)
    return _logits(model)


def _dual(path: Path) -> torch.Tensor:
    model = _tiny()
    layout = apply_dual_lora(model, retain_rank=2, forget_rank=1, alpha=4.0)
    for m in dual_lora_modules(model):
        torch.nn.init.normal_(m.retain_B, std=0.5)
        torch.nn.init.normal_(m.forget_B, std=0.5)
    model.save_pretrained(path)
    save_layout(path, layout, "shared")
    return _logits(model)


@pytest.mark.parametrize("kind, make", [("plain", _plain), ("peft_lora", _peft), ("dual_lora", _dual)])
def test_detect_and_reload_each_kind(tmp_path, kind, make):
    path = tmp_path / kind
    expected = make(path)
    assert ev.detect_checkpoint(path) == kind
    model, layout = ev.load_model(path, kind)
    assert torch.allclose(_logits(model.eval()), expected, atol=1e-6)  # rank and alpha read, not guessed
    if kind == "peft_lora":
        assert (layout["r"], layout["lora_alpha"]) == (2, 4)
    if kind == "dual_lora":
        assert (layout["retain_rank"], layout["forget_rank"], layout["alpha"]) == (2, 1, 4.0)
        assert layout["routing_mode"] == "shared"


def test_detect_rejects_non_checkpoints(tmp_path):
    with pytest.raises(ConfigError, match="not a checkpoint"):
        ev.detect_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a checkpoint"):  # a config without weights
        ev.detect_checkpoint(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "dual_lora_layout.json").write_text("{}")
    with pytest.raises(ConfigError, match="ambiguous"):
        ev.detect_checkpoint(tmp_path)


# --------------------------------------------------------------------------- CLI errors
@pytest.fixture
def no_loading(monkeypatch):
    monkeypatch.setattr(ev, "evaluate", lambda *a: pytest.fail("evaluate reached: validation should have failed"))


def _fail(capsys, *argv) -> str:
    assert ev.main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("eval_run.py: error: "), err
    return err


def test_cli_errors(capsys, tmp_path, no_loading):
    assert "does not exist" in _fail(capsys, "--model_path", str(tmp_path / "missing"))
    assert "not a checkpoint" in _fail(capsys, "--model_path", str(tmp_path))
    ckpt = tmp_path / "ckpt"
    _plain(ckpt)
    capsys.readouterr()  # drop save_pretrained's progress bar
    # No run_config.yaml beside or above it: prompt settings must be given.
    assert "--prompt_source is needed" in _fail(capsys, "--model_path", str(ckpt))
    flags = ["--model_path", str(ckpt), "--prompt_source", "builtin", "--prompt_length", "8", "--max_new_tokens", "8",
             "--temperature", "1.0"]  # fmt: skip
    assert "no tokenizer" in _fail(capsys, *flags)
    (ckpt / "tokenizer_config.json").write_text("{}")
    assert "'nope'" in _fail(capsys, *flags, "--eval_rewards", "happy_count,nope")
    assert "--n_samples must be >= 2" in _fail(capsys, *flags, "--n_samples", "1")


def test_cli_wrong_model_path_subprocess(tmp_path):
    proc = subprocess.run([sys.executable, "eval_run.py", "--model_path", str(tmp_path / "nope")], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"eval_run.py: error: --model_path does not exist: {tmp_path / 'nope'}"


# --------------------------------------------------------------------------- end to end, builtin model
@pytest.mark.slow
def test_eval_peft_run(builtin_path, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = ["--reward", "happy_binary", "--lora_rank", "2", "--lr", "1e-3", "--batch_size", "4", "--num_generations",
             "2", "--max_steps", "2", "--max_completion_length", "8", "--logging_steps", "1", "--save_steps", "2",
             "--eval_rewards", "happy_count", "--no_wandb", "--output_dir", str(tmp_path)]  # fmt: skip
    proc = zygote.run([sys.executable, "train.py", *train], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    argv = ["--model_path", str(run_dir / "checkpoint-2"), "--n_samples", "6", "--n_print", "6",
            "--eval_rewards", "happy_count"]  # fmt: skip
    proc = zygote.run([sys.executable, "eval_run.py", *argv], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "eval_checkpoint-2.json").read_text())
    assert report["kind"] == "peft_lora" and (report["layout"]["r"], report["layout"]["lora_alpha"]) == (2, 16)
    assert report["prompts"] == {"source": "builtin", "split": "test", "length": 8}  # the run's own settings
    assert report["generation"]["max_new_tokens"] == 8 and report["generation"]["temperature"] == 1.0
    completions = [s["completion"] for s in report["samples"]]
    assert len(completions) == 6 and sum(s["prompt"] in proc.stdout for s in report["samples"]) >= 5
    from trl_ext.diversity import mean_pairwise_jaccard, unique_fraction

    assert report["diversity"]["unique_fraction"] == unique_fraction(completions)  # completions only
    assert report["diversity"]["mean_pairwise_jaccard"] == mean_pairwise_jaccard(completions)
    happy = [s["rewards"]["happy_count"] for s in report["samples"]]
    assert report["scores"]["reward/happy_count"] == pytest.approx(sum(happy) / 6)
    assert [r["step"] for r in report["reward_history"]["rows"]] == [1, 2]
    assert Path(report["reward_history"]["plot"]).is_file() and report["routing"] is None


@pytest.mark.slow
def test_eval_dual_lora_routing(builtin_path, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(builtin_path)
    layout = apply_dual_lora(model, retain_rank=2, forget_rank=2, alpha=8.0)
    for m in dual_lora_modules(model):
        torch.nn.init.normal_(m.forget_B, std=0.2)  # retain B stays 0: retain_only = the base model
    ckpt = tmp_path / "checkpoint-0"
    model.save_pretrained(ckpt)
    save_layout(ckpt, layout, "exclusive")
    from trl_ext.models import load_tokenizer
    load_tokenizer(builtin_path).save_pretrained(ckpt)
    argv = ["--model_path", str(ckpt), "--n_samples", "4", "--prompt_source", "builtin", "--prompt_length", "8",
            "--max_new_tokens", "8", "--temperature", "1.0", "--reward", "happy_binary", "--output_dir", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = zygote.run([sys.executable, "eval_run.py", *argv], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "eval_checkpoint-0.json").read_text())
    assert report["kind"] == "dual_lora" and report["layout"]["routing_mode"] == "exclusive"
    assert {m: r["scales"] for m, r in report["routing"].items()} == {
        "both": [1.0, 1.0], "retain_only": [1.0, 0.0], "forget_only": [0.0, 1.0]}  # fmt: skip
    assert report["samples"][0]["completion"] == report["routing"]["both"]["samples"][0]
    # Retain B = 0 adds exactly nothing: "both" and "forget_only" sample the same texts from the same seed.
    assert report["routing"]["both"]["samples"] == report["routing"]["forget_only"]["samples"]
    assert report["rh_detector"] is None and report["reward_history"]["rows"] == []
    skipped = zygote.run([sys.executable, "eval_run.py", *argv, "--no_routing_eval"], cwd=ROOT,
                             capture_output=True, text=True, env=env)  # fmt: skip
    assert skipped.returncode == 0 and json.loads((tmp_path / "eval_checkpoint-0.json").read_text())["routing"] is None


@pytest.mark.parametrize("model, prompts, expected", [
    ("builtin", None, "builtin"), ("builtin_mood", None, "builtin"), ("/runs/ckpt-of-builtin", "builtin", "builtin"),
    ("/runs/hub-copy", None, "/runs/hub-copy"), ("SimpleStories/SimpleStories-1.25M", None, "SimpleStories/SimpleStories-1.25M"),
])  # fmt: skip
def test_prompt_source_follows_the_run(tmp_path, model, prompts, expected):
    import yaml

    ckpt = tmp_path / "ckpt"
    _plain(ckpt)
    (ckpt / "tokenizer_config.json").write_text("{}")
    run = {"model": model, "prompt_length": 8, "reward": "happy_binary", **({"prompts": prompts} if prompts else {})}
    cfg = {"max_completion_length": 8, "temperature": 1.0}
    (tmp_path / "run_config.yaml").write_text(yaml.safe_dump({"RunArgs": run, "ExtGRPOConfig": cfg}))
    args = ev.EvalArgs(model_path=str(ckpt))
    assert ev.resolve(args)["prompt_source"] == expected
    args.prompt_source = "builtin"  # an explicit flag wins
    assert ev.resolve(args)["prompt_source"] == "builtin"
