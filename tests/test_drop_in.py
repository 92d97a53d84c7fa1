"""ExtGRPOTrainer / ExtGRPOConfig as drop-ins for GRPOTrainer / GRPOConfig with every extension off: args=None,
a plain GRPOConfig, TRL's defaults in the Python API, training by epochs, None rewards, a trainer built without
__init__; and the refusals that remain when an extension needs otherwise."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trl_ext import ExtGRPOConfig, ExtGRPOTrainer
from trl_ext.api import ext_config
from trl_ext.config import TRAIN_DEFAULTS
from trl_ext.runs.faults import NumericFault, check_rewards, guard_reward

TRL_FIELDS = [f.name for f in dataclasses.fields(GRPOConfig) if f.init]


def _same_fields(a, b) -> list[str]:
    return [name for name in TRL_FIELDS if getattr(a, name) != getattr(b, name)]


@pytest.fixture
def bf16_ok(monkeypatch):
    """Let TrainingArguments validate its default bf16=True without a GPU (nothing here trains)."""
    import transformers.training_args as ta

    monkeypatch.setattr(ta, "is_torch_bf16_gpu_available", lambda: True)


# ------------------------------------------------------------------------------------------------ configs
def test_python_defaults_are_trls(bf16_ok, tmp_path):
    ext, trl = ExtGRPOConfig(output_dir=str(tmp_path)), GRPOConfig(output_dir=str(tmp_path))
    assert _same_fields(ext, trl) == []
    assert (ext.max_steps, ext.loss_type, ext.bf16) == (trl.max_steps, trl.loss_type, trl.bf16) == (-1, "dapo", True)


def test_cpu_refusal_of_trls_bf16_default_is_trls(tmp_path):
    """Without a GPU, TRL's default bf16=True is refused by transformers for both configs, with the same words."""
    if torch.cuda.is_available():
        pytest.skip("a GPU supports TRL's bf16 default")
    errors = []
    for cls in (GRPOConfig, ExtGRPOConfig):
        with pytest.raises(ValueError) as e:
            cls(output_dir=str(tmp_path))
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "use_cpu" in errors[0]


def test_args_none_is_the_config_grpotrainer_builds(bf16_ok):
    cfg = ext_config(None, "org/tiny-llama")
    assert isinstance(cfg, ExtGRPOConfig) and cfg.output_dir == "tiny-llama-GRPO"
    assert _same_fields(cfg, GRPOConfig("tiny-llama-GRPO")) == []


def test_trainer_without_args_gets_the_default_config(bf16_ok):
    """ExtGRPOTrainer(model, reward_funcs, train_dataset=...) with no args: the trainer's own argument handling
    builds the config GRPOTrainer would (named after the model)."""
    from trl_ext.api import trainer_arguments

    data = Dataset.from_dict({"prompt": ["a"]})
    named = trainer_arguments(("org/my-model", [len]), {"train_dataset": data, "processing_class": object()})
    assert isinstance(named["args"], ExtGRPOConfig) and named["args"].output_dir == "my-model-GRPO"
    assert _same_fields(named["args"], GRPOConfig("my-model-GRPO")) == []


def test_a_plain_grpoconfig_is_converted_field_by_field(tmp_path):
    plain = GRPOConfig(output_dir=str(tmp_path), bf16=False, max_steps=3, learning_rate=3e-4, num_generations=4,
                       per_device_train_batch_size=8, steps_per_generation=2, report_to=[])  # fmt: skip
    ext = ext_config(plain, "builtin")
    assert type(ext) is ExtGRPOConfig and _same_fields(ext, plain) == []
    assert (ext.max_async_level, ext.gradient_routing, ext.dual_lora, ext.distill_on, ext.env) == (0, False, False,
                                                                                                   False, "")
    with pytest.raises(TypeError, match="ExtGRPOConfig, a trl.GRPOConfig or None"):
        ext_config(object(), "builtin")


