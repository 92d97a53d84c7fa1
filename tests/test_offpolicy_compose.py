"""Off-policy training composed with gradient routing and with distillation (issue 12, point 4).

- Routing: under the masked importance-sampling loss (with the reference KL, masks that drop tokens and
  sequences, and a token clip) the routed single-pass gradient equals the two-pass reference and the routed
  gradient's definition, in float64 on a tiny dual-LoRA Llama; then through the trainer's own loss.
- Distillation: the student term of the advantages is built from the batch's behaviour log-probs (the
  generator's; the fork's ``inference_logprobs``), checked on hand-made tensors and through a k = 1 run.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trl_ext.batch import BatchContext
from trl_ext.distill.advantages import DistillConfig
from trl_ext.distill.component import Distillation
from trl_ext.estimator import estimate_advantages
from trl_ext.offpolicy.importance import (
    NORMALISATIONS,
    PRIME_RL_DEFAULTS,
    ImportanceConfig,
    importance_loss,
    reference_kl,
)
from trl_ext.routing.adapters import apply_dual_lora, forget_params, retain_params
from trl_ext.routing.step import single_pass_backward, two_pass_backward

D = torch.float64
N, T, P = 6, 6, 3  # samples, completion tokens, prompt tokens
PATTERNS = {"mixed": [False, True, False, True, True, False], "all_good": [False] * N, "all_bad": [True] * N}
MASKS = {"token_mask_low": 0.5, "token_mask_high": 2.0, "sequence_mask_low": 0.0, "sequence_mask_high": 1e10,
         "geo_mask_low": 0.0, "geo_mask_high": 1.8, "sequence_clip_high": 1e10, "token_clip_high": 1.3}


def make_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=32, max_position_embeddings=32, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to(D)
    apply_dual_lora(model, 2, 3, 4.0)
    with torch.no_grad():  # nonzero B everywhere, so every adapter has a gradient
        for p in retain_params(model) + forget_params(model):
            p.normal_(0, 0.3)
    return model.train()


def completion_logps(model, ids):
    logp = model(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp[:, P - 1 :]  # the T completion tokens


def make_batch(model, ratio_type):
    """Behaviour log-probs = the model's own, shifted so that some tokens are dropped (token mask), one sequence
    is dropped (geo mask) and some ratios exceed the token clip; reference log-probs differ from both."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 32, (N, P + T), generator=g)
    mask = torch.ones(N, T, dtype=torch.bool)
    mask[1, 4:] = mask[4, 2:] = False
    with torch.no_grad():
        lp = completion_logps(model, ids)
    shift = 0.25 * torch.randn(N, T, generator=g, dtype=D)
    shift[0, 1] = 1.0  # ratio e^-1 = 0.37 < 0.5: token-mask low
    shift[2, 3] = -0.9  # ratio e^0.9 = 2.46 > 2: token-mask high
    shift[5] = -0.7  # geo ratio e^0.7 = 2.01 > 1.8: the sequence is dropped
    batch = {"input_ids": ids, "completion_mask": mask, "lp_b": lp + shift,  # ratio exp(-shift)
             "lp_ref": lp + 0.3 * torch.randn(N, T, generator=g, dtype=D),
             "advantages": torch.randn(N, generator=g, dtype=D), "num_items_in_batch": mask.sum()}
    over = MASKS if ratio_type == "token" else {**MASKS, "token_clip_high": 1e10, "sequence_clip_high": 1.5}
    cfg = ImportanceConfig(**{**PRIME_RL_DEFAULTS, **over, "ratio_type": ratio_type, "kl_tau": 0.05})
    return batch, cfg


def make_loss_fn(model, cfg, beta=0.1, loss_type="grpo", rows=None):
    """The off-policy loss with the reference KL, reduced as ``loss_type``; ``rows`` (one bool per sample): the
    gradient flows through those samples' log-probs alone, every value and normaliser the whole batch's (the routed
    gradients' definition)."""

    def loss_fn(batch):
        lp, m = completion_logps(model, batch["input_ids"]), batch["completion_mask"]
        if rows is not None:
            lp = torch.where(rows[:, None], lp, lp.detach())
        kwargs = {"num_items_in_batch": batch["num_items_in_batch"], "max_completion_length": T}
        out = importance_loss(lp, batch["lp_b"], batch["advantages"], m, cfg, loss_type, **kwargs)
        kl = reference_kl(lp, batch["lp_ref"], batch["lp_b"], m, out.masks["keep"], cfg, bias_correction=True)
        return out.loss + beta * NORMALISATIONS.get(loss_type)(kl, m, **kwargs)

    return loss_fn


