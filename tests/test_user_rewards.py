"""A researcher's own rewards in config.yaml: import paths, TRL-signature functions with dataset columns, reward
models, the accuracy rewards, and every error at parse time (train.py exit 2 before any model loads)."""

import json
import math
import os
import re
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import zygote

from rewards import load_reward_config
from rewards.bound import RewardInputError, on_prompts, score, trl_context
from rewards.config import as_trl_reward, trl_reward_args
from rewards.signature import reward_signature
from trl_ext.registry import ConfigError

ROOT = Path(__file__).resolve().parents[1]

USER_MODULE = '''
CALLS = []


def accuracy(prompts, completions, answer, **kwargs):
    """TRL signature: reads the dataset column `answer`."""
    CALLS.append({"prompts": prompts, "completions": completions, "answer": answer, **kwargs})
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def length_bonus(completions, *, per_word):
    """The project's signature: texts and a bound param."""
    if per_word < 0:
        raise ValueError(f"per_word must be >= 0, got {per_word}")
    CALLS.append({"texts": completions})
    return [per_word * len(c.split()) for c in completions]


def scaled(completions, trainer_state, *, scale=1.0, **kwargs):
    """TRL signature with a bound param and the trainer state, no dataset column."""
    return [scale * trainer_state.global_step for _ in completions]


def long_text(completions, *, max_words):
    return [len(c.split()) > max_words for c in completions]


NOT_CALLABLE = 3
'''


def user_setup(tmp_path: Path, body: str, module: str = USER_MODULE) -> tuple[Path, str]:
    """A user module (named after the test, so that every test imports its own) and a config next to it."""
    name = f"user_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(module)
    path = tmp_path / "rewards.yaml"
    path.write_text(textwrap.dedent(body).replace("MOD", name))
    return path, name


BODY = """
    rewards:
      acc: {fn: "MOD:accuracy", rh_detector: long}
      bonus: {fn: "MOD:length_bonus", params: {per_word: 0.5}}
      from_file: {fn: "MOD.py:length_bonus", params: {per_word: 2}}
      step: {fn: "MOD:scaled", params: {scale: 3.0}}
      mix:
        fn: combined
        params: {components: [{reward: acc, weight: 2.0}, {reward: bonus, weight: 1.0, cap: 1.0}]}
      hb: {fn: happy_binary}
    detectors:
      long: {fn: "MOD:long_text", params: {max_words: 2}}
"""


# ---------------------------------------------------------------------------------------------- signatures
def test_signature_styles():
    def texts(completions, *, target): ...
    def trl(prompts, completions, answer, hint=None, **kwargs): ...
    def named_state(completions, *, trainer_state): ...
    def positional_only(completions, x, /, **kwargs): ...
    def no_completions(prompts): ...

    s = reward_signature(texts)
    assert (s.style, s.params, s.required) == ("texts", ("target",), ("target",))
    s = reward_signature(trl)
    assert (s.style, s.params, s.required, s.trl_args, s.var_kwargs) == (
        "trl", ("answer", "hint"), ("answer",), ("prompts", "completions"), True)
    assert s.columns({}) == (("answer",), ("hint",)) and s.columns({"answer": 1}) == ((), ("hint",))
    assert reward_signature(named_state).style == "trl"  # a TRL argument by name: TRL style
    with pytest.raises(TypeError, match="positional-only parameters"):
        reward_signature(positional_only)
    with pytest.raises(TypeError, match="takes no 'completions'"):
        reward_signature(no_completions)


