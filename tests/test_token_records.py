"""Token records (trl_ext/runs/token_records.py, trl_ext/runs/component.py): the labels on hand-made masks and
ratios, the table's bookkeeping, and train.py runs whose token shards load with `datasets`, hold a row for every
trained token and agree with the masks' thresholds."""

import sys
from pathlib import Path

import pytest
import torch
import zygote

from trl_ext.runs import token_records as tr

ROOT = Path(__file__).resolve().parents[1]
M = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])  # loss mask: 3 samples


def masks(**on) -> dict[str, torch.Tensor]:
    """Every mask of `importance_loss` off, the given ones set (token masks (3, 4), sequence masks (3,))."""
    out = {name: torch.zeros(3, 4, dtype=torch.bool) for name in ("token_low", "token_high", "token_clipped")}
    out.update({name: torch.zeros(3, dtype=torch.bool) for name in ("geo_low", "geo_high", "seq_low", "seq_high",
                                                                    "seq_clipped")})  # fmt: skip
    for name, value in on.items():
        out[name] = torch.tensor(value)
    return out


def test_mask_labels_name_the_first_mask_in_order():
    got = tr.mask_labels(masks(token_high=[[0, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]], geo_high=[False, False, True],
                               seq_low=[True, False, False]), M)  # fmt: skip
    assert got == [["seq_low", "token_high", "seq_low", None],  # position 3 is outside the loss mask
                   [None, None, None, None],
                   ["token_high", "geo_high", "geo_high", "geo_high"]]  # the token mask comes before its sequence's


def test_clip_labels():
    m = masks(token_clipped=[[1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0]], seq_clipped=[False, True, False])
    assert tr.clip_labels(m, M, "token") == [["token", None, None, None], [None, "token", None, None], [None] * 4]
    assert tr.clip_labels(m, M, "sequence") == [[None] * 4, ["sequence", "sequence", None, None], [None] * 4]


