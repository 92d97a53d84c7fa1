"""Prompt datasets (``--dataset`` / ``--eval_dataset``, trl_ext/data/load.py): every format loads from small files
written here, plain and conversational prompt columns, split slicing, the row cap, each parse-time error as train.py's
exit 2 (no model loaded), run names, and end to end (slow): a 2-step run on the builtin model whose reward records the
dataset columns it gets (also in TRL's eval loop), then eval_run.py on a held-out file."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pandas as pd
import pytest

import trl_ext.cli_train as cli
import trl_ext.data.load as data
from trl_ext.registry import ConfigError

ROWS = [{"prompt": "What is 2 plus 3?", "answer": "5"}, {"prompt": "What is 1 plus 1?", "answer": "2"},
        {"prompt": "Name a color.", "answer": "red"}]  # fmt: skip
CHAT = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
         "answer": "hi"}, {"messages": [{"role": "user", "content": "Say yes."}], "answer": "yes"}]  # fmt: skip


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write(fmt: str, tmp_path: Path, rows: list[dict] = ROWS) -> str:
    """``rows`` in format ``fmt``; returns the --dataset argument."""
    if fmt == "jsonl":
        return jsonl(tmp_path / "p.jsonl", rows)
    if fmt == "json":  # one JSON array of objects
        (tmp_path / "p.json").write_text(json.dumps(rows))
        return str(tmp_path / "p.json")
    if fmt == "csv":
        pd.DataFrame(rows).to_csv(tmp_path / "p.csv", index=False)
        return str(tmp_path / "p.csv")
    if fmt == "parquet":
        pd.DataFrame(rows).to_parquet(tmp_path / "p.parquet")
        return str(tmp_path / "p.parquet")
    if fmt == "save_to_disk":
        datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "saved")
        return str(tmp_path / "saved")
    if fmt == "save_to_disk_dict":
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "saved_dict")
        return str(tmp_path / "saved_dict")
    raise ValueError(fmt)


# ------------------------------------------------------------------------------------------- loading
@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "save_to_disk", "save_to_disk_dict"])
def test_each_format_loads(tmp_path, fmt):
    rows = [{"question": r["prompt"], "answer": r["answer"], "level": i} for i, r in enumerate(ROWS)]
    d = data.load_prompt_data(write(fmt, tmp_path, rows), "train", "question")
    assert d.kind == data.TEXT and d.split == "train"
    assert d.dataset.column_names == ["prompt", "answer", "level"]  # the prompt column renamed to TRL's "prompt"
    assert d.reward_columns == ["answer", "level"]
    assert d.dataset["prompt"] == [r["prompt"] for r in ROWS]
    assert list(d.dataset["answer"]) == [r["answer"] for r in ROWS] and list(d.dataset["level"]) == [0, 1, 2]


def test_conversational_prompts(tmp_path):
    d = data.load_prompt_data(jsonl(tmp_path / "c.jsonl", CHAT), "train", "messages")
    assert d.kind == data.CONVERSATIONAL and d.reward_columns == ["answer"]
    assert d.dataset[0]["prompt"] == CHAT[0]["messages"] and d.dataset[1]["prompt"] == CHAT[1]["messages"]
    from trl.data_utils import is_conversational

    assert is_conversational(d.dataset[0])  # TRL reads it as a chat prompt


def test_splits_slices_and_row_cap(tmp_path):
    path = write("jsonl", tmp_path)
    assert data.load_prompt_data(path, "train[1:]", "prompt").dataset["prompt"] == [r["prompt"] for r in ROWS[1:]]
    assert data.load_prompt_data(path, "train", "prompt", max_rows=2).dataset["answer"] == ["5", "2"]  # first rows
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])})
    dd.save_to_disk(tmp_path / "dd")
    assert data.load_prompt_data(str(tmp_path / "dd"), "test", "prompt").dataset["answer"] == ["5"]
    both = data.load_prompt_data(str(tmp_path / "dd"), "train[-34%:]+test", "prompt").dataset["answer"]
    assert list(both) == ["red", "5"]  # the last 34% of 3 rows (1.02 rounds to 1: datasets' ReadInstruction), test
    saved = write("save_to_disk", tmp_path)
    assert data.load_prompt_data(saved, "train[-1:]", "prompt").dataset["answer"] == ["red"]


def test_local_or_hub_and_tags():
    assert data.is_local("data/p.jsonl") and data.is_local("./x") and data.is_local("/abs/dir")
    assert data.is_local("a/b/c") and not data.is_local("openai/gsm8k") and not data.is_local("squad")
    assert data.dataset_tag("/tmp/some dir/my_prompts.jsonl") == "my_prompts"
    assert data.dataset_tag("/tmp/saved/") == "saved" and data.dataset_tag("openai/gsm8k") == "gsm8k"


def test_row_scorer_passes_the_rows_columns(tmp_path):
    d = data.load_prompt_data(write("jsonl", tmp_path), "train", "prompt")
    calls = []

    class Reward:  # the rewards/bound.py interface: r(texts, **context), needs_context()
        def needs_context(self):
            return True

        def __call__(self, texts, **context):
            calls.append(context)
            return [float(t == a) for t, a in zip(texts, context["answer"], strict=True)]

    assert data.row_scorer(Reward(), d, 3)(["5", "x", "red"]) == [1.0, 0.0, 1.0]
    assert data.row_scorer(Reward(), d, 3)(["5"]) == [1.0]  # the first rows' columns for fewer texts
    assert calls[0] == {"prompts": [r["prompt"] for r in ROWS], "answer": ["5", "2", "red"]}
    plain = lambda texts: [0.0] * len(texts)  # noqa: E731  (reads texts only: passed through as it is)
    assert data.row_scorer(plain, d, 3) is plain


# ------------------------------------------------------------------------------------------- train.py exit 2
BASE = ["--reward", "happy_binary", "--no_wandb"]
EVAL_LOOP = ["--eval_strategy", "steps", "--eval_steps", "5", "--per_device_eval_batch_size", "16"]


def test_plan_keeps_the_loaded_data(tmp_path, monkeypatch):
    calls = []
    load = data.load_split
    monkeypatch.setattr(data, "load_split", lambda *a, **k: calls.append(a) or load(*a, **k))
    path = write("jsonl", tmp_path)
    plan = cli.build_plan([*BASE, "--dataset", path, "--num_prompts", "2", "--output_dir", str(tmp_path)])
    assert plan.train_data.dataset["prompt"] == [r["prompt"] for r in ROWS[:2]] and plan.eval_data is None
    assert plan.run.prompt_length is None and plan.run.dataset_split == "train" and plan.run.prompt_column == "prompt"
    assert len(calls) == 1
    assert plan.run_dir.name == "happy_binary_builtin_data-p_lr1e-5_b0.02_bs32_ng16_full_st2000_s42_num_prompts2"
    story = cli.build_plan([*BASE, "--output_dir", str(tmp_path)])
    assert (story.run.num_prompts, story.run.prompt_length, story.train_data) == (2048, 8, None)


def test_run_names_with_a_dataset(tmp_path):
    path = write("jsonl", tmp_path)
    name = cli.build_plan([*BASE, "--dataset", path, "--output_dir", str(tmp_path)]).run_dir.name
    assert name == "happy_binary_builtin_data-p_lr1e-5_b0.02_bs32_ng16_full_st2000_s42" and "/" not in name
    explicit = cli.build_plan([*BASE, "--dataset", path, "--dataset_split", "train", "--prompt_column", "prompt",
                               "--output_dir", str(tmp_path)]).run_dir.name  # fmt: skip
    assert explicit == name  # the resolved defaults, given explicitly, name the same run
    sliced = cli.build_plan([*BASE, "--dataset", path, "--dataset_split", "train[:2]", "--eval_dataset", path,
                             "--eval_dataset_split", "train[2:]", "--eval_strategy", "steps", "--eval_steps", "5",
                             "--per_device_eval_batch_size", "16", "--output_dir", str(tmp_path)]).run_dir.name
    assert sliced == name + "_dataset_splittrain-2"  # the eval prompts and TRL's eval settings do not define it


def _chat_model(tmp_path: Path, with_template: bool) -> str:
    d = tmp_path / "model"
    d.mkdir()
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if with_template:
        config["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return str(d)


def test_train_cli_errors(train_cli_error, tmp_path, monkeypatch, capsys):
    path = write("jsonl", tmp_path)
    run = lambda *flags: train_cli_error(*BASE, "--output_dir", str(tmp_path), *flags)  # noqa: E731

    def bad(name: str, text: str) -> str:
        (tmp_path / name).write_text(text)
        return str(tmp_path / name)

    nope = str(tmp_path / "nope.jsonl")
    assert f"--dataset {nope}: no such file" in run("--dataset", nope)
    assert "does not load" in run("--dataset", bad("broken.jsonl", '{"prompt": "a"}\n{"prompt": \n'))
    assert "the file is empty" in run("--dataset", bad("empty.jsonl", ""))
    assert "unknown file type '.txt'" in run("--dataset", bad("p.txt", "hello"))
    assert f"--dataset {path} (split 'train[:0]') has no rows" in run("--dataset", path, "--dataset_split", "train[:0]")
    header_only = bad("h.csv", "prompt,answer\n")
    assert f"--dataset {header_only} (split 'train') has no rows" in run("--dataset", header_only)
    datasets.Dataset.from_list(ROWS).save_to_disk(tmp_path / "saved")
    capsys.readouterr()  # drop save_to_disk's progress bars
    assert "(split 'train[3:]') has no rows" in run("--dataset", str(tmp_path / "saved"), "--dataset_split",
                                                    "train[3:]")  # fmt: skip
    assert "has no split 'test'" in run("--dataset", path, "--dataset_split", "test")
    assert "has no column 'question' (--prompt_column); columns: prompt, answer" in run(
        "--dataset", path, "--prompt_column", "question")
    pd.DataFrame({"prompt": [1, 2]}).to_csv(tmp_path / "ints.csv", index=False)
    err = run("--dataset", str(tmp_path / "ints.csv"))
    assert "prompt column 'prompt' must hold text or conversational messages" in err and "int64" in err
    assert "row 1 has an empty prompt" in run("--dataset", jsonl(tmp_path / "e.jsonl", [ROWS[0], {"prompt": ""}]))
    assert "row 1 has no prompt (null)" in run("--dataset", jsonl(tmp_path / "n.jsonl", [ROWS[0], {"prompt": None}]))
    no_content = [{"messages": [{"role": "user", "content": "a"}]}, {"messages": [{"role": "user"}]}]
    assert "row 1 has a message without text 'content'" in run(  # keys that differ by row: datasets' Json type
        "--dataset", jsonl(tmp_path / "m.jsonl", no_content), "--prompt_column", "messages")
    no_role = [{"messages": [{"role": "user", "content": "a"}]}, {"messages": [{"role": None, "content": "b"}]}]
    assert "row 1 has a message without 'role'" in run(  # the same keys: a struct column, checked in Arrow
        "--dataset", jsonl(tmp_path / "m2.jsonl", no_role), "--prompt_column", "messages")
    assert "row 1 has no messages" in run(
        "--dataset", jsonl(tmp_path / "m0.jsonl", [*CHAT[:1], {"messages": []}]), "--prompt_column", "messages")
    assert "column 'completions' cannot be passed to the rewards" in run(
        "--dataset", jsonl(tmp_path / "r.jsonl", [{"prompt": "a", "completions": "x"}]))
    assert "already has" in run("--dataset", jsonl(tmp_path / "two.jsonl", [{"prompt": "a", "q": "b"}]),
                                "--prompt_column", "q")  # fmt: skip
    # contradictions and flags that would be ignored
    assert "--dataset and --prompts exclude each other" in run("--dataset", path, "--prompts", "builtin")
    assert "--prompt_length cuts story prompts" in run("--dataset", path, "--prompt_length", "8")
    assert "--num_prompts 4 exceeds the 3 rows" in run("--dataset", path, "--num_prompts", "4")
    assert "--dataset_split test would be ignored: it needs --dataset" in run("--dataset_split", "test")
    assert "--prompt_column q would be ignored" in run("--prompt_column", "q")
    assert "--eval_dataset_split test would be ignored: it needs --eval_dataset" in run("--eval_dataset_split", "test")
    err = train_cli_error("--env", "arithmetic", "--model", "builtin_env", "--dataset", path, "--no_wandb")
    assert "--dataset / --eval_dataset and --env exclude each other" in err
    # the eval loop
    assert "would never be used" in run("--dataset", path, "--eval_dataset", path, "--eval_dataset_split", "train[2:]")
    assert "--eval_strategy steps has nothing to evaluate" in run("--eval_strategy", "steps", "--eval_steps", "5",
                                                                       "--per_device_eval_batch_size", "16")
    assert "the eval prompts would be the training prompts" in run(
        "--dataset", path, "--eval_dataset", path, "--eval_strategy", "steps", "--eval_steps", "5",
        "--per_device_eval_batch_size", "16")
    chat = jsonl(tmp_path / "c.jsonl", CHAT)
    other = jsonl(tmp_path / "other.jsonl", [{"prompt": "a", "label": 1}])
    err = run("--dataset", path, "--eval_dataset", other, "--eval_strategy", "steps", "--eval_steps", "5",
              "--per_device_eval_batch_size", "16")  # fmt: skip
    assert "does not match --dataset" in err and "['label']" in err and "['answer']" in err
    # conversational prompts need a chat template
    err = run("--dataset", chat, "--prompt_column", "messages")
    assert "conversational prompts, which need a chat template; --model builtin's tokenizer has none" in err
    err = run("--dataset", chat, "--prompt_column", "messages", "--model", _chat_model(tmp_path, False))
    assert "need a chat template" in err and "tokenizer has none" in err
    # held-out story prompts are not a --dataset run's
    assert "--eval_baseline samples held-out story prompts" in run(
        "--dataset", path, "--teacher_context", "A happy story.", "--eval_baseline")
    assert "with --dataset it takes the first --eval_routing_prompts rows of --eval_dataset" in run(
        "--dataset", path, "--lora_config", "r1")
    assert "the routing eval needs >= 2 prompts; --eval_dataset" in run(
        "--dataset", path, "--eval_dataset", path, "--eval_dataset_split", "train[2:]", "--eval_strategy", "steps",
        "--eval_steps", "5", "--per_device_eval_batch_size", "16", "--lora_config", "r1")  # fmt: skip
    (tmp_path / "held_out").mkdir()
    assert "--eval_routing_prompts 8 exceeds the 3 rows" in run(
        "--dataset", path, "--eval_dataset", write("jsonl", tmp_path / "held_out"), *EVAL_LOOP, "--lora_config", "r1",
        "--eval_routing_prompts", "8")
    # a hub id that cannot be loaded (offline here: no network is tried)
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    err = run("--dataset", "someone/no-such-dataset")
    assert "--dataset someone/no-such-dataset is not a local path, and the hub could not load it" in err


def test_conversational_accepted_with_a_chat_template(tmp_path):
    chat = jsonl(tmp_path / "c.jsonl", CHAT)
    plan = cli.build_plan([*BASE, "--dataset", chat, "--prompt_column", "messages", "--model",
                           _chat_model(tmp_path, True), "--output_dir", str(tmp_path)])  # fmt: skip
    assert plan.train_data.kind == data.CONVERSATIONAL and plan.train_data.reward_columns == ["answer"]


# ------------------------------------------------------------------------------------------- eval_run.py
def test_eval_run_data_choice():
    run = {"dataset": "d.jsonl", "dataset_split": "train", "prompt_column": "q", "eval_dataset": "e.jsonl",
           "eval_dataset_split": "train[:5]"}  # fmt: skip
    assert data.eval_data_choice(None, None, None, run) == ("e.jsonl", "train[:5]", "q")  # the run's eval data
    assert data.eval_data_choice("t.jsonl", None, None, run) == ("t.jsonl", "train", "q")
    assert data.eval_data_choice(None, None, None, {"model": "builtin"}) is None  # story prompts
    with pytest.raises(ConfigError, match="had no --eval_dataset: pass --dataset"):
        data.eval_data_choice(None, None, None, {"dataset": "d.jsonl", "dataset_split": "train"})
    with pytest.raises(ConfigError, match="is the run's training data"):
        data.eval_data_choice("d.jsonl", "train", None, run)
    with pytest.raises(ConfigError, match="--dataset_split test would be ignored"):
        data.eval_data_choice(None, "test", None, {})


def test_eval_run_cli_errors(tmp_path, monkeypatch, capsys):
    """eval_run.py's dataset errors exit 2 before anything loads (the checkpoint files are empty stand-ins)."""
    import yaml

    import trl_ext.evaluate as ev

    monkeypatch.setattr(ev, "evaluate", lambda *a: pytest.fail("evaluate reached: validation should have failed"))
    ckpt = tmp_path / "run" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (ckpt / name).write_text("{}")
    path = write("jsonl", tmp_path)
    run = {"model": "builtin", "reward": "happy_binary", "dataset": path, "dataset_split": "train",
           "prompt_column": "prompt", "prompt_length": None}  # fmt: skip
    cfg = {"max_completion_length": 8, "temperature": 1.0}
    (tmp_path / "run" / "run_config.yaml").write_text(yaml.safe_dump({"RunArgs": run, "ExtGRPOConfig": cfg}))

    def fail(*argv: str) -> str:
        assert ev.main(["--model_path", str(ckpt), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("eval_run.py: error: "), err
        return err

    assert "had no --eval_dataset: pass --dataset with held-out prompts" in fail()
    held_out = jsonl(tmp_path / "test.jsonl", ROWS[:2])
    assert "--prompt_length picks story prompts" in fail("--dataset", held_out, "--prompt_length", "8")
    assert "--n_samples 3 exceeds the 2 rows" in fail("--dataset", held_out, "--n_samples", "3")
    assert "no such file" in fail("--dataset", str(tmp_path / "nope.jsonl"))
    assert "has no column 'q'" in fail("--dataset", held_out, "--prompt_column", "q")
    chat = jsonl(tmp_path / "c.jsonl", CHAT)
    err = fail("--dataset", chat, "--prompt_column", "messages", "--n_samples", "2")
    assert "holds conversational prompts, and the tokenizer of" in err and "has no chat template" in err
    settings = ev.resolve(ev.EvalArgs(model_path=str(ckpt), dataset=held_out, n_samples=2))
    assert settings["data"].reward_columns == ["answer"] and len(settings["data"].dataset) == 2


# ------------------------------------------------------------------------------------------- end to end
RECORDER = '''import json, os

def answer_match(completions, answer, level, prompts, trainer_state=None):
    """1 when the completion contains the row's answer; records what it was called with."""
    with open(os.environ["TRL_EXT_TEST_RECORD"], "a") as f:
        f.write(json.dumps({"answer": answer, "level": level, "prompts": prompts,
                            "step": trainer_state.global_step if trainer_state is not None else None}) + "\\n")
    return [float(a in c) for c, a in zip(completions, answer)]
'''


@pytest.mark.slow
def test_dataset_columns_reach_the_reward_and_eval_run(builtin_path, tmp_path, monkeypatch, capsys):
    """A 2-step run on a JSONL with an ``answer`` and a ``level`` column: every reward call gets each completion's own
    row (prompt, answer, level aligned), TRL's eval loop scores the eval file, and eval_run.py scores held-out rows
    with their columns (about 30 s on 2 cores)."""
    import trl_ext.evaluate as ev

    (tmp_path / "recorder.py").write_text(RECORDER)
    (tmp_path / "config.yaml").write_text("rewards:\n  answer_match: {fn: recorder.py:answer_match}\n")
    words = ["cat", "dog", "bird", "fox", "owl", "frog"]
    rows = [{"prompt": f"Once upon a time, there was a {w}", "answer": a, "level": i}
            for i, (w, a) in enumerate(zip(words, ["the", "a", "and", "was", "happy", "sad"]))]  # fmt: skip
    train, held_out = jsonl(tmp_path / "train.jsonl", rows[:4]), jsonl(tmp_path / "test.jsonl", rows[4:])
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("TRL_EXT_TEST_RECORD", str(record))
    flags = ["--reward", "answer_match", "--config", str(tmp_path / "config.yaml"), "--dataset", train,
             "--eval_dataset", held_out, "--eval_strategy", "steps", "--eval_steps", "2",
             "--per_device_eval_batch_size", "4", "--batch_size", "4", "--num_generations", "2", "--max_steps", "2",
             "--max_completion_length", "8", "--logging_steps", "1", "--save_steps", "2", "--no_wandb",
             "--output_dir", str(tmp_path / "out")]  # fmt: skip
    assert cli.main(flags) == 0
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    by_prompt = {r["prompt"]: r for r in rows}
    train_calls = [c for c in calls if set(c["prompts"]) <= {r["prompt"] for r in rows[:4]}]
    eval_calls = [c for c in calls if set(c["prompts"]) <= {r["prompt"] for r in rows[4:]}]
    assert len(train_calls) == 2 and len(eval_calls) == 1 and len(calls) == 3
    for c in calls:
        assert len(c["prompts"]) == 4 and c["step"] is not None
        assert c["answer"] == [by_prompt[p]["answer"] for p in c["prompts"]]  # each completion's own row
        assert c["level"] == [by_prompt[p]["level"] for p in c["prompts"]]
    (run_dir,) = (tmp_path / "out").iterdir()
    assert run_dir.name.startswith("answer_match_builtin_data-train_lr1e-5_")
    state = json.loads((run_dir / "checkpoint-2" / "trainer_state.json").read_text())
    assert any("eval_rewards/answer_match/mean" in h for h in state["log_history"])  # TRL's eval loop ran
    log = capsys.readouterr().out  # (train.log's tee writes what the process prints)
    assert f"train prompts: {train} (split 'train'): 4 rows of text prompts; columns passed to the rewards: answer, " \
           "level" in log  # fmt: skip

    # eval_run.py: the run's --eval_dataset by default, its columns passed to the reward
    record.unlink()
    assert ev.main(["--model_path", str(run_dir / "checkpoint-2"), "--n_samples", "2"]) == 0
    report = json.loads((run_dir / "eval_checkpoint-2.json").read_text())
    assert report["prompts"] == {"source": held_out, "split": "train", "kind": "text", "columns": ["answer", "level"]}
    assert sorted(s["prompt"] for s in report["samples"]) == sorted(r["prompt"] for r in rows[4:])
    for smp in report["samples"]:
        assert smp["rewards"]["answer_match"] == float(by_prompt[smp["prompt"]]["answer"] in smp["completion"])
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert calls and all(c["answer"] == [by_prompt[p]["answer"] for p in c["prompts"]] for c in calls)
    assert all(c["step"] is None for c in calls)  # no trainer state outside training
    # a training file's own split is not held out
    assert ev.main(["--model_path", str(run_dir / "checkpoint-2"), "--dataset", train]) == 2
    assert "is the run's training data" in capsys.readouterr().err


CHAT_RECORDER = '''import json, os

def says_answer(completions, prompts, answer, **kwargs):
    with open(os.environ["TRL_EXT_TEST_RECORD"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "answer": answer}) + "\\n")
    return [float(a in c[-1]["content"]) for c, a in zip(completions, answer)]
'''


@pytest.mark.slow
def test_conversational_dataset_run(builtin_cache, tmp_path, monkeypatch, capsys):
    """Chat prompts through TRL's conversational path: builtin_env's weights with a chat template on its tokenizer;
    the reward gets each row's messages as ``prompts`` and TRL's assistant-message completions (about 10 s)."""
    import shutil

    from trl_ext.models import model_source

    model = tmp_path / "chat-model"
    shutil.copytree(model_source("builtin_env"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<{{ m.role }}> {{ m.content }} </{{ m.role }}> {% endfor %}"
                               "{% if add_generation_prompt %}<assistant> {% endif %}")  # fmt: skip
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "recorder.py").write_text(CHAT_RECORDER)
    (tmp_path / "config.yaml").write_text("rewards:\n  says_answer: {fn: recorder.py:says_answer}\n")
    rows = [{"messages": [{"role": "system", "content": "answer with a digit ."},
                          {"role": "user", "content": f"what is {a} + {b} ?"}], "answer": str(a + b)}
            for a, b in [(1, 2), (3, 4), (2, 2), (0, 5)]]  # fmt: skip
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("TRL_EXT_TEST_RECORD", str(record))
    flags = ["--reward", "says_answer", "--config", str(tmp_path / "config.yaml"), "--model", str(model),
             "--dataset", jsonl(tmp_path / "chat.jsonl", rows), "--prompt_column", "messages", "--batch_size", "4",
             "--num_generations", "2", "--max_steps", "2", "--max_completion_length", "8", "--logging_steps", "1",
             "--save_steps", "2", "--no_wandb", "--output_dir", str(tmp_path / "out")]  # fmt: skip
    assert cli.main(flags) == 0
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(calls) == 2
    by_user = {r["messages"][1]["content"]: r for r in rows}
    for c in calls:
        for prompt, completion, answer in zip(c["prompts"], c["completions"], c["answer"], strict=True):
            assert prompt == by_user[prompt[1]["content"]]["messages"]  # the row's messages, as written
            assert answer == by_user[prompt[1]["content"]]["answer"]
            assert [m["role"] for m in completion] == ["assistant"]  # TRL's conversational completion
    assert "4 rows of conversational prompts; columns passed to the rewards: answer" in capsys.readouterr().out


def test_routing_eval_takes_a_small_eval_dataset(tmp_path):
    """--eval_routing_prompts left at its default and a 3-row --eval_dataset: the routing eval takes the 3 rows and
    says so while the flags parse (an explicit count above the rows is refused: test_train_cli_errors)."""
    path = write("jsonl", tmp_path)
    (tmp_path / "held_out").mkdir()
    held_out = write("jsonl", tmp_path / "held_out")
    with pytest.warns(UserWarning, match=r"samples all 3 rows of --eval_dataset .* \(fewer than the default "
                                         r"--eval_routing_prompts 64"):
        plan = cli.build_plan([*BASE, "--dataset", path, "--eval_dataset", held_out, *EVAL_LOOP, "--lora_config", "r1",
                               "--output_dir", str(tmp_path)])  # fmt: skip
    assert plan.cfg.eval_routing_prompts == 64 and len(plan.eval_data.dataset) == 3