# ---------------------------------------------------------------------------------------------- loading
def test_user_module_loads_and_gets_the_right_arguments(tmp_path):
    path, name = user_setup(tmp_path, BODY)
    cfg = load_reward_config(path)
    mod = sys.modules[name]
    assert {n: cfg.reward(n).kind for n in cfg.reward_names()} == {
        "acc": "trl", "bonus": "texts", "from_file": "texts", "step": "trl", "mix": "combined", "hb": "texts"}
    assert cfg.default_detector("acc") == "long"
    assert cfg.detector("long")(["a b c", "a"]) == [True, False]
    assert cfg.reward("from_file")(["a b c"]) == [6.0]  # the file form, relative to the config's directory

    state = SimpleNamespace(global_step=7)
    trl_kwargs = {"prompts": ["p1", "p2"], "completions": ["4", "five words"], "completion_ids": [[1], [2, 3]],
                  "answer": ["4", "5"], "level": [1, 2], "trainer_state": state}  # as GRPOTrainer calls it
    mod.CALLS.clear()
    assert as_trl_reward("acc", cfg.reward("acc"))(**trl_kwargs) == [1.0, 0.0]
    (call,) = mod.CALLS
    assert call == {**trl_kwargs}  # every TRL argument and dataset column, through **kwargs
    mod.CALLS.clear()
    assert as_trl_reward("bonus", cfg.reward("bonus"))(**trl_kwargs) == [0.5, 1.0]
    assert mod.CALLS == [{"texts": ["4", "five words"]}]  # the project's signature: the texts alone
    assert as_trl_reward("step", cfg.reward("step"))(**trl_kwargs) == [21.0, 21.0]  # scale 3 * step 7
    # combined: 2 * acc + min(bonus, 1); each term gets the TRL arguments it takes
    assert as_trl_reward("mix", cfg.reward("mix"))(**trl_kwargs) == [2.5, 1.0]
    # conversational completions: the project-style term reads the last message's content
    chat = [[{"role": "assistant", "content": "a b c d"}]]
    assert cfg.reward("bonus")(chat) == [2.0]


def test_missing_column_fails_loudly(tmp_path):
    path, _ = user_setup(tmp_path, BODY)
    cfg = load_reward_config(path)
    with pytest.raises(RewardInputError, match=r"reward 'acc' needs the dataset column\(s\) answer, which the data "
                                               r"does not have \(columns: level\)"):
        cfg.reward("acc")(["4"], prompts=["p"], completion_ids=[[1]], level=[1], trainer_state=None)
    with pytest.raises(RewardInputError, match=r"reward 'acc' needs prompts"):
        cfg.reward("acc")(["4"], answer=["4"])
    with pytest.raises(RewardInputError, match="needs the dataset column"):  # through combined too
        cfg.reward("mix")(["4"], prompts=["p"])
    with pytest.raises(ConfigError, match=r"reward binding 'mix' needs the dataset column\(s\) answer, which my data "
                                          r"does not have \(columns: level\)$"):
        cfg.check_columns(["hb", "mix"], ["level"], "my data")
    cfg.check_columns(["hb", "acc", "mix"], ["answer", "level"], "my data")
    with pytest.raises(ConfigError, match=r"reward binding 'step': the dataset column\(s\) scale of my data would "
                                          "override params bound in config.yaml"):
        cfg.check_columns(["step"], ["scale"], "my data")
    with pytest.raises(RewardInputError, match="would override the params bound"):
        cfg.reward("step")(["x"], scale=[1.0], trainer_state=SimpleNamespace(global_step=1))


def test_eval_scoring_helpers(tmp_path):
    """The trainer's eval rewards (`score` with the batch's TRL arguments) and eval_run / the routing eval
    (`on_prompts`: completions sampled one per prompt)."""
    path, _ = user_setup(tmp_path, BODY)
    cfg = load_reward_config(path)
    inputs = [{"prompt": "p1", "answer": "4"}, {"prompt": "p2", "answer": "5"}]
    ctx = trl_context(inputs, ["p1", "p2"], ["4", "6"], [[1], [2]], SimpleNamespace(global_step=2))
    assert set(ctx) == {"answer", "trainer_state", "prompts", "completions", "completion_ids"}
    assert score(cfg.reward("acc"), ["4", "6"], ctx) == [1.0, 0.0]
    assert score(cfg.reward("hb"), ["happy", "sad"], ctx) == [1.0, 0.0]
    assert score(cfg.reward("hb"), ["happy"], None) == [1.0]  # texts alone need no context
    with pytest.raises(RewardInputError, match="no reward context"):
        score(cfg.reward("acc"), ["4"], None)
    assert on_prompts(cfg.reward("hb"), ["p"]) is cfg.reward("hb")  # texts alone: the binding itself
    step = on_prompts(cfg.reward("step"), ["p1", "p2", "p3"])
    with pytest.raises(RewardInputError, match="needs trainer_state"):  # eval_run has no trainer state
        step(["a", "b"])


