"""trl_ext.generation.sampling and .weights: the fused sampling step, the EOS rule and the affine read of a projection,
against hand-computed values (no model)."""

import math

import torch
from torch import nn

from trl_ext.generation.sampling import completions_from_steps, finish_step, sample_step
from trl_ext.generation.weights import affine_of

LOGITS = torch.log(torch.tensor([[1.0, 2.0, 3.0]]))  # softmax = [1/6, 2/6, 3/6]


def test_exponential_race_by_hand():
    # z - log(noise): noise 1 everywhere -> argmax z = token 2; log-prob ln(3/6)
    tok, lp = sample_step(LOGITS, 1.0, 0, 1.0, noise=torch.ones(1, 3))
    assert tok.tolist() == [2] and math.isclose(lp.item(), math.log(0.5), rel_tol=1e-6)
    # noise [1, 1, 4]: [0, ln 2, ln 3 - ln 4] -> token 1; log-prob ln(2/6)
    tok, lp = sample_step(LOGITS, 1.0, 0, 1.0, noise=torch.tensor([[1.0, 1.0, 4.0]]))
    assert tok.tolist() == [1] and math.isclose(lp.item(), math.log(2 / 6), rel_tol=1e-6)
    # a zero noise entry cannot pick a token filtered out by top-k (it stays -inf)
    tok, _ = sample_step(LOGITS, 1.0, 1, 1.0, noise=torch.tensor([[0.0, 1.0, 1.0]]))
    assert tok.tolist() == [2]


def test_logprob_is_raw_tempered_not_filtered():
    # temperature 0.5: z = 2 ln [1, 2, 3], softmax [1, 4, 9] / 14; top_k 1 samples token 2, scored ln(9/14)
    for noise in (torch.rand(1, 3) + 0.1, None):
        tok, lp = sample_step(LOGITS, 0.5, 1, 1.0, noise=noise, rng=torch.Generator().manual_seed(0))
        assert tok.tolist() == [2] and math.isclose(lp.item(), math.log(9 / 14), rel_tol=1e-6)
    # top_p 0.4: ascending cumulative [1/6, 1/2, 1]; drop where <= 0.6 -> tokens 0 and 1; token 2 scored ln(1/2)
    tok, lp = sample_step(LOGITS, 1.0, 0, 0.4, rng=torch.Generator().manual_seed(0))
    assert tok.tolist() == [2] and math.isclose(lp.item(), math.log(0.5), rel_tol=1e-6)


def test_both_samplers_draw_the_softmax():
    """20,000 rows of the same logits: each sampler's token frequencies within 0.015 of [1/6, 2/6, 3/6] (the
    standard error of a frequency is at most 0.0035 here; a temperature or top-k error moves them by > 0.05)."""
    n = 20_000
    logits = LOGITS.expand(n, 3)
    rng = torch.Generator().manual_seed(0)
    noise = torch.empty(n, 3).exponential_(generator=rng)
    for noise_arg in (noise, None):
        tok, _ = sample_step(logits, 1.0, 0, 1.0, noise=noise_arg, rng=rng)
        freq = torch.bincount(tok, minlength=3).float() / n
        assert (freq - torch.tensor([1 / 6, 2 / 6, 3 / 6])).abs().max().item() < 0.015, freq
    tok, _ = sample_step(logits, 1.0, 2, 1.0, rng=rng)  # top_k 2: [0, 2/5, 3/5]
    freq = torch.bincount(tok, minlength=3).float() / n
    assert freq[0].item() == 0 and abs(freq[1].item() - 0.4) < 0.015


def test_finish_step_pads_after_eos():
    eos = torch.tensor([1, 9])
    tok, alive, done = finish_step(torch.tensor([1, 5, 7, 9]), torch.tensor([False, True, False, False]), eos, 0)
    assert tok.tolist() == [1, 0, 7, 9]  # the finished row emits the pad id
    assert alive.tolist() == [True, False, True, True]  # an EOS is the last token of its completion
    assert done.tolist() == [True, True, False, True]


def test_completions_cut_at_first_eos():
    tokens = torch.tensor([[4, 1, 0, 0], [4, 5, 6, 7]])
    logps = torch.tensor([[-0.5, -1.0, 0.0, 0.0], [-0.25, -0.5, -0.75, -2.0]])  # exact in float32
    alive = torch.tensor([[True, True, False, False], [True, True, True, True]])
    ids, lps = completions_from_steps(tokens, logps, alive)
    assert ids == [[4, 1], [4, 5, 6, 7]] and lps == [[-0.5, -1.0], [-0.25, -0.5, -0.75, -2.0]]


class _LoRALike(nn.Module):
    def __init__(self, base: nn.Linear, a: torch.Tensor, b: torch.Tensor, scale: float):
        super().__init__()
        self.base, self.a, self.b, self.scale = base, a, b, scale

    def forward(self, x):
        return self.base(x) + self.scale * (x @ self.a.T) @ self.b.T


def test_affine_of_reads_a_wrapped_projection_as_its_merged_weight():
    base = nn.Linear(2, 3, bias=True).double()
    with torch.no_grad():
        base.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
        base.bias.copy_(torch.tensor([0.5, -0.5, 1.0]))
    a = torch.tensor([[1.0, -1.0]], dtype=torch.float64)  # rank 1
    b = torch.tensor([[2.0], [0.0], [1.0]], dtype=torch.float64)
    w_t, bias = affine_of(_LoRALike(base, a, b, 0.5), 2, base.weight)
    # W + 0.5 * B A = [[1, 2], [3, 4], [5, 6]] + 0.5 * [[2, -2], [0, 0], [1, -1]]
    assert w_t.T.tolist() == [[2.0, 1.0], [3.0, 4.0], [5.5, 5.5]] and bias.tolist() == [0.5, -0.5, 1.0]
    plain_w, plain_b = affine_of(base, 2, base.weight)  # a plain Linear: its own weight, no copy
    assert plain_w.data_ptr() == base.weight.data_ptr() and plain_b is base.bias
    no_bias = nn.Linear(2, 3, bias=False).double()
    assert affine_of(_LoRALike(no_bias, a, b, 0.5), 2, no_bias.weight)[1] is None
