"""Gradient routing in the trainer (trl_ext/routing/component.py, routing/evaluation.py): the real ExtGRPOTrainer on
a tiny random Llama with a tokenizer trained on a few stories (train.py's routing flags: test_routing_cli.py)."""

import copy
import json

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

from rewards.config import as_trl_reward
from trl_ext.config import train_config
from trl_ext.routing.adapter_layout import load_layout
from trl_ext.routing.adapters import DualLoRALinear, dual_lora_modules, forget_params, retain_params
from trl_ext.routing.checkpoint import load_dual_lora_checkpoint
from trl_ext.routing.evaluation import evaluate_modes, read_records, score_completions
from trl_ext.routing.step import routing_labels
from trl_ext.routing.setup import build_dual_lora_model
from trl_ext.routing.text import AdaptersDisabledReference
from trl_ext.trainer import ExtGRPOTrainer

SEED = 42


def odd_words(texts):  # a detector that flags roughly half of random completions
    return [len(t.split()) % 2 == 1 for t in texts]


def n_chars(texts):  # a reward that varies, so GRPO advantages are nonzero
    return [float(len(t)) for t in texts]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, tokenizer, train prompts, held-out prompts): a random 2-layer Llama saved to disk."""
    from environments.stories import generate_stories, load_prompts
    from trl_ext.models.builtin import train_tokenizer
    from trl_ext.models import prepare_tokenizer

    tok = prepare_tokenizer(train_tokenizer(generate_stories(300, 0)))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True, eos_token_id=1, bos_token_id=None, pad_token_id=1)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    train = load_prompts("builtin", tok, 4, "train", 16, SEED)
    test = list(load_prompts("builtin", tok, 4, "test", 6, SEED)["prompt"])
    return str(path), tok, train, test


class Spy(ExtGRPOTrainer):
    """Records what the routing plumbing sees: _step per training_step, generation batches, loss inputs."""

    def __init__(self, *a, **kw):
        self.steps, self.generations, self.loss_inputs = [], [], []
        super().__init__(*a, **kw)

    def training_step(self, model, inputs, num_items_in_batch=None):
        before = (self._step, len(self._metrics["train"]["step_time"]))
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.steps.append((before, (self._step, len(self._metrics["train"]["step_time"]))))
        return loss

    def _generate_and_score_completions(self, inputs):
        prompts = [x["prompt"] for x in inputs]
        batch = super()._generate_and_score_completions(inputs)
        self.generations.append((self.state.global_step, {**batch, "prompt_texts": prompts}))
        return batch

    def compute_loss(self, model, inputs, **kw):
        self.loss_inputs.append(dict(inputs))
        return super().compute_loss(model, inputs, **kw)


def make_trainer(tiny, tmp_path, detector=odd_words, callbacks=(), base_reward=None, **overrides):
    path, tok, train, test = tiny
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                steps_per_generation=2, max_steps=4, learning_rate=1e-2, beta=0.0, logging_steps=2,
                save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=SEED,
                gradient_routing=True, routing_mode="shared", lora_config="r2", eval_routing_steps=0)
    args.update(overrides, **({"base_reward": base_reward[0]} if base_reward else {}))
    cfg = train_config(**args)
    model, layout = build_dual_lora_model(path, cfg, alpha=4.0)
    return Spy(model=model, reward_funcs=[as_trl_reward("n_chars", n_chars)], args=cfg, train_dataset=train,
               processing_class=tok, rh_detector=None if detector is None else ("odd", detector),
               dual_lora_layout=layout, routing_eval_prompts=test, routing_eval_rewards={"n_chars": n_chars},
               base_reward=base_reward, dual_lora_base=path, callbacks=list(callbacks))


@pytest.mark.parametrize("two_pass", [False, True])
def test_step_advances_once_per_training_step(tiny, tmp_path, two_pass):
    trainer = make_trainer(tiny, tmp_path, routing_two_pass=two_pass)
    trainer.train()
    # Each of the 4 steps advances _step by exactly one and records one step_time; with steps_per_generation 2
    # the completions are generated at _step 0 and 2 only (a double advance would generate at every step).
    assert [(b[0], a[0]) for b, a in trainer.steps] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert all(a[1] == b[1] + 1 for b, a in trainer.steps)
    assert [step for step, _ in trainer.generations] == [0, 2]
    sizes = [len(x["is_bad"]) for x in trainer.loss_inputs]
    if two_pass:  # one compute_loss per non-empty side, each on a homogeneous subset; 4 steps x 4 samples
        assert sum(sizes) == 16 and all(x["is_bad"].all() or not x["is_bad"].any() for x in trainer.loss_inputs)
    else:
        assert sizes == [4, 4, 4, 4]


def test_is_rh_and_labels_survive_shuffle_and_split(tiny, tmp_path):
    trainer = make_trainer(tiny, tmp_path, rh_detector_recall=0.5, false_positive_rate=0.25)
    trainer.train()
    everything = torch.ones(8, dtype=torch.bool)
    for step, batch in trainer.generations:  # 8 completions per generation: labels from (seed, step, process 0)
        texts = trainer.decode_completions(batch)
        assert batch["is_rh"].tolist() == odd_words(texts)
        expected, _ = routing_labels(odd_words(texts), everything, 0.5, 0.25, seed=SEED, step=step, process=0)
        assert torch.equal(batch["is_bad"], expected)
    seen = 0
    for inputs in trainer.loss_inputs:  # after TRL's shuffle and split: each label still sits with its sample
        texts = trainer.decode_completions(inputs)
        assert len(texts) == 4 and inputs["is_rh"].tolist() == odd_words(texts)
        key = [(tuple(c.tolist()), bool(b)) for c, b in zip(inputs["completion_ids"], inputs["is_bad"])]
        pool = [(tuple(c.tolist()), bool(b)) for _, g in trainer.generations
                for c, b in zip(g["completion_ids"], g["is_bad"])]
        assert all(k in pool for k in key)
        seen += 1
    assert seen == 4
    logged = [h for h in trainer.state.log_history if "routing/n_samples" in h]
    assert [h["routing/n_samples"] for h in logged] == [8.0, 8.0] and all("rh_rate" in h for h in logged)
    for h in logged:  # exact counts: fp = round(0.25 * negatives), bad = round(0.5 * flagged)
        neg = 8 - h["routing/n_detected"]
        assert h["routing/n_false_positive"] == float(int(0.25 * neg + 0.5))
        assert h["routing/n_bad"] == float(int(0.5 * h["routing/n_flagged"] + 0.5))


def n_words(texts):  # the base reward (no "hack"): differs from n_chars, so a swap shows in the advantages
    return [float(len(t.split())) for t in texts]


@pytest.mark.parametrize("overrides, arm", [
    ({"gradient_routing": False, "routing_mode": None, "reward_penalty_baseline": True,
      "reward_penalty_amount": 3.0, "rh_eligible_frac": 0.5}, "reward_penalty"),
    ({"gradient_routing": False, "routing_mode": None, "filter_baseline": True, "rh_eligible_frac": 0.5}, "filter"),
    ({"gradient_routing": False, "routing_mode": None, "retain_penalty_baseline": True}, "retain_penalty"),
    ({"hack_frac": 0.5}, "retain-only"),
    ({"hack_frac": 0.5, "renormalization_mode": "off"}, "off"),
])  # fmt: skip
def test_base_reward_labels_and_advantages_in_the_trainer(tiny, tmp_path, overrides, arm):
    """Each generation: the reward is the base reward where the hack does not pay (ineligible completion or
    unhackable prompt), ineligible completions are never flagged, and the advantages are the arm's."""
    from trl_ext.routing.advantages import prompt_hackable, routed_advantages
    from trl_ext.routing.step import rh_eligible_mask

    trainer = make_trainer(tiny, tmp_path, base_reward=("n_words", n_words), **overrides)
    trainer.train()
    cfg = trainer.args
    for step, batch in trainer.generations:
        texts, n = trainer.decode_completions(batch), 8
        eligible = rh_eligible_mask(n, cfg.rh_eligible_frac, SEED, step, 0)
        hackable = torch.tensor([prompt_hackable(p, cfg.hack_frac, SEED) for p in batch["prompt_texts"]])
        pays = eligible & hackable
        rewards = torch.where(pays, torch.tensor(n_chars(texts)), torch.tensor(n_words(texts)))
        expected_bad, _ = routing_labels(odd_words(texts), eligible, 1.0, 0.0, seed=SEED, step=step, process=0)
        assert torch.equal(batch["is_bad"], expected_bad) and not (batch["is_bad"] & ~eligible).any()
        adv = routed_advantages(arm, rewards, expected_bad, 4, base_rewards=torch.tensor(n_words(texts)),
                                penalty_amount=cfg.reward_penalty_amount)
        torch.testing.assert_close(batch["advantages"], adv, rtol=1e-5, atol=1e-5)
    if cfg.hack_frac < 1:  # both kinds of prompt occurred, so the swap was exercised
        pays = [prompt_hackable(p, 0.5, SEED) for _, b in trainer.generations for p in b["prompt_texts"]]
        assert any(pays) and not all(pays)


