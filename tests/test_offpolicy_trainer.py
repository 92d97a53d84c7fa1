"""Off-policy training through the trainer: flags and their errors (exit 2 before any model is loaded), the
gradient against stock TRL, the strict schedule, in-flight updates, resume, and the builtin model end to end."""

import collections
import json
import os
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path

import pytest
import zygote
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOTrainer

import trl_ext.cli_train as cli
import trl_ext.offpolicy.component as opt
from trl_ext.offpolicy.args import OffPolicyArgs
from trl_ext.config import train_config
from trl_ext.interfaces import SamplingParams
from trl_ext.offpolicy.importance import NO_MASK, PRIME_RL_DEFAULTS
from trl_ext.offpolicy.worker import generation_copy, sample
from trl_ext.trainer import ExtGRPOTrainer

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- flags and errors




@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--max_async_level", "-1"], "--max_async_level must be >= 0"),
        (["--strict_async_level"], "--strict_async_level needs --max_async_level >= 1"),
        (["--max_async_level", "1", "--token_mask_low", "8", "--token_mask_high", "8"], "token_mask_low (8.0) must"),
        (["--max_async_level", "1", "--sequence_mask_low", "200"], "sequence_mask_low (200.0) must be <"),
        (["--max_async_level", "1", "--geo_mask_low", "10", "--geo_mask_high", "0.1"], "geo_mask_low (10.0) must be <"),
        (["--max_async_level", "1", "--sequence_clip_high", "0"], "sequence_clip_high must be > 0"),
        (["--max_async_level", "1", "--token_clip_high", "-2"], "token_clip_high must be > 0"),
        (["--max_async_level", "1", "--ratio_type", "geo"], "ratio_type"),
        (["--max_async_level", "1", "--kl_tau", "-1"], "kl_tau must be >= 0"),
        (["--max_async_level", "1", "--generator_threads", "-1"], "--generator_threads must be >= 0"),
        (["--token_mask_high", "4"], "--token_mask_high has no effect with --max_async_level 0"),
        (["--max_async_level", "2", "--epsilon", "0.3"], "--epsilon 0.3 is not supported with --max_async_level 2"),
        (["--max_async_level", "2", "--num_iterations", "2"], "--num_iterations"),
        (["--max_async_level", "2", "--loss_type", "cispo"], "dr_grpo"),
        (["--max_async_level", "2", "--temperature", "0"], "--temperature > 0"),
    ],
)
def test_bad_flags_exit_2(train_cli_error, argv, needle):
    assert needle in train_cli_error("--reward", "happy_binary", *argv)


def test_every_seed_flag_exists_with_prime_rl_defaults(tmp_path):
    seed_flags = ["--max_async_level", "4", "--strict_async_level", "--token_mask_low", "0", "--token_mask_high",
                  "1e10", "--sequence_mask_low", "0", "--sequence_mask_high", "1e10", "--geo_mask_low", "0",
                  "--geo_mask_high", "1e10", "--sequence_clip_high", "1e10", "--token_clip_high", "4", "--kl_tau",
                  "1e-3", "--ratio_type", "token", "--loss_adv_tau", "1"]  # fmt: skip
    plan = cli.build_plan(["--reward", "happy_binary", "--output_dir", str(tmp_path), *seed_flags])
    assert plan.cfg.max_async_level == 4 and plan.cfg.strict_async_level and plan.cfg.token_clip_high == 4
    assert {n: getattr(plan.cfg, n) for n in NO_MASK if n != "token_clip_high"} == {
        n: v for n, v in NO_MASK.items() if n != "token_clip_high"
    }
    defaults = {f.name: f.default for f in fields(OffPolicyArgs)}
    assert {n: defaults[n] for n in PRIME_RL_DEFAULTS} == PRIME_RL_DEFAULTS
    # prime-rl's values, written out: token mask [1/8, 8], geo [0.1, 10], sequence [0, 100], sequence clip 10
    assert (defaults["token_mask_low"], defaults["token_mask_high"]) == (0.125, 8.0)
    assert (defaults["geo_mask_low"], defaults["geo_mask_high"], defaults["sequence_clip_high"]) == (0.1, 10.0, 10.0)
    assert defaults["max_async_level"] == 0 and defaults["strict_async_level"] is False


