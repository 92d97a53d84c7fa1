"""Environment training plumbing: flags, the estimator override, the multi-turn rollout and its loss mask."""

from types import SimpleNamespace

import pytest
import torch
from reference import word_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

import trl_ext.cli_train as cli
from environments.base import make_env
from trl_ext.batch import BatchContext
from trl_ext.config import train_config
from trl_ext.env.component import env_rollout
from trl_ext.env.episodes import chat_env_text, cut_after_answer, env_dataset, env_reward

WORDS = ("[UNK] [EOS] < > / answer think jump left right up down reward : - 1 0 . done false true invalid "
         "p _ o g x * junk").split()  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer(" ".join(WORDS))


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# --- flags -----------------------------------------------------------------------------------------


@pytest.fixture
def no_training(monkeypatch):
    monkeypatch.setattr(cli, "run_training", lambda plan: pytest.fail("validation should have failed first"))


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--env", "nope"], "two_armed_bandit"),
        (["--env", "sokoban", "--max_turns", "0"], "max_turns"),
        (["--env", "arithmetic", "--adv_estimator", "ppo"], "brpo"),
        (["--env", "two_armed_bandit", "--mode", "sft"], "no solver (BFS or scripted)"),
        (["--env", "arithmetic", "--model", "builtin"], "builtin_env"),
        (["--env", "arithmetic", "--reward", "happy_binary"], "exclude"),
        (["--reward", "happy_binary", "--no_think_rl"], "--no_think_rl needs --env"),
        (["--env", "arithmetic", "--model", "builtin_mood"], "builtin_env"),
        (["--env", "frozenlake", "--model", "builtin_search"], "use it with --env search"),
        (["--env", "search,arithmetic", "--model", "builtin_search"], "use it with --env search"),
        (["--reward", "happy_binary", "--model", "builtin_search"], "an environments' model"),
        (["--env", "frozenlake", "--max_async_level", "1", "--no_think_rl"], "no behaviour log-probs"),
        (["--reward", "happy_binary", "--env_params", "size=5"], "--env_params needs --env"),
        (["--env", "frozenlake", "--env_params", "sizes=5"], "accepted: ['size', 'p_frozen', 'slippery'"),
        (["--env", "frozenlake", "--env_params", "size=1"], "size >= 2"),
        (["--env", "frozenlake", "--env_params", "size"], "key=value"),
        (["--env", "frozenlake", "--env_params", "size=5,size=6"], "given twice"),
        (["--env", "prisoners_dilemma", "--env_params", "opponent=nice"], "tit_for_tat"),
        (["--env", "frozenlake", "--env_params", "strict=2"], "strict must be true or false"),
    ],
)
def test_bad_env_flags_exit_2(capsys, no_training, argv, needle):
    if "--model" not in argv:
        argv = [*argv, "--model", "builtin_env"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("train.py: error: ") and err.count("\n") == 0 and needle in err


def test_env_params_reach_every_environment_built():
    cfg = cli.parser().parse_args_into_dataclasses(
        args=["--env", "frozenlake", "--env_params", "slippery=true, size=6,p_frozen=0.9"])[1]  # fmt: skip
    env = cfg.build_env()
    assert (env.slippery, env.size, env.p_frozen) == (True, 6, 0.9)
    assert env.reset(3).count("\n") == 6 - 1  # a 6x6 map
    assert "env_paramssize-6" in cli.build_plan(["--env", "frozenlake", "--env_params", "size=6", "--model", "builtin_env"]).cfg.run_name
    opp = train_config(output_dir="o", env="prisoners_dilemma", env_params="opponent=always_defect").build_env()
    assert opp.opponent_name == "always_defect"


def test_n_rollout_is_num_generations():
    cfg = cli.parser().parse_args_into_dataclasses(args=["--env", "frozenlake", "--n_rollout", "8"])[1]
    assert cfg.num_generations == 8 and cfg.turns == 5  # frozenlake's own max_turns
    assert train_config(output_dir="o", env="sokoban", max_turns=2).turns == 2


# --- rollout pieces ------------------------------------------------------------------------------


def test_cut_after_answer(tok):
    full = ids(tok, "< think > up < / think > < answer > up < / answer > junk junk")
    cut, closed = cut_after_answer(full, tok)
    assert closed and cut == full[:-2]
    assert cut_after_answer(ids(tok, "< answer > up junk"), tok) == (ids(tok, "< answer > up junk"), False)


def test_env_dataset_and_reward(tok):
    ds = env_dataset(make_env("frozenlake"), 3, tok, start=10)
    obs = make_env("frozenlake").reset(11)
    assert ds["env_seed"] == [10, 11, 12] and ds["prompt"][1] == obs + "\n<think>"
    strict = env_dataset(make_env("frozenlake", strict=True), 3, tok, start=10)
    assert strict["prompt"][1] == obs + "\n"
    assert env_reward(["a", "b"], env_return=[1, -0.5]) == [1.0, -0.5]


def test_chat_env_text():
    t = SimpleNamespace(apply_chat_template=lambda msgs, tokenize, add_generation_prompt: "".join(
        f"<{m['role']}>{m['content']}</s>" for m in msgs) + ("<assistant>" if add_generation_prompt else ""))
    msgs = [{"role": "user", "content": "obs"}]
    assert chat_env_text(t, msgs, "<answer>up</answer>", "reward: 0") == "</s><user>reward: 0</s><assistant>"


# --- multi-turn batch through TRL: env tokens get no gradient -----------------------------------


def make_trainer(tok, tmp_path, **overrides):
    from trl_ext.trainer import ExtGRPOTrainer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, eos_token_id=1, pad_token_id=1, bos_token_id=None))
    args = dict(output_dir=str(tmp_path), env="frozenlake", max_turns=2, per_device_train_batch_size=2,
                num_generations=2, max_completion_length=12, beta=0.0, report_to=[], use_cpu=True,
                save_strategy="no", disable_tqdm=True, max_steps=1)  # fmt: skip
    args.update(overrides)
    cfg = train_config(**args)
    return ExtGRPOTrainer(model=model, reward_funcs=[env_reward], args=cfg,
                          train_dataset=env_dataset(make_env("frozenlake"), 2, tok), processing_class=tok)  # fmt: skip