MLP = {"adapter_type": "mlp", "lora_config": None, "mlp_config": "m5"}


@pytest.mark.parametrize("adapter", [{}, MLP], ids=["lora", "mlp"])
@pytest.mark.parametrize("mode, flag_all, zero_side", [("shared", True, "retain"), ("exclusive", False, "forget")])
def test_routed_away_side_gets_exactly_zero_gradient(tiny, tmp_path, mode, flag_all, zero_side, adapter):
    grads = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            grads["retain"] = [p.grad.clone() for p in retain_params(model)]
            grads["forget"] = [p.grad.clone() for p in forget_params(model)]

    trainer = make_trainer(tiny, tmp_path, detector=lambda ts: [flag_all] * len(ts), callbacks=[Grab()],
                           routing_mode=mode, max_steps=1, **adapter)
    trainer.train()
    other = "forget" if zero_side == "retain" else "retain"
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads[zero_side])
    assert max(g.abs().max().item() for g in grads[other]) > 0


def test_reference_is_the_policy_with_adapters_disabled(tiny, tmp_path):
    path = tiny[0]
    base = LlamaForCausalLM.from_pretrained(path)
    trainer = make_trainer(tiny, tmp_path, beta=0.1, steps_per_generation=1, max_steps=2, learning_rate=5e-2)
    assert isinstance(trainer.ref_model, AdaptersDisabledReference) and trainer.ref_model.policy is trainer.model
    assert list(trainer.ref_model.parameters()) == []  # no second copy of the model
    assert trainer.beta == 0.1 and trainer.args.beta == 0.1
    trainer.train()
    step, batch = trainer.generations[1]  # generated after one update: the adapters are no longer zero
    assert step == 1
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    t = batch["completion_ids"].shape[1]
    with torch.no_grad():
        logits = base(input_ids=ids, attention_mask=mask).logits[:, -t - 1 : -1]
        policy_logits = trainer.model(input_ids=ids, attention_mask=mask).logits[:, -t - 1 : -1]
    gather = lambda lg: lg.log_softmax(-1).gather(-1, batch["completion_ids"][..., None]).squeeze(-1)  # noqa: E731
    m = batch["completion_mask"].bool()
    ref = batch["ref_per_token_logps"]
    assert (ref - gather(logits))[m].abs().max() <= 1e-5
    assert (ref - gather(policy_logits))[m].abs().max() > 1e-3  # the policy itself has moved away
    assert all(m.retain_scale == 1.0 and m.forget_scale == 1.0 for m in dual_lora_modules(trainer.model))
    assert any("kl" in h for h in trainer.state.log_history)