def grads(model):
    return [p.grad.clone() for p in retain_params(model) + forget_params(model)]


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def definition(mode, is_bad, ratio_type, loss_type="grpo"):
    """The routed gradients from their definition: one pass of the loss over the whole batch, each adapter's gradient
    flowing through its own samples' log-probs alone."""
    model = make_model()
    batch, cfg = make_batch(model, ratio_type)
    params = retain_params(model) + forget_params(model)
    k = len(retain_params(model))

    def grad(rows):
        return torch.autograd.grad(make_loss_fn(model, cfg, loss_type=loss_type, rows=rows)(batch), params)

    retain, forget = grad(~is_bad)[:k], grad(None if mode == "shared" else is_bad)[k:]
    return list(retain) + list(forget)


CASES = [(r, m, p, "grpo") for r in ("token", "sequence") for m in ("shared", "exclusive") for p in PATTERNS] + [
    ("token", m, "mixed", lt) for m in ("shared", "exclusive") for lt in ("bnpo", "dapo", "dr_grpo")]


@pytest.mark.parametrize(("ratio_type", "mode", "pattern", "loss_type"), CASES)
def test_routed_single_pass_equals_two_pass_under_is_loss(ratio_type, mode, pattern, loss_type):
    """Every loss type of the off-policy loss (grpo under every pattern and ratio type)."""
    is_bad = torch.tensor(PATTERNS[pattern])
    results = {}
    for name, step in (("single", single_pass_backward), ("two", two_pass_backward)):
        model = make_model()
        batch, cfg = make_batch(model, ratio_type)
        loss_fn = make_loss_fn(model, cfg, loss_type=loss_type)
        kwargs = {"loss_type": loss_type} if step is two_pass_backward else {}
        loss = step(loss_fn, batch, is_bad, model, mode, **kwargs)
        results[name] = (loss, grads(model))
    (l1, g1), (l2, g2) = results["single"], results["two"]
    assert max_diff(g1, g2) <= 1e-10 and abs(l1.item() - l2.item()) <= 1e-12
    assert max_diff(g1, definition(mode, is_bad, ratio_type, loss_type)) <= 1e-10
    assert max(g.abs().max().item() for g in g1) > 1e-4  # a real gradient


def test_the_is_batch_really_masks_and_clips():  # so the equality above covers dropped and clipped tokens
    model = make_model()
    batch, cfg = make_batch(model, "token")
    out = importance_loss(completion_logps(model, batch["input_ids"]).detach(), batch["lp_b"], batch["advantages"],
                          batch["completion_mask"], cfg, "grpo")  # fmt: skip
    assert out.masks["token_low"][0, 1] and out.masks["token_high"][2, 3] and out.masks["geo_high"].tolist() == [
        False] * 5 + [True]  # fmt: skip
    assert out.masks["token_clipped"].any() and not out.masks["keep"][5].any()


# ------------------------------------------------------------------ routing through the trainer's off-policy loss


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from environments.stories import generate_stories
    from trl_ext.models import prepare_tokenizer
    from trl_ext.models.builtin import train_tokenizer

    tok = prepare_tokenizer(train_tokenizer(generate_stories(200, 0)))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True, eos_token_id=1, bos_token_id=None, pad_token_id=1)  # fmt: skip
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), tok


def routed_offpolicy_trainer(tiny_dir, tmp_path, mode="shared", loss_type="grpo"):
    from datasets import Dataset

    from trl_ext.config import train_config
    from trl_ext.routing.setup import build_dual_lora_model
    from trl_ext.trainer import ExtGRPOTrainer

    path, tok = tiny_dir
    cfg = train_config(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3,
                       max_completion_length=5, max_steps=1, learning_rate=1e-2, beta=0.05, save_strategy="no",
                       report_to=[], use_cpu=True, disable_tqdm=True, seed=0, gradient_routing=True,
                       routing_mode=mode, loss_type=loss_type, lora_config="r2", eval_routing_steps=0, max_async_level=1,
                       token_clip_high=1.3, geo_mask_high=1.8, token_mask_high=2.0)  # fmt: skip
    model, layout = build_dual_lora_model(path, cfg, alpha=4.0)
    with torch.no_grad():  # nonzero B: both adapters get gradients
        for p in retain_params(model) + forget_params(model):
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    return ExtGRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=cfg,
                          train_dataset=Dataset.from_dict({"prompt": ["a b c"] * 6}), processing_class=tok,
                          rh_detector=("none", lambda texts: [False] * len(texts)), dual_lora_layout=layout,
                          routing_eval_prompts=[], routing_eval_rewards={})  # fmt: skip