@pytest.mark.parametrize(
    "body, message",
    [
        ('rewards:\n  r: {fn: "no_such_module_xyz:f"}\n',
         r"reward binding 'r': module 'no_such_module_xyz' does not import: ModuleNotFoundError: No module named "
         r"'no_such_module_xyz' \(searched sys.path with .*\)$"),
        ('rewards:\n  r: {fn: "MOD:nope"}\n', r"reward binding 'r': fn 'MOD:nope': module 'MOD' \(.*MOD.py\) has "
                                              r"no attribute 'nope'$"),
        ('rewards:\n  r: {fn: "MOD:NOT_CALLABLE"}\n', r"'NOT_CALLABLE' is a int, not a callable$"),
        ('rewards:\n  r: {fn: "MOD:length_bonus", params: {per_wrd: 1}}\n',
         r"unknown param 'per_wrd' for reward function 'MOD:length_bonus'; allowed: per_word$"),
        ('rewards:\n  r: {fn: "MOD:length_bonus"}\n', r"missing required param 'per_word'"),
        ('rewards:\n  r: {fn: "MOD:length_bonus", params: {per_word: -1}}\n', r"'r': per_word must be >= 0, got -1$"),
        ('rewards:\n  r: {fn: "MOD:accuracy", params: {prompts: [a]}}\n',
         r"unknown param 'prompts' for reward function 'MOD:accuracy'; allowed: answer$"),
        ('rewards:\n  r: {fn: "missing.py:f"}\n', r"module file 'missing.py' does not exist \(looked for .*\)$"),
        ('rewards:\n  r: {fn: ":f"}\n', r"fn ':f' must be 'module:attr' or 'path/to/file.py:attr'$"),
        ('rewards:\n  r: {fn: happy_binary}\ndetectors:\n  d: {fn: "MOD:accuracy"}\n',
         r"detector binding 'd': detector 'MOD:accuracy' cannot be a detector: .*must have the signature"),
        ('rewards:\n  r: {fn: happy_binary}\ndetectors:\n  d: {fn: "MOD:long_text", params: {max_words: x}}\n',
         r"detector binding 'd': calling it on 2 probe texts raised TypeError"),
    ],
)
def test_bad_user_binding(tmp_path, body, message):
    path, name = user_setup(tmp_path, body)
    with pytest.raises(ConfigError, match=message.replace("MOD", name)) as err:
        load_reward_config(path)
    assert "\n" not in str(err.value)


def test_broken_module_names_the_import_error(tmp_path):
    path, name = user_setup(tmp_path, 'rewards:\n  r: {fn: "MOD:f"}\n', module="import no_such_dependency_xyz\n")
    with pytest.raises(ConfigError, match=rf"module '{name}' does not import: ModuleNotFoundError: No module named "
                                          "'no_such_dependency_xyz'"):
        load_reward_config(path)


def test_user_errors_exit_2_through_train_py(train_cli_error, tmp_path):
    cases = {
        "unimportable": ('rewards:\n  r: {fn: "no_such_module_xyz:f"}\n',
                         "module 'no_such_module_xyz' does not import"),
        "missing_attr": ('rewards:\n  r: {fn: "MOD:nope"}\n', "has no attribute 'nope'"),
        "not_callable": ('rewards:\n  r: {fn: "MOD:NOT_CALLABLE"}\n', "not a callable"),
        "bad_params": ('rewards:\n  r: {fn: "MOD:length_bonus", params: {per_wrd: 1}}\n', "unknown param 'per_wrd'"),
        "bad_value": ('rewards:\n  r: {fn: "MOD:length_bonus", params: {per_word: -1}}\n', "per_word must be >= 0"),
        # the story prompts have no `answer` column: known at parse time
        "no_column": ('rewards:\n  r: {fn: "MOD:accuracy"}\n',
                      "reward binding 'r' needs the dataset column(s) answer, which the story prompts do"),
        "no_column_eval": ('rewards:\n  r: {fn: happy_binary}\n  e: {fn: exact_match}\n', "'e' needs the dataset"),
        "no_column_base": ('rewards:\n  r: {fn: happy_binary}\n  b: {fn: exact_match}\n', "'b' needs the dataset"),
        "baseline_texts_only": ('rewards:\n  r: {fn: "MOD:scaled"}\n', "--eval_baseline scores completion texts alone"),
    }
    extra = {"no_column_eval": ["--eval_rewards", "e"], "no_column_base": ["--base_reward", "b", "--hack_frac", "0.5"],
             "baseline_texts_only": ["--eval_baseline", "--teacher_context", "Be happy."]}
    for case, (body, message) in cases.items():
        (tmp_path / case).mkdir()
        path, name = user_setup(tmp_path / case, body)
        argv = ["--reward", "r", *extra.get(case, []), "--config", str(path), "--output_dir", str(tmp_path / "out")]
        err = train_cli_error(*argv)
        assert message.replace("MOD", name) in err, (case, err)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- reward models