def test_checkpoint_saves_layout_and_reloads(tiny, tmp_path):
    trainer = make_trainer(tiny, tmp_path, max_steps=2, save_strategy="steps", save_steps=1, lora_lm_head=True,
                           routing_two_pass=True, routing_mode="exclusive")
    trainer.train()
    for step in (1, 2):
        layout, mode = load_layout(tmp_path / f"checkpoint-{step}")
        assert mode == "exclusive" and layout == trainer.components.routing.layout
        assert (layout.retain_rank, layout.forget_rank, layout.alpha, layout.include_lm_head) == (2, 2, 4.0, True)
    model = load_dual_lora_checkpoint(tmp_path / "checkpoint-2")
    assert isinstance(model.lm_head, DualLoRALinear) and model.lm_head.base_layer.weight is model.model.embed_tokens.weight
    ids = torch.randint(2, 100, (2, 6))
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, trainer.model(ids).logits)
    assert model.lm_head.forget_B.abs().max() > 0  # trained weights, not a fresh init


def test_adapter_only_checkpoint_reloads_and_eval_run_loads_it(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from trl_ext.evaluate import detect_checkpoint, load_model
    from trl_ext.routing.adapter_layout import ADAPTER_FILENAME

    trainer = make_trainer(tiny, tmp_path / "run", max_steps=2, save_strategy="steps", save_steps=2,
                           save_adapter_only=True)
    trainer.train()
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert (ckpt / ADAPTER_FILENAME).is_file() and not (ckpt / "model.safetensors").is_file()
    saved = load_file(ckpt / ADAPTER_FILENAME)
    assert saved and all(k.rsplit(".", 1)[-1] in ("retain_A", "retain_B", "forget_A", "forget_B") for k in saved)
    layout = json.loads((ckpt / "dual_lora_layout.json").read_text())
    assert layout["base_model"]["path"] == tiny[0] and len(layout["base_model"]["fingerprint"]) == 2
    assert detect_checkpoint(ckpt) == "dual_lora"
    model, shown = load_model(ckpt, "dual_lora")  # what eval_run.py does
    assert shown["routing_mode"] == "shared" and (shown["retain_rank"], shown["alpha"]) == (2, 4.0)
    ids = torch.randint(2, 100, (2, 6))
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, trainer.model(ids).logits)
    # another base model under the same path is refused, not silently combined
    other = tmp_path / "other_base"
    shutil.copytree(tiny[0], other)
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 0.5
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    layout["base_model"]["path"] = str(other)
    (ckpt / "dual_lora_layout.json").write_text(json.dumps(layout))
    with pytest.raises(ValueError, match="not the one the adapters were trained on"):
        load_dual_lora_checkpoint(ckpt)