def test_train_py_keeps_the_seeds_validated_defaults():
    """train.py's defaults of TRL fields are TRAIN_DEFAULTS (one place), which --help shows; the Python API's are
    TRL's."""
    from trl_ext.cli_train import parser

    run, cfg = parser().parse_args_into_dataclasses(args=["--reward", "happy_binary"])
    assert {k: getattr(cfg, k) for k in TRAIN_DEFAULTS} == TRAIN_DEFAULTS
    assert (cfg.max_steps, cfg.beta, cfg.learning_rate, cfg.loss_type) == (2000, 0.02, 1e-5, "grpo")
    cfg = parser().parse_args_into_dataclasses(args=["--reward", "happy_binary", "--max_steps", "-1",
                                                     "--num_train_epochs", "2"])[1]  # fmt: skip
    assert (cfg.max_steps, cfg.num_train_epochs) == (-1, 2)


# ------------------------------------------------------------------------------------------------ None rewards
def test_guard_passes_none_and_stops_a_computed_nan_at_its_source():
    class State:
        global_step = 6

    def maybe(completions, **kwargs):
        return [None if c == "n/a" else float(len(c)) for c in completions]

    def broken(completions, **kwargs):
        return [1.0, math.nan]

    assert guard_reward(maybe, "maybe")(completions=["ab", "n/a"]) == [2.0, None]
    with pytest.raises(NumericFault, match=r"step 7: reward function 'broken' returned nan \(not a finite number\) "
                                           r"for completion 1: 'xyz' \(return None for a completion"):
        guard_reward(broken, "broken")(completions=["ok", "xyz"], trainer_state=State())
    assert guard_reward(maybe, "maybe").__name__ == "maybe"


def test_guard_keeps_an_async_reward_async():
    import asyncio
    import inspect

    async def later(completions, **kwargs):
        return [None, math.inf]

    guarded = guard_reward(later, "later")
    assert inspect.iscoroutinefunction(guarded)
    with pytest.raises(NumericFault, match="'later' returned inf"):
        asyncio.run(guarded(completions=["a", "b"]))


def test_check_rewards_allows_nan_only_where_it_stands_for_none():
    rewards = torch.tensor([[math.nan, 1.0], [0.5, math.nan]])
    check_rewards(rewards, ["a", "b"], ["x", "y"], step=1, none_ok=[True, True])
    with pytest.raises(NumericFault, match="'b' returned nan"):  # a reward model's column: no None there
        check_rewards(rewards, ["a", "b"], ["x", "y"], step=1, none_ok=[True, False])
    with pytest.raises(NumericFault, match="'a' returned inf"):  # inf is never a None
        check_rewards(torch.tensor([[math.inf, 1.0]]), ["a", "b"], ["x"], step=1, none_ok=[True, True])


# ------------------------------------------------------------------------------------------------ end to end
PROMPTS = ["Ben was a quiet owl", "Lily felt", "Mia found a small box.", "The dog ran to the park."]


def math_reward(completions, task, **kwargs):
    """Applies to the math rows only (TRL's multi-task convention: None elsewhere)."""
    return [float(len(c) % 3 == 0) if t == "math" else None for c, t in zip(completions, task)]


def story_reward(completions, task, **kwargs):
    return [float("happy" in c) if t == "story" else None for c, t in zip(completions, task)]


def _args(tmp_path, **over):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                max_steps=2, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], bf16=False,
                use_cpu=True, disable_tqdm=True, seed=0, beta=0.0)  # fmt: skip
    return {**base, **over}


def _data(n: int = 4) -> Dataset:
    return Dataset.from_list([{"prompt": PROMPTS[i % 4], "task": "math" if i % 2 else "story"} for i in range(n)])