def build_reward_model(out_dir: Path) -> Path:
    """A tiny random llama sequence classifier with one score and the builtin tokenizer (trl_ext.models.tiny's
    config, num_labels 1), built offline."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from trl_ext.models import load_tokenizer
    from trl_ext.models.tiny import tiny_config, tokenizer_source

    tok = load_tokenizer(tokenizer_source("builtin"))
    config = tiny_config("llama", len(tok), tok.eos_token_id)
    config.num_labels = 1
    config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def reward_model(builtin_path, tmp_path_factory) -> Path:
    return build_reward_model(tmp_path_factory.mktemp("rm") / "tiny_rm")


def test_reward_model_binding(reward_model, tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification

    path = tmp_path / "rewards.yaml"
    rel = os.path.relpath(reward_model, tmp_path)
    path.write_text(f"rewards:\n  rm: {{model: {rel}}}\n  hb: {{fn: happy_binary}}\n")
    cfg = load_reward_config(path)  # relative to the config's directory; no weights loaded here
    rm = cfg.reward("rm")
    assert rm.kind == "model" and rm.model.path == reward_model and rm.model._loaded is None
    args = trl_reward_args("rm", rm)
    assert args["reward_funcs"] == [str(reward_model)] and args["reward_names"] == ["rm"]
    assert args["reward_processing_classes"][0].pad_token_id is not None
    cfg.check_columns(["rm"], (), "the story prompts")  # prompts are all it reads
    # TRL's computation: logits[:, 0] of prompt + completion, right padding; one at a time = batched
    prompts, completions = ["Once upon a time", "The dog"], [" there was a cat.", " ran home to the big house"]
    values = rm(completions, prompts=prompts)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model, num_labels=1)
    tok = args["reward_processing_classes"][0]
    for p, c, v in zip(prompts, completions, values):
        enc = tok(text=[p + c], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            assert model(**enc).logits[0, 0].item() == pytest.approx(v, abs=1e-5)
    assert on_prompts(rm, prompts)(completions[:1]) == pytest.approx(values[:1], abs=1e-5)
    with pytest.raises(RewardInputError, match="passed no prompts"):
        rm(completions)


def test_bad_reward_model(reward_model, tmp_path):
    def load(body: str):
        (tmp_path / "rewards.yaml").write_text(body)
        return load_reward_config(tmp_path / "rewards.yaml")

    with pytest.raises(ConfigError, match=r"reward binding 'rm': reward model 'nope' is not a directory"):
        load("rewards:\n  rm: {model: nope}\n")
    causal = tmp_path / "causal"
    causal.mkdir()
    (causal / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"architectures \['LlamaForCausalLM'\] name no \*ForSequenceClassification"):
        load(f"rewards:\n  rm: {{model: {causal}}}\n")
    two = tmp_path / "two"
    two.mkdir()
    (two / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                 "id2label": {"0": "a", "1": "b"}}))
    with pytest.raises(ConfigError, match="has 2 labels; a reward model has a single score"):
        load(f"rewards:\n  rm: {{model: {two}}}\n")
    with pytest.raises(ConfigError, match=r"unknown key 'params' for a reward model binding; allowed: model, "):
        load(f"rewards:\n  rm: {{model: {reward_model}, params: {{a: 1}}}}\n")
    mix = "    fn: combined\n    params: {components: [{reward: rm, weight: 1.0}]}\n"
    with pytest.raises(ConfigError, match="a reward model cannot be a combined component"):
        load(f"rewards:\n  rm: {{model: {reward_model}}}\n  mix:\n{mix}")


@pytest.mark.slow
def test_train_with_reward_model_on_builtin(reward_model, tmp_path):
    """train.py, 2 steps on the builtin model, the tiny reward model as --reward (TRL loads and scores it) and as an
    --eval_rewards entry (scored by the project with the batch's prompts); TRL logs rewards/rm/mean."""
    config = tmp_path / "rewards.yaml"
    config.write_text(f"rewards:\n  rm: {{model: {reward_model}}}\n  rm_eval: {{model: {reward_model}}}\n")
    flags = [
        "--reward", "rm", "--eval_rewards", "rm_eval", "--config", str(config), "--model", "builtin",
        "--max_steps", "2", "--batch_size", "4", "--num_generations", "2", "--max_completion_length", "8",
        "--logging_steps", "1", "--save_steps", "2", "--no_wandb", "--output_dir", str(tmp_path / "out"),
    ]  # fmt: skip
    proc = zygote.run([sys.executable, "train.py", *flags], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "out").iterdir()
    state = json.loads((run_dir / "checkpoint-2" / "trainer_state.json").read_text())
    logged = [h for h in state["log_history"] if "reward" in h]
    assert [h["step"] for h in logged] == [1, 2]
    for h in logged:  # one reward function: the reward is its mean; the same model scores the eval reward
        assert math.isfinite(h["rewards/rm/mean"]) and h["reward"] == pytest.approx(h["rewards/rm/mean"], abs=1e-5)
        assert h["eval_rewards/rm_eval"] == pytest.approx(h["rewards/rm/mean"], abs=1e-4)
    assert re.search(r"'rewards/rm/mean': '?-?\d", (run_dir / "train.log").read_text())
    # eval_run.py scores the run's reward model on its held-out samples, each with its prompt
    argv = ["--model_path", str(run_dir / "checkpoint-2"), "--n_samples", "4", "--n_print", "4"]
    proc = zygote.run([sys.executable, "eval_run.py", *argv], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "eval_checkpoint-2.json").read_text())
    per_sample = [smp["rewards"]["rm"] for smp in report["samples"]]
    assert report["scores"]["reward/rm"] == pytest.approx(sum(per_sample) / 4, abs=1e-5)
    from rewards.reward_model import check_reward_model

    direct = check_reward_model(str(reward_model), tmp_path).score([smp["prompt"] for smp in report["samples"]],
                                                                   [smp["completion"] for smp in report["samples"]])
    assert per_sample == pytest.approx(direct, abs=1e-5)