@pytest.mark.parametrize(("mode", "loss_type"), [("shared", "grpo"), ("exclusive", "grpo"), ("shared", "dapo"),
                                                  ("exclusive", "bnpo"), ("shared", "dr_grpo")])  # fmt: skip
def test_routed_trainer_offpolicy_loss_single_equals_two_pass(tiny_dir, tmp_path, mode, loss_type):
    """The trainer's own off-policy _compute_loss (IS masks, token clip, reference KL) under both routed steps, for
    each loss type the off-policy loss takes."""
    is_bad = torch.tensor([False, True, True, False, False, True])
    results = []
    for step in (single_pass_backward, two_pass_backward):
        trainer = routed_offpolicy_trainer(tiny_dir, tmp_path / step.__name__, mode, loss_type)
        model = trainer.model
        model.train()
        trainer.current_gradient_accumulation_steps = 1
        inputs = _trainer_batch(trainer, model)
        model.zero_grad()
        kwargs = {"loss_type": loss_type} if step is two_pass_backward else {}
        step(lambda b: trainer.compute_loss(model, b), inputs, is_bad, model, mode, **kwargs)
        results.append([p.grad.clone() for p in retain_params(model) + forget_params(model)])
        metrics = trainer._metrics["train"]
        assert max(metrics["offpolicy/geo_masked_high_frac"]) > 0 and max(metrics["offpolicy/token_clipped_frac"]) > 0
    scale = max(g.abs().max().item() for g in results[0])
    assert scale > 1e-4 and max_diff(*results) <= 1e-5 * scale  # float32 log-probs (TRL's fused head)


def _trainer_batch(trainer, model):
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(2, vocab, (6, 4), generator=g)
    completion_ids = torch.randint(2, vocab, (6, 5), generator=g)
    prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)
    prompt_mask[1, :2] = 0
    completion_mask[0, 3:] = completion_mask[2, 1:] = 0
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": torch.randn(6, generator=g),
              "num_items_in_batch": completion_mask.sum()}  # fmt: skip
    ids, attn = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        lp = trainer._get_per_token_logps_and_entropies(model, ids, attn, 5)[0]
        shift = 0.2 * torch.randn(lp.shape, generator=g)
        shift[3] = -0.8  # geo ratio e^0.8 > 1.8: dropped
        shift[4, 0] = -1.0  # ratio e^1 > 2: token-mask high
        inputs["sampling_per_token_logps"] = lp + shift  # ratio exp(-shift)
        inputs["ref_per_token_logps"] = lp + 0.3 * torch.randn(lp.shape, generator=g)
    return inputs


# ------------------------------------------------------------------ distillation advantages from behaviour log-probs


class _Stub(Distillation):
    """Distillation's scorer stage on a hand-made scored batch (no model)."""

    def __init__(self, cfg, task, lp_teacher):
        metrics = {"train": defaultdict(list, frac_reward_zero_std=[0.0])}

        def no_forward(*args, **kwargs):
            raise AssertionError("the behaviour log-probs are in the batch: no forward of the policy may run")

        self.trainer = SimpleNamespace(model=SimpleNamespace(training=True), num_generations=2,
                                       metrics=lambda mode=None: metrics["train"],
                                       _get_per_token_logps_and_entropies=no_forward,
                                       accelerator=SimpleNamespace(num_processes=1, process_index=0))  # fmt: skip
        self.cfg, self.task, self._lp_teacher = cfg, task, lp_teacher

    def score_teacher(self, batch, prompts=None, render_kwargs=None):
        return self._lp_teacher

    def distill_score(self, batch, rows):
        ctx = BatchContext(rows=rows, mode="train")
        self.score(batch, ctx)
        return ctx.distill