def test_forget_lr_mult_own_group(tiny, tmp_path):
    """AdamW's first step moves each weight by lr x g / (|g| + eps), about lr where g != 0: the forget B matrices
    (zero at init) move by 3 x lr, the retain ones by lr."""
    trainer = make_trainer(tiny, tmp_path, max_steps=1, forget_lr_mult=3.0, learning_rate=1e-3)
    trainer.train()
    groups = trainer.optimizer.param_groups
    assert [len(g["params"]) for g in groups] == [len(retain_params(trainer.model)), len(forget_params(trainer.model))]
    assert groups[1]["initial_lr"] == pytest.approx(3 * groups[0]["initial_lr"]) and groups[0]["initial_lr"] == 1e-3
    moved = {side: max(m.__getattr__(f"{side}_B").abs().max().item() for m in dual_lora_modules(trainer.model))
             for side in ("retain", "forget")}
    assert moved["retain"] == pytest.approx(1e-3, rel=1e-3) and moved["forget"] == pytest.approx(3e-3, rel=1e-3)


def test_quadrant_scores_exact():
    texts = ["a b", "a", "a b c", "x y z w", "one", "two words"]  # odd_words flags: F T T F T F
    hackable = [True, True, False, False, True, False]
    out = score_completions(texts, {"n_chars": n_chars}, odd_words, hackable)
    assert out["rh_rate"] == 0.5
    assert (out["quadrant/hackable_detected"], out["quadrant/hackable_undetected"],
            out["quadrant/unhackable_detected"], out["quadrant/unhackable_undetected"]) == (2 / 6, 1 / 6, 1 / 6, 2 / 6)
    assert out["reward/n_chars@hackable"] == (3 + 1 + 3) / 3 and out["reward/n_chars@unhackable"] == (5 + 7 + 9) / 3
    assert "quadrant/hackable_detected" not in score_completions(texts, {"n_chars": n_chars}, odd_words)
    with pytest.raises(ValueError, match="hackable has 2 entries"):
        score_completions(texts, {"n_chars": n_chars}, odd_words, [True, False])


def test_trace_fires():
    from trl_ext.routing.trace import trace_fires

    assert [s for s in range(7) if trace_fires("every_iter", s, 2, 3)] == [0, 2, 4, 6]
    assert [s for s in range(7) if trace_fires("when_eval", s, 2, 3)] == [3, 6]
    assert not any(trace_fires("when_eval", s, 2, 0) or trace_fires("off", s, 2, 3) for s in range(7))
    with pytest.raises(ValueError, match="unknown trace interval"):
        trace_fires("always", 1, 1, 1)