ALIGNED_MODULE = '''
def answer_matches_prompt(prompts, completions, answer, key, **kwargs):
    """1.0 when the `answer` column TRL passed belongs to the prompt at the same index (the `key` column)."""
    return [1.0 if a.startswith(f"answer-{k}") and p == k else 0.0 for p, a, k in zip(prompts, answer, key)]


def answer_length(completions, answer, **kwargs):
    return [float(len(a)) for a in answer]
'''


@pytest.mark.slow
def test_trainer_passes_dataset_columns(builtin_path, tmp_path):
    """ExtGRPOTrainer on a tiny random llama, a dataset with extra columns: the training reward (TRL) and the eval
    rewards (the project) both get every column, aligned with the prompts."""
    import datasets

    from environments.stories import load_prompts
    from trl_ext.config import train_config
    from trl_ext.models import load_tokenizer, prepare_tokenizer
    from trl_ext.models.tiny import build_tiny
    from trl_ext.trainer import ExtGRPOTrainer

    model_dir = build_tiny("llama", tmp_path / "tiny")
    tok = prepare_tokenizer(load_tokenizer(str(model_dir)))
    prompts = list(load_prompts("builtin", tok, 4, "train", 8, 0)["prompt"])
    answers = [f"answer-{p}" + "x" * i for i, p in enumerate(prompts)]  # lengths differ by row
    data = datasets.Dataset.from_dict({"prompt": prompts, "answer": answers, "key": prompts})
    body = """
        rewards:
          aligned: {fn: "MOD:answer_matches_prompt"}
          alen: {fn: "MOD:answer_length"}
          em: {fn: exact_match}
    """
    path, _ = user_setup(tmp_path, body, module=ALIGNED_MODULE)
    cfg = load_reward_config(path)
    cfg.check_columns(["aligned", "alen", "em"], ["answer", "key"], "the test data")
    args = train_config(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
                        max_completion_length=4, max_steps=2, logging_steps=1, save_strategy="no", report_to=[],
                        use_cpu=True, disable_tqdm=True, seed=0, beta=0.0)  # fmt: skip
    trainer = ExtGRPOTrainer(model=str(model_dir), args=args, train_dataset=data, processing_class=tok,
                             **trl_reward_args("aligned", cfg.reward("aligned")),
                             eval_reward_funcs={"alen": cfg.reward("alen"), "em": cfg.reward("em"),
                                                "aligned": cfg.reward("aligned")})  # fmt: skip
    trainer.train()
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logged) == 2
    lengths = {len(a) for a in answers}
    for h in logged:
        assert h["rewards/aligned/mean"] == 1.0  # every row's answer reached the reward with its own prompt
        assert h["eval_rewards/aligned"] == 1.0  # the eval rewards too
        assert h["eval_rewards/em"] == 0.0  # random completions never say "answer-..."
        # the mean answer length of the batch's 2 prompts x 2 generations: a mean of two lengths of the data
        assert any(h["eval_rewards/alen"] == pytest.approx((a + b) / 2) for a in lengths for b in lengths)