# ---------------------------------------------------------------- tiny trainer

WORDS = ["[UNK]", "[EOS]"] + [f"w{i}" for i in range(62)]


def tiny_tokenizer():
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]", pad_token="[EOS]",
                                   padding_side="left")  # fmt: skip


def tiny_model_dir(tmp_path) -> str:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=1, pad_token_id=1)  # fmt: skip
    path = tmp_path / "tiny"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


PROMPTS = Dataset.from_dict(
    {"prompt": [" ".join(f"w{(i * 7 + j) % 60 + 2}" for j in range(2 + i % 3)) for i in range(64)]}
)


def length_reward(completions, **kwargs):
    return [float(len(c.split()) % 3 == 0) for c in completions]


def make_trainer(tmp_path, callbacks=(), **over):
    cfg = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
               max_completion_length=8, max_steps=7, beta=0.0, learning_rate=1e-2, logging_steps=1,
               save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)  # fmt: skip
    model_dir = over.pop("model_dir", None) or tiny_model_dir(tmp_path)
    return ExtGRPOTrainer(model=model_dir, reward_funcs=[length_reward], args=train_config(**{**cfg, **over}),
                          train_dataset=PROMPTS, processing_class=tiny_tokenizer(),
                          callbacks=list(callbacks))  # fmt: skip


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


# ---------------------------------------------------------------- loss == stock TRL at ratio 1


def _batch(trainer):
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(2, 64, (6, 4), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :2] = prompt_mask[4, :1] = 0  # left padding
    completion_ids = torch.randint(2, 64, (6, 5), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[0, 3:] = completion_mask[2, 1:] = completion_mask[5, 4:] = 0  # right padding
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": torch.randn(6, generator=g),
              "num_items_in_batch": completion_mask.sum() * 2}  # fmt: skip
    ids, attn = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        inputs["sampling_per_token_logps"] = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, 5)[0]
        if trainer.beta:
            ref = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, attn, 5)[0]
            inputs["ref_per_token_logps"] = ref
    return inputs


def _offpolicy_loss(trainer, model, inputs):
    return trainer.components.offpolicy.loss(model, inputs)[0]


def _grads(trainer, loss_fn, inputs):
    trainer.model.zero_grad()
    loss = loss_fn(trainer, trainer.model, inputs)
    loss.backward()  # the loss values differ (surrogates -A*lp vs -A*exp(lp - sg(lp))), the gradients may not
    return [p.grad.clone() for p in trainer.model.parameters()]


