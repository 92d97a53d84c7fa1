"""Exact tests of trl_ext.offpolicy.importance on hand-made tensors; expected values are derived by hand below."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from trl_ext.offpolicy.importance import (
    NO_MASK,
    PRIME_RL_DEFAULTS,
    ImportanceConfig,
    check_loss_type,
    importance_loss,
    policy_lag_stats,
    reference_kl,
)
from trl_ext.registry import ConfigError

F64 = torch.float64
INF_CFG = {  # the masks and clips removed outright
    "token_mask_low": 0.0, "token_mask_high": math.inf, "sequence_mask_low": 0.0, "sequence_mask_high": math.inf,
    "geo_mask_low": 0.0, "geo_mask_high": math.inf, "sequence_clip_high": math.inf, "token_clip_high": math.inf,
}


def cfg(**over):
    """prime-rl defaults with every mask off, then the overrides."""
    return ImportanceConfig(**{**PRIME_RL_DEFAULTS, **NO_MASK, **over})


def batch(logr, lp_b, mask, adv):
    """lp_trainer = lp_behaviour + logr (a leaf with grad), so the ratio is exp(logr) by construction."""
    lp_b = torch.tensor(lp_b, dtype=F64)
    lp_t = (lp_b + torch.tensor(logr, dtype=F64)).requires_grad_(True)
    return lp_t, lp_b, torch.tensor(mask, dtype=torch.bool), torch.tensor(adv, dtype=F64)


def grpo_ref(rows):
    """Hand formula for loss_type grpo: mean_i (1/n_i) sum_{kept t} -coeff_t * lp_t; rows = [(n_i, [(coeff, lp)])]."""
    return sum(sum(-c * lp for c, lp in kept) / n for n, kept in rows) / len(rows)


# ---------------------------------------------------------------- config


def test_config_has_no_defaults_and_dicts_cover_fields():
    names = [f.name for f in dataclasses.fields(ImportanceConfig)]
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(ImportanceConfig))
    assert sorted(PRIME_RL_DEFAULTS) == sorted(names)
    assert PRIME_RL_DEFAULTS == {
        "ratio_type": "token", "token_mask_low": 0.125, "token_mask_high": 8.0, "sequence_mask_low": 0.0,
        "sequence_mask_high": 100.0, "geo_mask_low": 0.1, "geo_mask_high": 10.0, "sequence_clip_high": 10.0,
        "token_clip_high": 1e10, "kl_tau": 0.0, "loss_adv_tau": 1.0,
    }
    assert set(NO_MASK) <= set(names)
    assert all(v == (0.0 if k.endswith("_low") else 1e10) for k, v in NO_MASK.items())
    ns = SimpleNamespace(**{**PRIME_RL_DEFAULTS, "kl_tau": 0.01, "unrelated": 3})
    assert ImportanceConfig.from_object(ns) == ImportanceConfig(**{**PRIME_RL_DEFAULTS, "kl_tau": 0.01})


@pytest.mark.parametrize(
    "over, field",
    [
        ({"token_mask_low": 2.0, "token_mask_high": 2.0}, "token_mask_low"),
        ({"sequence_mask_low": 5.0, "sequence_mask_high": 1.0}, "sequence_mask_low"),
        ({"geo_mask_low": 10.0, "geo_mask_high": 0.1}, "geo_mask_low"),
        ({"token_mask_low": -0.1}, "token_mask_low"),
        ({"sequence_clip_high": 0.0}, "sequence_clip_high"),
        ({"sequence_clip_high": -1.0}, "sequence_clip_high"),
        ({"token_clip_high": 0.0}, "token_clip_high"),
        ({"kl_tau": -1e-3}, "kl_tau"),
        ({"loss_adv_tau": -1.0}, "loss_adv_tau"),
        ({"ratio_type": "geo"}, "ratio_type"),
        ({"geo_mask_high": float("nan")}, "geo_mask_high"),
        ({"kl_tau": "1e-3"}, "kl_tau"),
        ({"ratio_type": "sequence", "token_clip_high": 2.0}, "token_clip_high"),
    ],
)
def test_validate_errors(over, field):
    with pytest.raises(ConfigError, match=field):
        ImportanceConfig(**{**PRIME_RL_DEFAULTS, **over})


def test_unknown_loss_type_and_missing_normaliser_arguments():
    lp_t, lp_b, m, a = batch([[0.0]], [[-1.0]], [[1]], [1.0])
    with pytest.raises(ConfigError, match="dr_grpo"):  # the error lists the supported names
        check_loss_type("cispo")
    with pytest.raises(ConfigError, match="sapo"):
        importance_loss(lp_t, lp_b, a, m, cfg(), "sapo")
    with pytest.raises(ValueError, match="num_items_in_batch"):
        importance_loss(lp_t, lp_b, a, m, cfg(), "dapo")
    with pytest.raises(ValueError, match="max_completion_length"):
        importance_loss(lp_t, lp_b, a, m, cfg(), "dr_grpo")
    with pytest.raises(ValueError, match="shape"):
        importance_loss(lp_t, lp_b[:, :0], a, m, cfg(), "grpo")
    with pytest.raises(ValueError, match="advantages"):
        importance_loss(lp_t, lp_b, torch.ones(2, dtype=F64), m, cfg(), "grpo")


# ---------------------------------------------------------------- on-policy == REINFORCE

# seq0: lp [-1,-2,-3], A=1 -> -A*lp = [1,2,3], sum 6, n=3; seq1: lp [-0.5,-1.5,pad], A=-1 -> [-0.5,-1.5], sum -2, n=2
REINFORCE = [
    ("grpo", {}, (6 / 3 + -2 / 2) / 2, [[-1 / 6] * 3, [1 / 4, 1 / 4, 0]]),
    ("bnpo", {}, 4 / 5, [[-1 / 5] * 3, [1 / 5, 1 / 5, 0]]),
    ("dapo", {"num_items_in_batch": 16}, 4 / 16, [[-1 / 16] * 3, [1 / 16, 1 / 16, 0]]),
    ("token", {"num_items_in_batch": torch.tensor(16)}, 4 / 16, [[-1 / 16] * 3, [1 / 16, 1 / 16, 0]]),
    ("dr_grpo", {"max_completion_length": 5}, 4 / 10, [[-1 / 10] * 3, [1 / 10, 1 / 10, 0]]),
]


@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
@pytest.mark.parametrize("loss_type, kwargs, expected, grad", REINFORCE)
def test_on_policy_is_reinforce(ratio_type, loss_type, kwargs, expected, grad):
    lp = [[-1.0, -2.0, -3.0], [-0.5, -1.5, 7.0]]
    lp_t, lp_b, m, a = batch([[0.0] * 3] * 2, lp, [[1, 1, 1], [1, 1, 0]], [1.0, -1.0])
    c = ImportanceConfig(**{**PRIME_RL_DEFAULTS, "ratio_type": ratio_type})  # default masks keep ratio 1
    out = importance_loss(lp_t, lp_b, a, m, c, loss_type, **kwargs)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(expected, abs=1e-15)
    assert torch.allclose(lp_t.grad, torch.tensor(grad, dtype=F64), rtol=0, atol=1e-15)
    assert out.metrics["ratio_mean"].item() == 1.0 and out.metrics["ratio_max"].item() == 1.0
    assert out.metrics["kept_frac"].item() == 1.0 and out.metrics["abs_log_ratio_mean"].item() == 0.0


# ---------------------------------------------------------------- masks, one at a time

TOKEN_R = [0.4, 1.0, 3.0, 1.5]


@pytest.mark.parametrize(
    "over, kept, low_frac, high_frac",
    [({"token_mask_low": 0.5}, [1, 2, 3], 0.25, 0.0), ({"token_mask_high": 2.0}, [0, 1, 3], 0.0, 0.25),
     ({"token_mask_low": 0.5, "token_mask_high": 2.0}, [1, 3], 0.25, 0.25)],
)
def test_token_mask(over, kept, low_frac, high_frac):
    lp_t, lp_b, m, a = batch([[math.log(r) for r in TOKEN_R]], [[-1.0] * 4], [[1] * 4], [2.0])
    out = importance_loss(lp_t, lp_b, a, m, cfg(**over), "grpo")
    # coeff = r * A; the normaliser is all 4 loss tokens even though some are dropped
    expected = grpo_ref([(4, [(TOKEN_R[j] * 2.0, -1.0 + math.log(TOKEN_R[j])) for j in kept])])
    assert out.loss.item() == pytest.approx(expected, rel=1e-13)
    assert out.masks["keep"][0].tolist() == [j in kept for j in range(4)]
    assert out.masks["token_low"][0].tolist() == [low_frac > 0, False, False, False]
    assert out.metrics["token_masked_low_frac"].item() == low_frac
    assert out.metrics["token_masked_high_frac"].item() == high_frac
    assert out.metrics["kept_frac"].item() == len(kept) / 4
    assert out.metrics["ratio_max"].item() == pytest.approx(3.0, rel=1e-14)
    assert out.metrics["ratio_mean"].item() == pytest.approx(5.9 / 4, rel=1e-14)


# seq0: ratios [0.4,1,1] (min 0.4); seq1: [1,3,1] (max 3); seq2: [1,1,pad]
SEQ_LOGR = [[math.log(0.4), 0.0, 0.0], [0.0, math.log(3.0), 0.0], [0.0, 0.0, 0.0]]
SEQ_LPB = [[-2.0, -1.0, -0.5], [-1.0, -2.0, -3.0], [-0.25, -0.75, 0.0]]


@pytest.mark.parametrize(
    "over, dropped, key",
    [({"sequence_mask_low": 0.5}, 0, "seq_low"), ({"sequence_mask_high": 2.0}, 1, "seq_high")],
)
def test_sequence_min_max_mask(over, dropped, key):
    lp_t, lp_b, m, a = batch(SEQ_LOGR, SEQ_LPB, [[1, 1, 1], [1, 1, 1], [1, 1, 0]], [1.0, -1.0, 0.5])
    out = importance_loss(lp_t, lp_b, a, m, cfg(**over), "grpo")
    rows = [
        (3, [(0.4 * 1.0, -2.0 + math.log(0.4)), (1.0, -1.0), (1.0, -0.5)]),
        (3, [(-1.0, -1.0), (3.0 * -1.0, -2.0 + math.log(3.0)), (-1.0, -3.0)]),
        (2, [(0.5, -0.25), (0.5, -0.75)]),
    ]
    rows[dropped] = (rows[dropped][0], [])
    assert out.loss.item() == pytest.approx(grpo_ref(rows), rel=1e-13)
    assert out.masks[key].tolist() == [i == dropped for i in range(3)]
    assert out.masks["keep"][dropped].tolist() == [False] * 3
    assert out.metrics[f"{key.replace('seq', 'seq_masked')}_frac"].item() == pytest.approx(1 / 3)
    assert out.metrics["kept_frac"].item() == 5 / 8
    assert out.metrics["token_masked_low_frac"].item() == 0.0


# geo ratios: seq0 exp(-2) ~ 0.135, seq1 exp(1) ~ 2.718, seq2 exp(0) = 1
@pytest.mark.parametrize(
    "over, dropped", [({"geo_mask_low": 0.2}, [0]), ({"geo_mask_high": 2.0}, [1]),
                      ({"geo_mask_low": 0.2, "geo_mask_high": 2.0}, [0, 1])],
)
def test_geo_mask(over, dropped):
    logr = [[-2.0, -2.0], [1.5, 0.5], [0.3, -0.3]]
    lp_t, lp_b, m, a = batch(logr, [[-1.0, -1.0]] * 3, [[1, 1]] * 3, [1.0, 1.0, 1.0])
    out = importance_loss(lp_t, lp_b, a, m, cfg(**over), "bnpo")
    kept = [(math.exp(x), -1.0 + x) for i in range(3) if i not in dropped for x in logr[i]]
    assert out.loss.item() == pytest.approx(sum(-c * lp for c, lp in kept) / 6, rel=1e-13)
    assert (out.masks["geo_low"] | out.masks["geo_high"]).tolist() == [i in dropped for i in range(3)]
    assert out.metrics["seq_masked_frac"].item() == pytest.approx(len(dropped) / 3)
    assert out.metrics["geo_ratio_mean"].item() == pytest.approx((math.exp(-2) + math.e + 1) / 3, rel=1e-14)


# ---------------------------------------------------------------- clips and the kl term


def test_sequence_ratio_clip_and_cap():
    # sums of logr: 1, 2, 12 -> exp(min(s, 10)) = e, e^2 ~ 7.39, e^10; clipped at 5: e, 5, 5
    logr = [[0.5, 0.5], [1.0, 1.0], [6.0, 6.0]]
    lp_t, lp_b, m, a = batch(logr, [[-3.0, -3.0]] * 3, [[1, 1]] * 3, [1.0, -1.0, 2.0])
    out = importance_loss(lp_t, lp_b, a, m, cfg(ratio_type="sequence", sequence_clip_high=5.0), "grpo")
    ratios, adv = [math.e, 5.0, 5.0], [1.0, -1.0, 2.0]
    rows = [(2, [(ratios[i] * adv[i], -3.0 + x) for x in logr[i]]) for i in range(3)]
    assert out.loss.item() == pytest.approx(grpo_ref(rows), rel=1e-13)
    assert out.masks["seq_clipped"].tolist() == [False, True, True]
    assert out.metrics["seq_clipped_frac"].item() == pytest.approx(2 / 3)
    assert out.metrics["kept_frac"].item() == 1.0  # a clip never drops
    out = importance_loss(lp_t, lp_b, a, m, cfg(ratio_type="sequence"), "grpo")  # clip off: cap at e^10, not e^12
    out.loss.backward()
    assert lp_t.grad[2].tolist() == pytest.approx([-math.exp(10) * 2.0 / 6] * 2, rel=1e-13)
    assert lp_t.grad[1].tolist() == pytest.approx([math.exp(2) / 6] * 2, rel=1e-13)
    assert out.metrics["seq_clipped_frac"].item() == 0.0


def test_token_clip_truncates_ratio():
    lp_t, lp_b, m, a = batch([[math.log(0.5), math.log(1.5), math.log(4.0)]], [[-1.0] * 3], [[1] * 3], [-1.0])
    out = importance_loss(lp_t, lp_b, a, m, cfg(token_clip_high=2.0), "grpo")
    out.loss.backward()
    used = [0.5, 1.5, 2.0]  # min(r, 2)
    assert lp_t.grad[0].tolist() == pytest.approx([u / 3 for u in used], rel=1e-13)  # -coeff/3 with A=-1
    assert out.masks["token_clipped"][0].tolist() == [False, False, True]
    assert out.metrics["token_clipped_frac"].item() == pytest.approx(1 / 3)
    assert out.metrics["kept_frac"].item() == 1.0
    assert out.metrics["ratio_max"].item() == pytest.approx(4.0, rel=1e-14)  # the metric reports the raw ratio


@pytest.mark.parametrize("loss_type, kwargs", [("grpo", {}), ("dapo", {"num_items_in_batch": 10})])
def test_kl_tau_term_and_gradient(loss_type, kwargs):
    # seq0 token 1 has r = 3 > token_mask_high = 2 and is dropped; seq1 position 2 is padding
    logr = [[0.2, math.log(3.0), -0.1], [0.4, -0.5, 0.0]]
    lp_b = [[-1.0, -2.0, -0.5], [-1.2, -0.3, 9.0]]
    adv = [2.0, -1.0]
    lp_t, lp_bt, m, a = batch(logr, lp_b, [[1, 1, 1], [1, 1, 0]], adv)
    c = cfg(kl_tau=0.1, loss_adv_tau=0.5, token_mask_high=2.0)
    out = importance_loss(lp_t, lp_bt, a, m, c, loss_type, **kwargs)
    out.loss.backward()
    kept = {(0, 0), (0, 2), (1, 0), (1, 1)}
    coeff = {(i, j): math.exp(logr[i][j]) * (0.5 * adv[i] - 0.1 * logr[i][j]) for i, j in kept}
    norm = {(i, j): (3 * 2 if i == 0 else 2 * 2) for i, j in kept} if loss_type == "grpo" else dict.fromkeys(kept, 10)
    expected = sum(-coeff[k] * (lp_b[k[0]][k[1]] + logr[k[0]][k[1]]) / norm[k] for k in kept)
    assert out.loss.item() == pytest.approx(expected, rel=1e-13)
    grad = [[-coeff[(i, j)] / norm[(i, j)] if (i, j) in kept else 0.0 for j in range(3)] for i in range(2)]
    assert torch.allclose(lp_t.grad, torch.tensor(grad, dtype=F64), rtol=1e-13, atol=0)


# ---------------------------------------------------------------- reference-model KL under the masks and clips

# token ratios per row (None = padding). Masks: token [0.125, 8], sequence [0.1, 100], geo [0.35, 2], token clip 2.
KL_RATIOS = [
    [0.12, 1.2, 10.0, 4.0],  # token_low, kept, token_high, kept but clipped 4 -> 2 (geo 5.76^(1/4) = 1.55)
    [1.5, 3.0, None, None],  # geo_high: geo = sqrt(4.5) = 2.12 > 2, whole row dropped
    [0.3, 0.3, None, None],  # geo_low: geo 0.3 < 0.35
    [0.05, 1.0, 1.0, None],  # seq_low: min 0.05 < 0.1 (geo 0.05^(1/3) = 0.37); the two 1.0 tokens fall with it
    [150.0, 0.2, 0.2, 0.2],  # seq_high: max 150 > 100 (geo 1.2^(1/4) = 1.05); the three 0.2 tokens fall with it
    [0.9, 1.1, None, None],  # kept
]
KL_MASKS = {"token_mask_low": 0.125, "token_mask_high": 8.0, "sequence_mask_low": 0.1, "sequence_mask_high": 100.0,
            "geo_mask_low": 0.35, "geo_mask_high": 2.0, "token_clip_high": 2.0}
KL_KEEP = [[0, 1, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]]
LP_B, LP_REF = -1.0, -1.5  # every behaviour log-prob, every reference log-prob


def kl_inputs():
    logr = [[0.0 if r is None else math.log(r) for r in row] for row in KL_RATIOS]
    mask = [[r is not None for r in row] for row in KL_RATIOS]
    lp_t, lp_b, m, a = batch(logr, [[LP_B] * 4] * 6, mask, [1.0] * 6)
    return lp_t, lp_b, m, a, torch.full_like(lp_b, LP_REF)


def k3(r):  # lp = LP_B + log r, delta = lp_ref - lp
    delta = LP_REF - LP_B - math.log(r)
    return math.exp(delta) - delta - 1


@pytest.mark.parametrize("bias_correction", [True, False])
def test_reference_kl_respects_masks_and_token_clip(bias_correction):
    lp_t, lp_b, m, a, lp_ref = kl_inputs()
    c = cfg(**KL_MASKS)
    keep = importance_loss(lp_t, lp_b, a, m, c, "grpo").masks["keep"]
    assert keep.int().tolist() == KL_KEEP  # one token or row dropped by each mask kind
    kl = reference_kl(lp_t, lp_ref, lp_b, m, keep, c, bias_correction=bias_correction)
    kl.sum().backward()
    w = {1.2: 1.2, 4.0: 2.0, 0.9: 0.9, 1.1: 1.1}  # the policy term's ratio, clipped at 2
    # d/dlp of w*k3: unclipped w = r carries gradient, r*(k3 + 1 - exp(delta)); a clipped w is a constant
    expected, grad = [[0.0] * 4 for _ in range(6)], [[0.0] * 4 for _ in range(6)]
    for i, j in [(0, 1), (0, 3), (5, 0), (5, 1)]:
        r = KL_RATIOS[i][j]
        e = math.exp(LP_REF - LP_B - math.log(r))
        if not bias_correction:
            expected[i][j], grad[i][j] = k3(r), 1 - e
        elif w[r] == r:
            expected[i][j], grad[i][j] = r * k3(r), r * (k3(r) + 1 - e)
        else:
            expected[i][j], grad[i][j] = w[r] * k3(r), w[r] * (1 - e)
    assert torch.allclose(kl, torch.tensor(expected, dtype=F64), rtol=1e-13, atol=0)
    assert torch.allclose(lp_t.grad, torch.tensor(grad, dtype=F64), rtol=1e-13, atol=0)
    if bias_correction:  # the clipped token: weight 2, not its raw ratio 4
        assert kl[0, 3].item() == pytest.approx(2.0 * k3(4.0), rel=1e-13) and 2.0 * k3(4.0) < 4.0 * k3(4.0)


def test_reference_kl_sequence_ratio():
    # ratios [1.5, 0.8, 9]: token 2 dropped by token_mask_high 8; w = the sequence ratio 1.5 * 0.8 * 9 = 10.8 (the
    # dropped token's value counts), its gradient flows through the kept tokens only; row 1 is clipped at 5.
    logr = [[math.log(1.5), math.log(0.8), math.log(9.0)], [math.log(3.0), math.log(2.0), 0.0]]
    lp_t, lp_b, m, a = batch(logr, [[LP_B] * 3] * 2, [[1, 1, 1], [1, 1, 0]], [1.0, 1.0])
    lp_ref = torch.full_like(lp_b, LP_REF)
    c = cfg(ratio_type="sequence", token_mask_high=8.0, sequence_clip_high=20.0)
    keep = importance_loss(lp_t, lp_b, a, m, c, "grpo").masks["keep"]
    assert keep.tolist() == [[True, True, False], [True, True, False]]
    kl = reference_kl(lp_t, lp_ref, lp_b, m, keep, c, bias_correction=True)
    kl.sum().backward()
    s0 = 1.5 * 0.8 * 9.0
    row0 = [s0 * k3(1.5), s0 * k3(0.8), 0.0]
    row1 = [6.0 * k3(3.0), 6.0 * k3(2.0), 0.0]  # sequence ratio 6 < clip 20
    assert kl.tolist() == [pytest.approx(row0, rel=1e-13), pytest.approx(row1, rel=1e-13)]
    # d/dlp_j of s * sum_t k3_t = s * sum_t k3_t + s * (1 - exp(delta_j)) for a kept j; 0 for the dropped token
    for i, (ratios, s) in enumerate([([1.5, 0.8], s0), ([3.0, 2.0], 6.0)]):
        total = sum(k3(r) for r in ratios)
        want = [s * total + s * (1 - math.exp(LP_REF - LP_B - math.log(r))) for r in ratios]
        assert lp_t.grad[i, :2].tolist() == pytest.approx(want, rel=1e-12)
        assert lp_t.grad[i, 2].item() == 0.0
    lp_t.grad = None
    clipped = cfg(ratio_type="sequence", token_mask_high=8.0, sequence_clip_high=5.0)
    kl = reference_kl(lp_t, lp_ref, lp_b, m, keep, clipped, bias_correction=True)
    kl.sum().backward()  # both rows clipped at 5 (10.8 and 6): w is a constant 5
    assert kl[:, :2].flatten().tolist() == pytest.approx([5 * k3(r) for r in (1.5, 0.8, 3.0, 2.0)], rel=1e-13)
    want = [5 * (1 - math.exp(LP_REF - LP_B - math.log(r))) for r in (1.5, 0.8, 3.0, 2.0)]
    assert lp_t.grad[:, :2].flatten().tolist() == pytest.approx(want, rel=1e-12)


def test_reference_kl_checks_inputs_and_ignores_padding_garbage():
    lp_t, lp_b, m, a, lp_ref = kl_inputs()
    keep = importance_loss(lp_t, lp_b, a, m, cfg(**KL_MASKS), "grpo").masks["keep"]
    with pytest.raises(ValueError, match="shape"):
        reference_kl(lp_t, lp_ref[:, :2], lp_b, m, keep, cfg(), bias_correction=True)
    with pytest.raises(ValueError, match="outside the loss mask"):
        reference_kl(lp_t, lp_ref, lp_b, torch.zeros_like(m), keep, cfg(), bias_correction=True)
    ref = reference_kl(lp_t, lp_ref, lp_b, m, keep, cfg(**KL_MASKS), bias_correction=True)
    lp_ref[~m], lp_b[~m] = float("nan"), -math.inf
    out = reference_kl(lp_t, lp_ref, lp_b, m, keep, cfg(**KL_MASKS), bias_correction=True)
    assert torch.equal(out, ref)


# ---------------------------------------------------------------- padding, empty sequences, bounds


def test_padding_is_ignored():
    # the same two sequences, once with one more padding column holding NaN / -inf garbage, once without
    nan, c = float("nan"), ImportanceConfig(**{**PRIME_RL_DEFAULTS, "token_clip_high": 1.2})
    logr = [[0.1, -0.2, 0.3], [0.05, -0.05, 0.0]]
    lp_b = [[-1.0, -2.0, -0.7], [-0.4, -0.9, 0.0]]
    lp_t, lp_bt, m, _ = batch(logr, lp_b, [[1, 1, 1], [1, 1, 0]], [0.0, 0.0])
    ref = importance_loss(lp_t, lp_bt, torch.tensor([1.0, -2.0], dtype=F64), m, c, "grpo")
    ref.loss.backward()
    pad_t = torch.tensor([[*lp_t[0].tolist(), nan], [*lp_t[1, :2].tolist(), nan, nan]], dtype=F64).requires_grad_()
    pad_b = torch.tensor([[*lp_b[0], nan], [-0.4, -0.9, -math.inf, nan]], dtype=F64)
    pad_m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    pad_a = torch.tensor([[1.0, 1.0, 1.0, nan], [-2.0, -2.0, nan, nan]], dtype=F64)  # (B, T) advantages
    out = importance_loss(pad_t, pad_b, pad_a, pad_m, c, "grpo")
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.loss.item() == ref.loss.item()
    assert torch.equal(pad_t.grad[:, :3], lp_t.grad) and pad_t.grad[:, 3].tolist() == [0.0, 0.0]
    assert pad_t.grad[1, 2] == 0.0 and out.metrics["token_clipped_frac"].item() == pytest.approx(1 / 5)
    for k in out.metrics:
        assert out.metrics[k].item() == ref.metrics[k].item(), k


def test_all_masked_sequence_contributes_zero():
    # seq0 normal; seq1 has no loss tokens (garbage values); seq2 dropped by geo_mask_high (geo = e^1)
    logr = [[0.1, -0.1], [50.0, -50.0], [1.0, 1.0]]
    lp_t, lp_b, m, a = batch(logr, [[-1.0, -2.0]] * 3, [[1, 1], [0, 0], [1, 1]], [1.0, 3.0, -1.0])
    c = cfg(geo_mask_high=2.0)
    for loss_type, norm in [("grpo", 2 * 3), ("bnpo", 4)]:  # grpo: mean over all 3 rows; bnpo: 4 loss tokens
        lp_t.grad = None
        out = importance_loss(lp_t, lp_b, a, m, c, loss_type)
        out.loss.backward()
        expected = -(math.exp(0.1) * (-1.0 + 0.1) + math.exp(-0.1) * (-2.0 - 0.1)) / norm
        assert out.loss.item() == pytest.approx(expected, rel=1e-13)
        assert lp_t.grad[1:].abs().sum().item() == 0.0 and torch.isfinite(lp_t.grad).all()
    assert out.masks["geo_high"].tolist() == [False, False, True]  # an empty row is never "dropped"
    assert out.metrics["seq_masked_frac"].item() == 0.5  # over the 2 sequences that have loss tokens
    assert out.metrics["kept_frac"].item() == 0.5
    out = importance_loss(lp_t, lp_b, a, torch.zeros_like(m), c, "grpo")  # no loss token at all
    assert out.loss.item() == 0.0 and all(v.item() == 0.0 for v in out.metrics.values())


BOUNDS = [
    {"token_mask_low": 1.0, "token_mask_high": 2.0}, {"token_mask_low": 0.5, "token_mask_high": 1.0},
    {"geo_mask_low": 1.0}, {"geo_mask_high": 1.0}, {"sequence_mask_low": 1.0}, {"sequence_mask_high": 1.0},
    {"token_clip_high": 1.0}, {"ratio_type": "sequence", "sequence_clip_high": 1.0},
]


@pytest.mark.parametrize("over", BOUNDS)
def test_ratio_exactly_on_bound_is_kept(over):
    lp_t, lp_b, m, a = batch([[0.0, 0.0]], [[-1.0, -3.0]], [[1, 1]], [2.0])  # every ratio is exactly 1
    out = importance_loss(lp_t, lp_b, a, m, cfg(**over), "grpo")
    assert out.loss.item() == -(2.0 * -1.0 + 2.0 * -3.0) / 2
    assert out.metrics["kept_frac"].item() == 1.0
    assert out.metrics["token_clipped_frac"].item() == 0.0 and out.metrics["seq_clipped_frac"].item() == 0.0


def test_ratio_on_non_unit_bound_kept_and_just_outside_dropped():
    lp_t = torch.tensor([[-1.0, -1.0]], dtype=F64)
    lp_b = torch.tensor([[-1.5, -1.0 - 1e-9]], dtype=F64)  # logr = 0.5 exactly, and 1e-9 (binary-rounded)
    bound = float(torch.exp(lp_t - lp_b)[0, 0])  # the ratio of token 0, exp(0.5), as a float
    m, a = torch.ones(1, 2, dtype=torch.bool), torch.ones(1, dtype=F64)

    def keep(**over):
        return importance_loss(lp_t, lp_b, a, m, cfg(**over), "grpo").masks["keep"].tolist()

    assert keep(token_mask_high=bound) == [[True, True]]
    assert keep(token_mask_low=bound) == [[True, False]]
    assert keep(token_mask_high=1.0) == [[False, False]]


@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
def test_disabling_values_are_exactly_no_mask(ratio_type):
    # ratios from e^-30 to e^30 ~ 1.07e13 (above 1e10): nothing may be dropped or clipped
    logr = [[30.0, -30.0, 2.0, 0.0], [-4.0, 3.0, 0.5, 0.0]]
    lp_b = [[-35.0, -0.1, -3.0, -1.0], [-0.2, -5.0, -1.0, 5.0]]
    outs, grads = [], []
    for settings in (NO_MASK, INF_CFG):
        c = ImportanceConfig(**{**PRIME_RL_DEFAULTS, **settings, "ratio_type": ratio_type})
        lp_t, lp_bt, m, a = batch(logr, lp_b, [[1, 1, 1, 1], [1, 1, 1, 0]], [0.5, -1.0])
        outs.append(importance_loss(lp_t, lp_bt, a, m, c, "grpo"))
        outs[-1].loss.backward()
        grads.append(lp_t.grad)
    assert outs[0].loss.item() == outs[1].loss.item() and torch.equal(grads[0], grads[1])
    assert outs[0].metrics["kept_frac"].item() == 1.0 and outs[0].metrics["token_clipped_frac"].item() == 0.0
    if ratio_type == "token":  # plain importance-weighted REINFORCE, by hand
        rows = [(4, [(math.exp(x) * 0.5, lp_b[0][j] + x) for j, x in enumerate(logr[0])]),
                (3, [(math.exp(x) * -1.0, lp_b[1][j] + x) for j, x in enumerate(logr[1][:3])])]
        assert outs[0].loss.item() == pytest.approx(grpo_ref(rows), rel=1e-12)
        lp_t, lp_bt, m, a = batch(logr, lp_b, [[1, 1, 1, 1], [1, 1, 1, 0]], [0.5, -1.0])
        high = importance_loss(lp_t, lp_bt, a, m, cfg(token_mask_high=1e9), "grpo")  # a finite high does act
        assert high.metrics["token_masked_high_frac"].item() == pytest.approx(1 / 7)


# ---------------------------------------------------------------- policy lag


def test_policy_lag_stats():
    versions = torch.tensor([[5, 5, 6, 100], [3, 3, 3, 3], [9, 9, 9, 9]])  # padding carries a bogus version
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    s = policy_lag_stats(versions, mask, current_version=7)
    # lags on loss tokens: [2,2,1] and [4,4,4,4] -> mean (5+16)/7 = 3, max 4; seq0 has versions {5,6}, seq1 {3}
    assert s["policy_lag_mean"].item() == 3.0
    assert s["policy_lag_max"].item() == 4.0
    assert s["multi_version_seq_frac"].item() == 0.5
    empty = policy_lag_stats(versions, torch.zeros_like(mask), current_version=7)
    assert all(v.item() == 0.0 for v in empty.values())
    with pytest.raises(ValueError, match="newer"):
        policy_lag_stats(versions, mask, current_version=5)
    with pytest.raises(ValueError, match="integer"):
        policy_lag_stats(versions.float(), mask, current_version=7)
    with pytest.raises(ValueError, match="shape"):
        policy_lag_stats(versions, mask[:, :2], current_version=7)