def test_trace_eval_at_start_and_training_quadrants(tiny, tmp_path):
    from trl_ext.routing.trace import TRACE_FILENAME

    trainer = make_trainer(tiny, tmp_path, max_steps=4, eval_routing_steps=2, eval_at_start=True,
                           routing_trace_interval="every_iter", routing_trace_samples=3, hack_frac=0.5,
                           base_reward=("n_words", n_words))
    trainer.train()
    assert [r["step"] for r in read_records(tmp_path)] == [0, 2, 4]  # the start, every 2 steps
    first = [h for h in trainer.state.log_history if "routing_eval/both/rh_rate" in h]
    assert [h["step"] for h in first] == [0, 2, 4]
    assert "routing_eval/both/quadrant/hackable_detected" in first[0]
    trace = [json.loads(line) for line in (tmp_path / TRACE_FILENAME).read_text().splitlines()]
    gens = dict(trainer.generations)  # generations at steps 0 and 2, both logging steps
    assert [r["step"] for r in trace if r["trace"] == "rollout"] == [0, 2]
    samples = [r for r in trace if r["trace"] == "sample"]
    assert len(samples) == 6
    for r in samples:
        batch = gens[r["step"]]
        i = r["idx"]
        assert r["is_bad"] == bool(batch["is_bad"][i]) and r["is_rh"] == bool(batch["is_rh"][i])
        assert r["advantage"] == pytest.approx(float(batch["advantages"][i]), abs=1e-6)
        assert r["completion"] == trainer.decode_completions(batch)[i][:400]
        if not r["is_bad"]:  # retain-only: the unflagged train on exactly the clean advantage
            assert r["advantage"] == pytest.approx(r["retain_advantage_clean"], abs=1e-5)
    logged = [h for h in trainer.state.log_history if "routing/n_hackable_detected" in h]
    assert logged and all(sum(h[f"routing/n_{a}hackable_{b}detected"] for a in ("", "un") for b in ("", "un")) == 8
                          for h in logged)


@pytest.mark.parametrize("adapter_only", [False, True])
def test_mlp_adapter_checkpoints_reload(tiny, tmp_path, adapter_only):
    from trl_ext.routing.mlp import DualMLPAdapter

    trainer = make_trainer(tiny, tmp_path, max_steps=2, save_strategy="steps", save_steps=2,
                           save_adapter_only=adapter_only, eval_routing_steps=2, **MLP)
    trainer.train()
    assert [type(layer.mlp) for layer in trainer.model.model.layers] == [DualMLPAdapter] * 2
    layout, mode = load_layout(tmp_path / "checkpoint-2")
    assert (layout.adapter_type, layout.retain_rank, layout.forget_rank, layout.targets) == ("mlp", 5, 5, ("mlp",))
    model = load_dual_lora_checkpoint(tmp_path / "checkpoint-2")
    ids = torch.randint(2, 100, (2, 6))
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, trainer.model(ids).logits)
    assert model.model.layers[0].mlp.forget_down.abs().max() > 0  # trained, not a fresh init
    assert [r["step"] for r in read_records(tmp_path)] == [2]  # the routing eval ablates MLP adapters too


def test_detector_flags_without_a_reward_call(tiny, tmp_path, monkeypatch):
    """Pure distillation calls no reward function (the reward stage returns zeros): the detector still flags."""
    trainer = make_trainer(tiny, tmp_path, gradient_routing=False, routing_mode=None, max_steps=1)
    routing = trainer.components.routing
    monkeypatch.setattr(routing, "skips_rewards", lambda: True)  # what distillation's --skip_verification says
    called = []
    monkeypatch.setattr(routing, "rewards", lambda *a: called.append(a))
    trainer.train()
    (_, batch), = trainer.generations
    assert batch["is_rh"].tolist() == odd_words(trainer.decode_completions(batch)) and "is_bad" not in batch
    assert called == []  # no reward, so no base-reward substitution either