def test_ppo_clip_labels_act_where_the_clipped_term_is_flat():
    ratio = torch.tensor([[1.3, 0.7, 1.0, 1.3], [1.3, 0.7, 1.0, 1.0], [1.1, 0.9, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0, 2.0])  # eps 0.2: A > 0 clips r > 1.2; A < 0 clips r < 0.8
    assert tr.ppo_clip_labels(ratio, adv, M, 0.2, 0.2) == [["ppo", None, None, None], [None, "ppo", None, None],
                                                         [None] * 4]  # fmt: skip


def test_token_table_fills_and_checks():
    table = tr.TokenTable(step=3)
    gen = {k: [None] * 3 for k in tr.GEN_FIELDS}
    table.add_sample(7, {**gen, "token_id": [5, 6, 2], "trained": [True, False, True]})
    assert table.missing() == [7]
    loss = {"behaviour_logprob": [-1.0, -2.0], "trainer_logprob": [-1.5, -2.5], "ratio": [0.6, 0.6],
            "masked_by": ["token_low", None], "clipped": [None, None]}  # fmt: skip
    table.fill(7, [0, 2], loss)
    assert table.missing() == [] and table.columns()["trainer_logprob"] == [-1.5, None, -2.5]
    assert table.columns()["masked_by"] == ["token_low", None, None]
    with pytest.raises(RuntimeError, match="the loss saw sample 8, which step 3 did not record"):
        table.fill(8, [0], loss)
    with pytest.raises(ValueError, match="fields of different lengths"):
        table.add_sample(9, {**gen, "token_id": [1]})


def test_token_records_need_saved_rollouts(train_cli_error):
    assert "--token_records_every needs --save_rollouts" in train_cli_error("--reward", "happy_binary",
                                                                           "--token_records_every", "1")
    assert "not with --num_iterations 2" in train_cli_error("--reward", "happy_binary", "--save_rollouts",
                                                            "--token_records_every", "1", "--num_iterations", "2")


def _train(tmp_path: Path, steps: int, *flags: str) -> Path:
    out = tmp_path / "out"
    proc = zygote.run([sys.executable, "train.py", "--max_steps", str(steps), "--save_rollouts", "--no_wandb",
                       "--output_dir", str(out), *flags], cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    return run_dir


def _check_rows(run_dir: Path, steps: list[int]):
    """The token shards load with datasets; every trained token has its row with the loss's values, and the rows
    of each completion add up to its completion_tokens."""
    from trl_ext.runs.rollouts import load_rollouts, token_table

    table = token_table(run_dir)
    assert sorted(table["step"].unique()) == steps
    rows = load_rollouts(run_dir).to_pandas()
    rows = rows[rows["step"].isin(steps)].set_index(["step", "sample"])
    trained = table[table["trained"]]
    counts = trained.groupby(["step", "sample"]).size().reindex(rows.index, fill_value=0)
    assert (counts == rows["completion_tokens"]).all()
    assert trained[["trainer_logprob", "behaviour_logprob", "ratio"]].notna().all().all()
    assert table[~table["trained"]]["trainer_logprob"].isna().all()
    return table, trained


@pytest.mark.slow
def test_offpolicy_multiturn_run_records_every_token_and_its_mask(tmp_path):
    """Strict k = 1 on the multi-turn prisoner's dilemma with tight token masks (ratio outside [0.99, 1.01] dropped), records on
    step 2 (every 2nd step): environment tokens have rows, untrained; each masked token's
    label agrees with its ratio and the thresholds; the lag is 1 after the first step."""
    run_dir = _train(tmp_path, 2, "--env", "prisoners_dilemma", "--model", "builtin_env", "--max_turns", "2",
                     "--batch_size", "8", "--num_generations", "4", "--max_completion_length", "24", "--lr", "1e-3",
                     "--max_async_level", "1", "--strict_async_level", "--token_mask_low", "0.99",
                     "--token_mask_high", "1.01", "--token_records_every", "2")  # fmt: skip
    table, trained = _check_rows(run_dir, [2])
    assert set(table["source"]) == {"agent", "env"} and not table[table["source"] == "env"]["trained"].any()
    assert (trained["policy_version"] == 0).all() and set(table["env"]) == {"prisoners_dilemma"}  # lag 1
    high, low = trained["masked_by"] == "token_high", trained["masked_by"] == "token_low"
    assert high.sum() > 0 and low.sum() > 0  # measured: 6 and 10 of 128
    assert (trained[high]["ratio"] > 1.01).all() and (trained[low]["ratio"] < 0.99).all()
    kept = trained["masked_by"].isna()
    assert trained[kept]["ratio"].between(0.99, 1.01).all()
    assert (trained["ratio"] - (trained["trainer_logprob"] - trained["behaviour_logprob"]).map(
        lambda x: __import__("math").exp(x))).abs().max() < 1e-9


@pytest.mark.slow
def test_routed_on_policy_run_records_the_adapter_side(tmp_path):
    """k = 0 (TRL's own loss) with gradient routing and distillation: the behaviour log-prob is the trainer's at
    k = 0 (ratio 1, nothing masked or clipped), each token carries its sample's adapter side from the routing label,
    and its teacher log-prob."""
    run_dir = _train(tmp_path, 2, "--reward", "sentence_length_5_with_happy", "--gradient_routing", "--routing_mode",
                     "exclusive", "--lora_config", "r2", "--eval_routing_steps", "0", "--batch_size", "8",
                     "--num_generations", "4", "--max_completion_length", "12", "--teacher_context", "A happy story.",
                     "--teacher_tau", "0.5", "--student_tau", "0.5", "--token_records_every", "1")  # fmt: skip
    table, trained = _check_rows(run_dir, [1, 2])
    assert (trained["ratio"] - 1).abs().max() < 1e-5 and trained["masked_by"].isna().all()
    assert trained["clipped"].isna().all() and trained["teacher_logprob"].notna().all()
    assert set(trained["adapter"]) <= {"retain", "forget"} and (trained["policy_version"] == trained["step"] - 1).all()
    assert ((trained["adapter"] == "forget") == trained["is_rh"].astype(bool)).all()  # recall 1: flagged -> forget