@pytest.mark.parametrize("masks", ["no_mask", "prime_rl"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_gradient_equals_stock_trl_on_policy(tmp_path, loss_type, beta, masks):
    """Behaviour log-probs = the trainer's own: our loss and TRL's give the same parameter gradient, for each
    normalisation, with gradient accumulation 2 and the KL term (policy moved away from the reference)."""
    over = NO_MASK if masks == "no_mask" else {}
    trainer = make_trainer(tmp_path, max_async_level=1, loss_type=loss_type, beta=beta, gradient_accumulation_steps=2,
                           **over)  # fmt: skip
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in trainer.model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    inputs = _batch(trainer)
    ours = _grads(trainer, _offpolicy_loss, inputs)
    stock = _grads(trainer, GRPOTrainer._compute_loss, inputs)
    assert trainer._metrics["train"]["offpolicy/ratio_mean"] == [1.0]  # ours ran, at ratio exactly 1
    assert max((a - b).abs().max().item() for a, b in zip(ours, stock, strict=True)) < 1e-6
    assert max(g.abs().max().item() for g in stock) > 1e-3  # a real gradient


@pytest.mark.parametrize("clip", [False, True])
def test_reference_kl_follows_masks_and_clip_through_trainer(tmp_path, clip):
    """beta > 0 off-policy: the reference log-probs of a dropped sequence (geo mask) and of a token-masked token
    move no gradient; with --token_clip_high the KL weight of a token whose ratio exceeds it is the clip."""
    over = {"token_clip_high": 1.5} if clip else {}
    trainer = make_trainer(tmp_path, max_async_level=1, beta=0.05, **over)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = _batch(trainer)
    lp_b = inputs["sampling_per_token_logps"].clone()
    lp_b[3] -= 3.0  # every ratio of row 3 is e^3 = 20 > 10: geo mask drops the row (and the token mask its tokens)
    lp_b[0, 0] += 3.0  # ratio e^-3 = 0.05 < 0.125: token 0 of row 0 dropped
    lp_b[1, 2] -= 0.6  # ratio e^0.6 = 1.82: kept, and clipped at 1.5 when clip
    inputs["sampling_per_token_logps"] = lp_b
    base = _grads(trainer, _offpolicy_loss, inputs)
    moved = dict(inputs, ref_per_token_logps=inputs["ref_per_token_logps"].clone())
    moved["ref_per_token_logps"][3] -= 2.0
    moved["ref_per_token_logps"][0, 0] -= 2.0
    assert max((a - b).abs().max().item() for a, b in zip(base, _grads(trainer, _offpolicy_loss,
                                                                         moved), strict=True)) == 0.0  # fmt: skip
    kept = dict(inputs, ref_per_token_logps=inputs["ref_per_token_logps"].clone())
    kept["ref_per_token_logps"][2, 0] -= 2.0  # a kept token: its reference log-prob does move the gradient
    assert max((a - b).abs().max().item() for a, b in zip(base, _grads(trainer, _offpolicy_loss,
                                                                         kept), strict=True)) > 1e-6  # fmt: skip
    metrics = trainer._metrics["train"]
    assert metrics["offpolicy/geo_masked_high_frac"][-1] == pytest.approx(1 / 6)
    # 23 loss tokens; ratio > 1.5: row 1 token 2 and the 5 tokens of row 3 (the metric counts dropped tokens too)
    assert metrics["offpolicy/token_clipped_frac"][-1] == (pytest.approx(6 / 23) if clip else 0.0)


# ---------------------------------------------------------------- schedule through the trainer


@pytest.mark.parametrize("k, accumulation", [(1, 2), (4, 1)])
def test_strict_schedule_through_trainer(tmp_path, k, accumulation):
    trainer = make_trainer(tmp_path, max_async_level=k, strict_async_level=True,
                           gradient_accumulation_steps=accumulation)  # fmt: skip
    threads = torch.get_num_threads()
    trainer.train()
    assert trainer.components.offpolicy.trace == [(n, max(n - k, 0), max(n - k, 0)) for n in range(7)]
    assert logged(trainer, "offpolicy/policy_lag_max") == [float(min(n, k)) for n in range(7)]
    assert logged(trainer, "offpolicy/multi_version_seq_frac") == [0.0] * 7
    assert abs(logged(trainer, "offpolicy/ratio_mean")[0] - 1) < 1e-5  # step 0 is on-policy
    assert trainer.components.offpolicy.worker is None and torch.get_num_threads() == threads  # stopped, threads restored


def test_non_strict_in_flight_update_through_trainer(tmp_path, monkeypatch):
    """The generator pauses batch 1 before its 4th token until the trainer has published policy 1 (the trainer in
    turn waits until batch 1 has 3 tokens): the remaining tokens of batch 1 are policy 1's."""
    reached = threading.Event()

    class Paused(opt.RolloutWorker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.on_step = self.pause

        def pause(self, index, t):
            if index == 1 and t == 2:
                reached.set()
            if index == 1 and t == 3:
                for _ in range(3000):
                    if self.store.latest >= 1:
                        return
                    threading.Event().wait(0.01)
                raise TimeoutError("policy 1 never published")

    class HoldStep0(TrainerCallback):  # runs before the mixin's publishing callback
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                assert reached.wait(30)

    monkeypatch.setattr(opt, "RolloutWorker", Paused)
    trainer = make_trainer(tmp_path, callbacks=[HoldStep0()], max_async_level=1, max_steps=3,
                           max_completion_length=12)  # fmt: skip
    trainer.train()
    assert trainer.components.offpolicy.trace[:2] == [(0, 0, 0), (1, 0, 1)]
    assert all(lo >= n - 1 and hi <= n for n, lo, hi in trainer.components.offpolicy.trace)
    assert logged(trainer, "offpolicy/multi_version_seq_frac")[1] > 0


# ---------------------------------------------------------------- in-flight versions on a real sampler

SWITCH_AT = 4
"""`InflightRecorder`'s batches n >= 1: tokens before SWITCH_AT sampled by policy n - 1, the rest by policy n."""


def _cloned(state) -> dict:
    """A published snapshot's weights: a copy of the trainable tensors, or, for a vLLM engine's checkpoint directory
    (``trl_ext.vllm.publish``), the merged weights its files hold (read now: the publisher deletes old versions)."""
    if isinstance(state, str):
        from safetensors.torch import load_file

        return {k: v for f in sorted(Path(state).glob("*.safetensors")) for k, v in load_file(f).items()}
    return {name: tensor.detach().clone() for name, tensor in state.items()}


class InflightRecorder(opt.RolloutWorker):
    """The generator with a forced in-flight update, recorded: batch n >= 1 starts on policy n - 1 and, at its first
    decoding step at or after SWITCH_AT (a chunk start for vLLM), waits for policy n, whose publish the trainer holds
    until then. Keeps each published policy's weights (``published``) and each batch handed to the trainer
    (``rollouts``); ``last`` is the newest instance. Also the driver of tests/test_vllm.py's in-flight test (`save`)."""

    last = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        InflightRecorder.last, self.on_step, self.rollouts = self, self._pause, []
        self.reached: dict[int, threading.Event] = collections.defaultdict(threading.Event)
        if self.model is None:  # an engine: each version's checkpoint, as the store makes it
            self.published = {v: _cloned(s) for v, s in self.store._snapshots.items()}
            snapshot = self.store._snapshot

            def recorded(version, model):
                out = snapshot(version, model)
                self.published[version] = _cloned(out)
                return out

            self.store._snapshot = recorded
        else:  # the copy: its starting weights, then each version as the trainer writes it
            self.published = {self.loaded_version: _cloned(self.weights.params)}

    def publish(self, version, model):
        self.reached[version].wait(60)  # batch `version` is past SWITCH_AT tokens of the older policy
        super().publish(version, model)
        if self.model is not None:
            self.published[version] = _cloned({n: p for n, p in model.named_parameters() if p.requires_grad})

    def _pause(self, index, t):
        if index >= 1 and t >= SWITCH_AT and not self.reached[index].is_set():
            self.reached[index].set()
            deadline = time.monotonic() + 60
            while not (self.thread.stop.is_set() or self.store.latest >= index) and time.monotonic() < deadline:
                time.sleep(0.005)

    def get(self, index, poll_s=0.2):
        rollout = super().get(index, poll_s)
        self.rollouts.append(rollout)
        return rollout

    def save(self, path) -> None:
        fields_ = ("prompt_ids", "completion_ids", "logprobs", "versions")
        torch.save({"published": self.published, "temperature": self.params.temperature,
                    "rollouts": [{f: getattr(r, f) for f in fields_} for r in self.rollouts]}, path)  # fmt: skip


def _set_weights(model, state: dict) -> None:
    """``state``'s tensors into ``model``'s parameters of the same names; a checkpoint's other names (a tied head,
    written apart from the embedding) must equal what the model then holds under them."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            if name in params:
                params[name].copy_(tensor)
    full = model.state_dict()
    assert all(torch.equal(full[n], t) for n, t in state.items() if n not in params), "an aliased tensor differs"


@torch.no_grad()
def replay_logprobs(model, published, prompt_ids, completion_ids, step_versions, pad_id, temperature):
    """The fast sampler's computation teacher-forced: the left-padded prompts prefilled by policy
    ``step_versions[0]``, then completion token t - 1 fed by policy ``step_versions[t]`` onto the kept KV cache; per
    row, ``log_softmax(logits / temperature)`` of its tokens."""
    from transformers import DynamicCache
    from trl.trainer.utils import pad

    ids = pad([torch.tensor(p) for p in prompt_ids], padding_value=pad_id, padding_side="left")
    mask = pad([torch.ones(len(p), dtype=torch.long) for p in prompt_ids], padding_value=0, padding_side="left")
    width = max(map(len, completion_ids))
    tokens = torch.tensor([c + [pad_id] * (width - len(c)) for c in completion_ids])
    cache, out = DynamicCache(config=model.config), []
    for t in range(width):
        _set_weights(model, published[step_versions[t]])
        if t:
            ids, mask = tokens[:, t - 1 : t], torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
        out.append(torch.log_softmax(logits.float() / temperature, -1).gather(1, tokens[:, t : t + 1]))
    lp = torch.cat(out, 1)
    return [lp[i, : len(c)] for i, c in enumerate(completion_ids)]


@torch.no_grad()
def forced_logprobs(model, state, prompt_ids, completion_ids, temperature):
    """Teacher forcing under ``state``'s weights, each row unpadded from position 0 (right padding): per row,
    ``log_softmax(logits / temperature)`` of its completion tokens."""
    _set_weights(model, state)
    seqs = [p + c for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    lps = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float() / temperature, -1)
    return [lps[i, len(p) - 1 : len(p) - 1 + len(c)].gather(1, torch.tensor(c)[:, None])[:, 0]
            for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True))]  # fmt: skip


def test_inflight_tokens_carry_their_versions_logprobs(tmp_path, monkeypatch):
    """Non-strict k = 1 with the fast sampler, lr 1e-2, each batch n >= 1 switched from policy n - 1 to n after
    SWITCH_AT tokens (`InflightRecorder`): every token's behaviour log-prob is what its stamped policy gives, replayed
    with the sampler's kept KV cache (`replay_logprobs`), and the tokens stamped with the newer policy are far from
    what the older one gives (so a wrong stamp shows)."""
    monkeypatch.setattr(opt, "RolloutWorker", InflightRecorder)
    model_dir = tiny_model_dir(tmp_path)
    trainer = make_trainer(tmp_path, model_dir=model_dir, max_async_level=1, max_steps=4, max_completion_length=12,
                           generation_backend="fast")  # fmt: skip
    trainer.train()
    rec, model = InflightRecorder.last, LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad_id, temperature = rec.params.pad_token_id, rec.params.temperature
    own, other, split = [], [], 0
    for r in rec.rollouts:
        steps = max(r.versions, key=len)
        stamped = replay_logprobs(model, rec.published, r.prompt_ids, r.completion_ids, steps, pad_id, temperature)
        first = replay_logprobs(model, rec.published, r.prompt_ids, r.completion_ids, [steps[0]] * len(steps), pad_id,
                                temperature)  # fmt: skip
        for lp, versions, a, b in zip(r.logprobs, r.versions, stamped, first, strict=True):
            lp, newer = torch.tensor(lp), torch.tensor(versions) != versions[0]
            own.append((a - lp).abs())
            other.append((b - lp).abs()[newer])
            split += bool(newer.any())
    own, other = torch.cat(own), torch.cat(other)
    assert own.max() < 1e-5, own.max()  # measured 4.8e-7 (mean 1.5e-7, 342 tokens); stamps of the first version: 0.27
    assert split >= 16 and [r.version_range() for r in rec.rollouts] == [(0, 0), (0, 1), (1, 2), (2, 3)]
    assert other.min() > 1e-4 and other.mean() > 1e-2, other  # measured min 1.6e-3, mean 4.9e-2 (166 tokens)


def test_resume_regenerates_from_restored_policy(tmp_path):
    model_dir = tiny_model_dir(tmp_path)
    first = make_trainer(tmp_path, model_dir=model_dir, max_async_level=2, strict_async_level=True, max_steps=6,
                         save_strategy="steps", save_steps=3)  # fmt: skip
    first.train()
    assert first.components.offpolicy.trace == [(n, max(n - 2, 0), max(n - 2, 0)) for n in range(6)]
    resumed = make_trainer(tmp_path, model_dir=model_dir, max_async_level=2, strict_async_level=True, max_steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    # the queue starts empty at the restored policy 3: steps 3..5 use max(n - 2, 3) = 3, nothing from before
    assert resumed.components.offpolicy.trace == [(3, 3, 3), (4, 3, 3), (5, 3, 3)]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_prompt_stream_follows_trl_data_order(tmp_path, accumulation):
    """The generator's prompt batches are the generation batches TRL's dataloader would hand out, in order."""
    trainer = make_trainer(tmp_path, max_async_level=1, gradient_accumulation_steps=accumulation)
    loader = iter(trainer.get_train_dataloader())
    trl_batches = []
    for i in range(3 * accumulation):  # TRL repeats each generation batch steps_per_generation times
        batch = next(loader)
        if i % accumulation == 0:
            trl_batches.append([row["prompt"] for row in batch])
    ours = trainer.components.offpolicy._prompt_stream(0)
    assert [[row["prompt"] for row in next(ours)] for _ in range(3)] == trl_batches
    assert len(trl_batches[0]) == 8 * accumulation
    resumed = trainer.components.offpolicy._prompt_stream(2)
    assert [row["prompt"] for row in next(resumed)] == trl_batches[2]


def test_k0_is_stock_trl(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2)
    assert trainer.components.offpolicy is None
    assert not any(isinstance(c, opt._Generator) for c in trainer.callback_handler.callbacks)
    trainer.train()
    assert trainer.components.names() == ["routing"]  # no off-policy component: TRL's own generation and loss
    assert not any(k.startswith("offpolicy/") for h in trainer.state.log_history for k in h)
    assert logged(trainer, "clip_ratio/region_mean")  # TRL's own loss ran


# ---------------------------------------------------------------- builtin model


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 20)])
def test_sampler_logprobs_match_trainer_on_builtin(builtin_path, tmp_path, temperature, top_k):
    """Same weights (k = 0): the sampler's behaviour log-probs vs the fused-head trainer log-probs in float32: two
    summation orders, so equal to float32 rounding (max |log r| < 5e-5 over ~500 tokens, mean < 2e-6; the float64
    equality to 1e-10 is tests/test_generation.py's)."""
    from environments.stories import load_prompts
    from trl_ext.models import prepare_tokenizer

    tok = prepare_tokenizer(PreTrainedTokenizerFast.from_pretrained(str(builtin_path)))
    prompts = load_prompts("builtin", tok, 8, "train", 16, 0)
    trainer = ExtGRPOTrainer(model=str(builtin_path), reward_funcs=[length_reward], train_dataset=prompts,
                             processing_class=tok, args=train_config(output_dir=str(tmp_path), beta=0.0,
                             temperature=temperature, top_k=top_k, report_to=[], use_cpu=True))  # fmt: skip
    prompt_ids = tok(list(prompts["prompt"]), add_special_tokens=False)["input_ids"]
    params = SamplingParams(64, temperature, top_k, 1.0, tuple(trainer.eos_token_ids), tok.pad_token_id)
    out = sample(generation_copy(trainer.model), prompt_ids, params, torch.Generator().manual_seed(0))
    width = max(map(len, out.completion_ids))
    completion = torch.tensor([c + [tok.pad_token_id] * (width - len(c)) for c in out.completion_ids])
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in out.completion_ids])
    ids = torch.cat([torch.tensor(prompt_ids), completion], 1)
    attn = torch.cat([torch.ones(len(prompt_ids), 8, dtype=torch.long), mask], 1)
    with torch.no_grad():
        lp = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, width)[0]
    behaviour = torch.tensor([lp_ + [0.0] * (width - len(lp_)) for lp_ in out.logprobs])
    log_ratio = (lp - behaviour)[mask.bool()]
    print(f"max |log r| {log_ratio.abs().max().item():.2e}, mean {log_ratio.abs().mean().item():.2e}")
    assert log_ratio.numel() > 100 and log_ratio.abs().max().item() < 5e-5 and log_ratio.abs().mean().item() < 2e-6


@pytest.mark.slow
def test_train_py_strict_k1_on_builtin(builtin_path, tmp_path):
    flags = ["--reward", "happy_binary", "--lr", "3e-4", "--max_steps", "3", "--batch_size", "8",
             "--num_generations", "4", "--max_completion_length", "16", "--logging_steps", "1", "--save_steps", "3",
             "--no_wandb", "--output_dir", str(tmp_path), "--max_async_level", "1", "--strict_async_level",
             "--run_name", "offpolicy"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    proc = zygote.run([sys.executable, "train.py", *flags], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "offpolicy"
    assert "offpolicy/policy_lag_mean" in (run_dir / "train.log").read_text()
    state = json.loads((run_dir / "checkpoint-3" / "trainer_state.json").read_text())
    logs = [h for h in state["log_history"] if "offpolicy/policy_lag_max" in h]
    assert [h["offpolicy/policy_lag_max"] for h in logs] == [0.0, 1.0, 1.0]
    assert logs[0]["offpolicy/abs_log_ratio_mean"] < 1e-5 and abs(logs[0]["offpolicy/ratio_max"] - 1) < 1e-5