def test_multi_turn_rollout_masks_env_tokens_out_of_the_loss(tok, tmp_path):
    trainer = make_trainer(tok, tmp_path)
    agent = "< answer > jump < / answer >"  # invalid on every turn: -1 each (shown 0), state unchanged
    trainer._generate_single_turn = lambda prompt_ids, *a: ([ids(tok, agent + " junk")] * len(prompt_ids), None)
    rows = [{"prompt": p, "env_seed": 0} for p in list(env_dataset(make_env("frozenlake"), 1, tok)["prompt"]) * 2]
    obs = make_env("frozenlake").reset(0)
    env_text = "\ninvalid answer\nreward: 0\ndone: false\n" + obs + "\n<think>"
    a, e = ids(tok, agent), ids(tok, env_text)
    out = env_rollout([r["prompt"] for r in rows], SimpleNamespace(
        args=trainer.args, processing_class=tok, batch_context=BatchContext(rows, "train"),
        episode_source=trainer.episode_source,
        _generate_single_turn=trainer._generate_single_turn,
        _metrics=trainer._metrics, model=trainer.model, accelerator=trainer.accelerator))  # fmt: skip
    # turn 1 (agent, env reply), turn 2 (agent; max_turns reached: no reply), closing EOS (not trained)
    assert out["completion_ids"][0] == a + e + a + [1]
    assert out["env_mask"][0] == [1] * len(a) + [0] * len(e) + [1] * len(a) + [0]
    assert out["env_return"] == [-2.0, -2.0]  # two invalid answers at -1 each
    assert out["prompt_ids"][0] == ids(tok, obs + "\n<think>")

    # the same batch through TRL's scoring, then the gradient of the loss at each completion position
    model = trainer.model
    model.train()
    batch = trainer._generate_and_score_completions(rows)
    assert batch["tool_mask"][0].tolist() == out["env_mask"][0]
    assert batch["advantages"].tolist() == [0.0, 0.0]  # equal returns: zero advantage; make it nonzero
    batch["advantages"] = torch.tensor([1.0, -1.0])
    captured = {}

    def hook(module, inputs, output):
        output.retain_grad()
        captured["hidden"] = output

    handle = model.model.norm.register_forward_hook(hook)  # TRL fuses lm_head + log-softmax
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.training_step otherwise
    trainer.compute_loss(model, batch).backward()
    handle.remove()
    # The final norm's output at a position feeds only that position's next-token prediction: its gradient is
    # zero exactly where the predicted token is out of the loss. Rows -C-1 .. -2 predict the C completion tokens.
    grad = captured["hidden"].grad
    n = batch["completion_ids"].shape[1]
    rows_grad = grad[0, grad.shape[1] - 1 - n : grad.shape[1] - 1].abs().sum(-1)
    mask = torch.tensor(out["env_mask"][0] + [0] * (n - len(out["env_mask"][0])))
    assert (rows_grad[mask == 0] == 0).all() and (rows_grad[mask == 1] > 0).all()


def test_no_think_rl_trains_on_bare_answer(tok, tmp_path):
    trainer = make_trainer(tok, tmp_path, no_think_rl=True, max_turns=1)
    said = "< think > up up < / think > < answer > up < / answer > junk"
    trainer._generate_single_turn = lambda prompt_ids, *a: ([ids(tok, said)] * len(prompt_ids), None)
    rows = [{"prompt": p, "env_seed": 0} for p in list(env_dataset(make_env("frozenlake"), 1, tok)["prompt"]) * 2]
    out = env_rollout([r["prompt"] for r in rows], SimpleNamespace(
        args=trainer.args, processing_class=tok, batch_context=BatchContext(rows, "train"),
        episode_source=trainer.episode_source,
        _generate_single_turn=trainer._generate_single_turn,
        _metrics=trainer._metrics, model=trainer.model, accelerator=trainer.accelerator))  # fmt: skip
    bare = ids(tok, "<answer>up</answer>")
    assert out["completion_ids"][0] == bare + [1] and out["env_mask"][0] == [1] * len(bare) + [0]


def test_no_think_rl_off_policy_is_refused_by_the_config_itself(tmp_path):
    """The Python API's config refuses it as train.py does (its answer rewrite leaves no behaviour log-probs)."""
    from trl_ext.registry import ConfigError

    with pytest.raises(ConfigError, match="no behaviour log-probs"):
        train_config(output_dir=str(tmp_path), report_to=[], env="frozenlake", max_async_level=1, no_think_rl=True)