def test_none_rewards_and_epochs_train_as_in_trl(builtin_path, tmp_path):
    """A multi-task dataset whose two rewards each return None on the other task's rows, trained by epochs
    (max_steps=-1): GRPOTrainer, ExtGRPOTrainer with ExtGRPOConfig and with a plain GRPOConfig take the same steps
    and log the same rewards and losses (same seed and data)."""
    from trl_ext.models import load_tokenizer, prepare_tokenizer

    from tokenizers import processors

    tok = prepare_tokenizer(load_tokenizer(str(builtin_path)))
    # without its [EOS]-appending post-processor, TRL's prompt tokenization equals ours (docs/coming-from-trl.md)
    tok.backend_tokenizer.post_processor = processors.Sequence([])
    results = {}
    for trainer_cls, config_cls in ((GRPOTrainer, GRPOConfig), (ExtGRPOTrainer, ExtGRPOConfig),
                                    (ExtGRPOTrainer, GRPOConfig)):  # fmt: skip
        args = config_cls(**_args(tmp_path / f"{trainer_cls.__name__}-{config_cls.__name__}", max_steps=-1,
                                  num_train_epochs=2))  # fmt: skip
        trainer = trainer_cls(model=str(builtin_path), reward_funcs=[math_reward, story_reward], args=args,
                              train_dataset=_data(8), processing_class=tok)  # fmt: skip
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert trainer.state.global_step == 8 and len(logs) == 8  # 2 epochs x 8 prompts x 4 generations / 8 a step
        results[(trainer_cls.__name__, config_cls.__name__)] = [
            (h["rewards/math_reward/mean"], h["rewards/story_reward/mean"], h["loss"]) for h in logs]
    first, *others = results.values()
    assert all(math.isfinite(loss) for *_, loss in first)
    # a step whose prompts are all of one task logs the other reward's mean as None (nanmean of nothing), as TRL does
    math_means, story_means = [r[0] for r in first if r[0] is not None], [r[1] for r in first if r[1] is not None]
    assert math_means and story_means and len(math_means + story_means) >= 8
    for other in others:
        assert [tuple(v is None for v in row) for row in other] == [tuple(v is None for v in row) for row in first]
        assert [v for row in other for v in row if v is not None] == pytest.approx(
            [v for row in first for v in row if v is not None], abs=1e-5)


def test_a_feature_that_needs_every_reward_refuses_a_none(builtin_path, tmp_path):
    from trl_ext.models import load_tokenizer, prepare_tokenizer

    tok = prepare_tokenizer(load_tokenizer(str(builtin_path)))
    args = ExtGRPOConfig(**_args(tmp_path, teacher_tau=0.5, student_tau=0.5, teacher_context="A happy story.",
                                 beta=0.02, loss_type="grpo"))  # fmt: skip
    trainer = ExtGRPOTrainer(model=str(builtin_path), reward_funcs=[math_reward, story_reward], args=args,
                             train_dataset=_data(8), processing_class=tok)  # fmt: skip
    with pytest.raises(NumericFault, match=r"returned None for completion \d+ .*distillation's task reward need\(s\) "
                                           r"a reward for every completion"):
        trainer.train()


def test_a_trainer_built_without_init_reaches_trls_generate(monkeypatch):
    """Mocks (and some of TRL's tests) build a trainer with __new__: _generate goes straight to TRL's."""
    trainer = ExtGRPOTrainer.__new__(ExtGRPOTrainer)
    monkeypatch.setattr(GRPOTrainer, "_generate", lambda self, prompts: ("trl", list(prompts)))
    assert trainer._generate(["a prompt"]) == ("trl", ["a prompt"])


def test_train_py_trains_by_epochs_only_when_asked(train_cli_error, tmp_path):
    """--num_train_epochs under train.py's max_steps 2000 would be ignored (exit 2); with --max_steps -1 the run is
    named by its epochs."""
    from trl_ext.cli_train import build_plan

    err = train_cli_error("--reward", "happy_binary", "--num_train_epochs", "2")
    assert "--num_train_epochs 2 would be ignored: --max_steps 2000 decides the length" in err
    plan = build_plan(["--reward", "happy_binary", "--max_steps", "-1", "--num_train_epochs", "2",
                       "--output_dir", str(tmp_path)])  # fmt: skip
    assert plan.run_dir.name == "happy_binary_builtin_lr1e-5_b0.02_bs32_ng16_full_ep2_s42"


def test_offpolicy_trains_by_epochs(builtin_path, tmp_path):
    """The off-policy generator's prompt stream runs past the last epoch; the trainer stops where TRL's epochs end."""
    from trl_ext.models import load_tokenizer, prepare_tokenizer

    tok = prepare_tokenizer(load_tokenizer(str(builtin_path)))
    args = ExtGRPOConfig(**_args(tmp_path, max_steps=-1, num_train_epochs=1, max_async_level=1, loss_type="grpo"))
    trainer = ExtGRPOTrainer(model=str(builtin_path), reward_funcs=[story_reward], args=args,
                             train_dataset=Dataset.from_list([{"prompt": p, "task": "story"} for p in PROMPTS * 2]),
                             processing_class=tok)  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 4  # 8 prompts x 4 generations / 8 per step
    trace = trainer.components.offpolicy.trace  # (step, oldest, newest policy version) of each batch trained
    assert len(trace) == 4 and all(newest <= step and step - oldest <= 1 for step, oldest, newest in trace)