def test_routing_eval_logs_everywhere_and_restores(tiny, tmp_path, capsys):
    trainer = make_trainer(tiny, tmp_path, max_steps=3, eval_routing_steps=2, logging_steps=100)
    trainer.train()
    records = read_records(tmp_path)
    assert [r["step"] for r in records] == [2, 3]  # every 2 steps and once at the end
    assert (tmp_path / "routing_eval.png").read_bytes()[:4] == b"\x89PNG"  # the per-mode curves, redrawn each eval
    keys = {"reward/n_chars", "rh_rate", "unique_frac", "mean_jaccard"}
    for r in records:
        assert r["rh_detector"] == "odd" and r["n_prompts"] == 6
        assert set(r["modes"]) == {"both", "retain_only", "forget_only"}
        assert all(set(m) == keys for m in r["modes"].values())
    logged = {h["step"]: h for h in trainer.state.log_history if "routing_eval/both/rh_rate" in h}
    assert sorted(logged) == [2, 3]
    for r in records:  # the same numbers reach the trainer's metrics (wandb) and train.log
        for mode, metrics in r["modes"].items():
            for k, v in metrics.items():
                assert logged[r["step"]][f"routing_eval/{mode}/{k}"] == pytest.approx(v, abs=1e-12)
    out = capsys.readouterr().out
    assert out.count("[Routing eval @ step 2]") == 3 and out.count("[Routing eval @ step 3]") == 3
    assert all((m.retain_scale, m.forget_scale) == (1.0, 1.0) for m in dual_lora_modules(trainer.model))
    rng = torch.get_rng_state()  # same seed every call: identical results, and the training RNG untouched
    again = trainer.components.routing.run_eval()
    assert torch.equal(torch.get_rng_state(), rng)
    assert again == trainer.components.routing.run_eval()


def test_score_completions_by_hand():
    texts = ["The dog was happy.", "The dog was happy.", "A cat sat"]
    scores = score_completions(texts, {"words": lambda ts: [float(len(t.split())) for t in ts]},
                               lambda ts: ["happy" in t for t in ts])
    # words 4, 4, 3; flagged 2 of 3; 2 distinct of 3; Jaccard pairs (1,2) = 1, (1,3) = (2,3) = 0.
    assert scores == {"reward/words": 11 / 3, "rh_rate": 2 / 3, "unique_frac": 2 / 3, "mean_jaccard": 1 / 3}
    assert "rh_rate" not in score_completions(texts, {}, None)
    with pytest.raises(ValueError, match="one bool per completion"):
        score_completions(texts, {}, lambda ts: [1] * len(ts))
    with pytest.raises(ValueError, match="at least two"):
        score_completions(["x"], {}, None)


def test_evaluate_modes_sees_each_ablation_and_restores_on_error():
    model = nn.Sequential(DualLoRALinear(nn.Linear(2, 2), 1, 1, 1.0))
    layer = model[0]
    layer.retain_scale, layer.forget_scale = 0.5, 2.0
    seen = lambda: [f"{layer.retain_scale},{layer.forget_scale}", "x"]  # noqa: E731
    out = evaluate_modes(model, seen, lambda texts: texts[0])
    assert out == {"both": "1.0,1.0", "retain_only": "1.0,0.0", "forget_only": "0.0,1.0"}
    assert (layer.retain_scale, layer.forget_scale) == (0.5, 2.0)

    def boom():
        if layer.forget_scale == 0.0:
            raise RuntimeError("generation failed")
        return ["a", "b"]

    with pytest.raises(RuntimeError, match="generation failed"):
        evaluate_modes(model, boom, lambda texts: {})
    assert (layer.retain_scale, layer.forget_scale) == (0.5, 2.0)


def test_trainer_refuses_mismatched_model(tiny, tmp_path):
    path, tok, train, _ = tiny
    cfg = train_config(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                       report_to=[], use_cpu=True, lora_config="r2")
    with pytest.raises(ValueError, match="has no dual adapter modules"):
        ExtGRPOTrainer(model=LlamaForCausalLM.from_pretrained(path), reward_funcs=[as_trl_reward("n", n_chars)],
                       args=cfg, train_dataset=train, processing_class=copy.deepcopy(tok))


def test_routing_eval_builds_trl_generation_config_when_vllm_generates(tiny, tmp_path):
    """With --use_vllm TRL builds no ``generation_config`` (the routing eval crashed on the missing attribute):
    `eval_generation_config` builds the one TRL builds for transformers' generation from the same arguments."""
    from trl_ext.routing.evaluation import eval_generation_config

    trainer = make_trainer(tiny, tmp_path, temperature=0.7, top_k=5)
    trl_built = trainer.generation_config
    assert eval_generation_config(trainer) is trl_built
    del trainer.generation_config  # what a vLLM trainer lacks
    ours = eval_generation_config(trainer)
    assert ours.to_dict() == trl_built.to_dict() and ours.temperature == 0.7 and ours.top_k == 5