def test_distill_student_term_uses_behaviour_logprobs_on_hand_made_tensors():
    """Off-policy batch (behaviour log-probs from the generator, a different old_per_token_logps, an env token):
    R = adv_tau*task + teacher_tau*sum_agent lp_teacher - student_tau*sum_agent lp_behaviour, A = R - mean_group(R).
    The fork computes the student sum from ``inference_logprobs`` (orchestrator/advantage.py): the behaviour's."""
    nan = float("nan")
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    tool_mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 1]])  # row 3 token 1: an environment token
    lp_b = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, nan], [-0.5, nan, nan], [-1.0, -20.0, -3.0]])
    lp_teacher = torch.tensor([[-2.0, -2.0, -2.0], [-1.0, -1.0, 0.0], [-3.0, 0.0, 0.0], [-0.5, -30.0, -0.5]])
    scored = {"completion_mask": completion_mask, "tool_mask": tool_mask, "sampling_per_token_logps": lp_b,
              "old_per_token_logps": torch.zeros(4, 3), "advantages": torch.zeros(4)}  # fmt: skip
    cfg = DistillConfig(adv_tau=0.5, teacher_tau=1.0, student_tau=0.5, use_full_reward_baseline=True,
                        kl_only_incorrect=False, skip_verification=False, teacher_context="")  # fmt: skip
    result = _Stub(cfg, torch.tensor([1.0, 0.0, 0.0, 1.0]), lp_teacher).distill_score(dict(scored), [])
    # R0 = 0.5 - 6 + 1.5 = -4;  R1 = 0 - 2 + 2 = 0;  R2 = 0 - 3 + 0.25 = -2.75;  R3 = 0.5 - 1 + 2 = 1.5 (agent tokens)
    assert result.parts.total.tolist() == [-4.0, 0.0, -2.75, 1.5]
    # the estimator stage: distillation's advantage is the base
    assert estimate_advantages(torch.zeros(4), 2, distill=result).advantages.tolist() == [-2.0, 2.0, -2.125, 2.125]


def test_distill_on_k1_builds_advantages_from_the_generators_logprobs(tmp_path, monkeypatch):
    """A k = 1 strict run with pure distillation: every batch's student term is the generator's behaviour log-probs
    (which differ from the current policy's once the policy has moved), and the advantages equal the formula."""
    import test_offpolicy_trainer as tot

    from trl_ext.trainer import ExtGRPOTrainer

    seen = []

    class Spied(Distillation):
        def student_sampling_logps(self, batch):
            lp = super().student_sampling_logps(batch)
            t = self.trainer
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            with torch.no_grad():
                current = t._get_per_token_logps_and_entropies(t.model, ids, attn, ids.size(1) - batch[
                    "prompt_ids"].size(1))[0]  # fmt: skip
            seen.append({"lp": lp, "batch": batch, "current": current, "step": t.state.global_step})
            return lp

        def score_teacher(self, batch, prompts=None, render_kwargs=None):
            self.trainer._teacher = super().score_teacher(batch, prompts)
            return self.trainer._teacher

    class Spy(ExtGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            seen[-1].update(advantages=batch["advantages"].clone(), teacher=self._teacher)
            return batch

    from trl_ext import components

    monkeypatch.setitem(components.COMPONENTS, "distill", Spied)
    monkeypatch.setattr(tot, "ExtGRPOTrainer", Spy)  # the tiny trainer of test_offpolicy_trainer, spied on
    trainer = tot.make_trainer(tmp_path, max_async_level=1, strict_async_level=True, max_steps=3, beta=0.05,
                               teacher_context="w5 w6 w7", teacher_tau=1.0, student_tau=0.5, adv_tau=0.0,
                               skip_verification=True, learning_rate=5e-2)  # fmt: skip
    trainer.train()
    assert [s["step"] for s in seen] == [0, 1, 2]
    for s in seen:
        batch, mask = s["batch"], s["batch"]["completion_mask"].bool()
        assert s["lp"] is batch["sampling_per_token_logps"] and "behaviour_versions" in batch
        r = (torch.where(mask, s["teacher"], 0.0).sum(1) - 0.5 * torch.where(mask, s["lp"], 0.0).sum(1)).view(-1, 4)
        expected = (r - r.mean(1, keepdim=True)).view(-1)
        assert torch.allclose(s["advantages"], expected, rtol=0, atol=1e-5)
    lag1 = seen[2]  # sampled by policy 1, trained at step 2 by policy 2: the two log-probs differ
    diff = (lag1["lp"] - lag1["current"])[lag1["batch"]["completion_mask"].bool()].abs().max().item()
    assert diff > 1e-3