def test_a_config_yaml_reward_passes_none_through():
    """train.py's reward bindings (rewards.bound.TrlReward) keep a None for TRL, not a NaN the guard would stop."""
    from rewards.bound import TrlReward

    guarded = guard_reward(TrlReward("maybe", lambda texts: [None if t == "n/a" else 1.0 for t in texts]), "maybe")
    assert guarded(completions=["n/a", "ok"]) == [None, 1.0]


def test_guard_records_for_the_trainer_and_sees_an_async_partial():
    import asyncio
    import functools
    import inspect

    faults = []
    out = guard_reward(lambda completions, **kw: [math.nan, 1.0, None], "r", faults)(completions=["a", "b", "c"])
    assert out == [math.inf, 1.0, None] and len(faults) == 1 and "'r' returned nan" in faults[0]

    class Scorer:
        async def __call__(self, completions, scale, **kwargs):
            return [scale * len(c) for c in completions]

    guarded = guard_reward(functools.partial(Scorer(), scale=2.0), "scorer")
    assert inspect.iscoroutinefunction(guarded)
    assert asyncio.run(guarded(completions=["ab"])) == [4.0]


def test_every_process_raises_a_reward_fault_at_the_same_step():
    """The rewards are gathered: a None or a non-finite value on another process's rows stops this process too."""
    from types import SimpleNamespace

    def trainer(refusal):
        return SimpleNamespace(_reward_faults=[], reward_funcs=[math_reward, story_reward],
                               reward_func_names=["math_reward", "story_reward"],
                               none_reward_refusal=lambda: refusal)  # fmt: skip

    check = ExtGRPOTrainer.check_reward_faults
    gathered = torch.tensor([[1.0, 0.0], [1.0, 0.0], [math.nan, 1.0], [0.0, 1.0]])  # rows 2-3: the other process
    check(trainer(None), gathered, gathered[:2], ["x", "y"], 3)  # None rewards, no feature needing them: fine
    with pytest.raises(NumericFault, match="step 3: a reward function returned None on another process: routing"):
        check(trainer("routing needs them"), gathered, gathered[:2], ["x", "y"], 3)
    with pytest.raises(NumericFault, match="step 3: a reward function returned a non-finite value on another"):
        gathered[3, 1] = math.inf
        check(trainer(None), gathered, gathered[:2], ["x", "y"], 3)
    recorded = trainer(None)  # a computed NaN the base reward then replaced: the guard's record still stops the run
    recorded._reward_faults.append("step 3: reward function 'math_reward' returned nan")
    with pytest.raises(NumericFault, match="'math_reward' returned nan"):
        check(recorded, torch.ones(4, 2), torch.ones(2, 2), ["x", "y"], 3)


def test_train_py_bounds_and_flags():
    from trl_ext.cli_train import build_plan, parser

    namespace, _ = parser().parse_known_args(["--reward", "happy_binary", "--bf16"])  # TRL's bool | None field
    assert namespace.bf16 is True
    for bad in ("0", "-5"):
        with pytest.raises(Exception, match="--max_steps must be >= 1, or -1"):
            build_plan(["--reward", "happy_binary", "--max_steps", bad])


def test_a_converted_config_does_not_share_the_callers_lists(tmp_path):
    plain = GRPOConfig(output_dir=str(tmp_path), bf16=False, report_to=[])
    ext = ext_config(plain, "builtin")
    ext.report_to.append("wandb")
    assert plain.report_to == []


def test_the_saved_reward_of_a_sample_every_function_skipped_is_nan():
    from trl_ext.runs.rollouts import weighted_reward

    rewards = torch.tensor([[1.0, math.nan], [math.nan, math.nan], [0.5, 2.0]])
    out = weighted_reward(rewards, torch.tensor([2.0, 1.0]))
    assert out[0].item() == 2.0 and math.isnan(out[1].item()) and out[2].item() == 3.0
