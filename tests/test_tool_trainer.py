"""A tool environment (TRL's environment_factory convention) trained end to end by ExtGRPOTrainer with each extension:
synchronous, off-policy strict and in flight, gradient routing, distillation. A random tiny model writes no tool call,
so its turns are scripted: the synchronous path's generation is replaced (as TRL's own generation), the off-policy
generator's sampler forces the scripted tokens and records their real behaviour log-probs and policy versions."""

from __future__ import annotations

import threading
from unittest import mock

import pytest
import torch
from datasets import Dataset
from test_tool_episodes import Counter, call
from transformers import TrainerCallback

from trl_ext import ExtGRPOTrainer
from trl_ext.config import train_config

pytestmark = pytest.mark.slow

TURNS = [call("add", n=2), call("add", n=3), "done"]
SHORT = call("add", n=2)
"""Every episode: two tool calls, then a closing turn. The second call adds 3 in the even rows of a generation call
and 2 (`SHORT`) in the odd ones: of each group (two rollouts of one row, adjacent), one reaches the target 5 (reward
1) and one stops at 4 (reward 0)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from trl_ext.models.tiny import build_tiny, trl_template

    return str(build_tiny("qwen2", tmp_path_factory.mktemp("tiny_tools"), tokenizer="bytes",
                          chat_template=trl_template("qwen2_5"), positions=2048))  # fmt: skip


def dataset(n=16):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": "Count."}]] * n, "target": [5] * n})


def turn_ids(tok, context_ids, row: int) -> list[int]:
    k = min(tok.decode(context_ids).count("<tool_response>"), len(TURNS) - 1)
    text = SHORT if k == 1 and row % 2 else TURNS[k]
    return tok(text + "<|im_end|>", add_special_tokens=False)["input_ids"]


class Scripted(ExtGRPOTrainer):
    """TRL's generation replaced by the script; every generation batch recorded."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.batches = []

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return [turn_ids(self.processing_class, ids, i) for i, ids in enumerate(prompt_ids)], None

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        self.batches.append({k: v.detach().clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
        return batch


def forced_sampler(tok):
    """``make_sampler`` for the off-policy generator: the transformers sampler with each turn's tokens forced to the
    script's, their behaviour log-probs the model's own (``log_softmax(logits / T)`` at the forced token)."""
    from trl_ext.generation import hf_sampler

    class Forced(hf_sampler.HFSampler):
        def sample(self, prompt_ids, params, rng=None, before_step=None):
            forced = [turn_ids(tok, p, i) for i, p in enumerate(prompt_ids)]
            table = torch.full((len(forced), max(map(len, forced))), params.pad_token_id)
            for i, f in enumerate(forced):
                table[i, : len(f)] = torch.tensor(f)
            step = [0]

            def sample_step(logits, temperature, top_k, top_p, noise=None, rng=None):
                z = logits.float() / temperature
                t = table[:, step[0]].to(logits.device)
                step[0] += 1
                return t, z.gather(1, t[:, None]).squeeze(1) - z.logsumexp(-1)

            with mock.patch.object(hf_sampler, "sample_step", sample_step):
                return super().sample(prompt_ids, params, rng, before_step)

    return lambda backend, model: Forced(model)


def make(model_dir, tmp_path, trainer_class=Scripted, data=None, **over):
    cfg = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
               max_completion_length=64, max_steps=2, beta=0.0, learning_rate=1e-2, logging_steps=1,
               save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0, bf16=False,
               gradient_checkpointing=False, max_tool_calling_iterations=3)  # fmt: skip
    extra = {k: over.pop(k) for k in ("rh_detector", "peft_config") if k in over}
    return trainer_class(model=model_dir, args=train_config(**{**cfg, **over}), train_dataset=data or dataset(),
                         environment_factory=Counter, **extra)  # fmt: skip


def agent_and_tool_text(tok, batch, i):
    real, agent = batch["completion_mask"][i].bool(), batch["tool_mask"][i].bool()
    ids = batch["completion_ids"][i]
    return tok.decode(ids[real & agent]), tok.decode(ids[real & ~agent])


def test_synchronous_tool_episodes_train_on_agent_tokens_only(model_dir, tmp_path):
    trainer = make(model_dir, tmp_path)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    tok = trainer.processing_class
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(h["rewards/Counter/mean"] == 0.5 and h["env/tool_calls"] == 2.0 for h in logs)
    assert all(h["env/total"] == 4.5 and h["env/exact"] == 0.5 for h in logs)  # the episode_info numbers
    for batch in trainer.batches:
        for i in range(batch["completion_ids"].size(0)):
            agent, shown = agent_and_tool_text(tok, batch, i)
            second = SHORT if i % 2 else call("add", n=3)
            assert agent == call("add", n=2) + "<|im_end|>" + second + "<|im_end|>done<|im_end|>"
            assert "total 2" in shown and f"total {4 + (i % 2 == 0)}" in shown and "total" not in agent
    assert max((p.detach() - before[n]).abs().max().item() for n, p in trainer.model.named_parameters()) > 0


class PublishedEvent(TrainerCallback):
    """Set after each optimizer step's publish (the off-policy generator's callback publishes first)."""

    def __init__(self):
        self.published = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.published.setdefault(state.global_step, threading.Event()).set()


@pytest.mark.parametrize("strict", [True, False])
def test_off_policy_tool_episodes_carry_per_token_versions(model_dir, tmp_path, strict):
    """k = 1. In flight, the second turn of batch 1's episodes waits (between its first and second decoding step,
    where the generator lets a publish in) until policy 1 is published: one episode holds tokens of policies 0 and 1,
    and its tool tokens carry the version of the agent token before them."""
    from trl_ext.offpolicy import component

    tok_holder = {}

    def make_sampler(backend, model):
        return forced_sampler(tok_holder["tok"])(backend, model)

    events = PublishedEvent()
    with mock.patch.object(component, "make_sampler", make_sampler):
        trainer = make(model_dir, tmp_path, max_async_level=1, strict_async_level=strict, generation_backend="trl",
                       max_steps=3)  # fmt: skip
        tok_holder["tok"] = trainer.processing_class
        trainer.add_callback(events)
        starts = {}

        class Hold(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                worker = trainer.components.offpolicy.worker

                def on_step(index, t):
                    if index == 1 and t == 0:
                        starts[index] = starts.get(index, 0) + 1
                    if not strict and index == 1 and t == 1 and starts.get(1) == 2:  # batch 1, second turn
                        assert events.published.setdefault(1, threading.Event()).wait(60)

                worker.on_step = on_step

        trainer.add_callback(Hold())
        trainer.train()
    tok = trainer.processing_class
    batches = trainer.batches
    assert len(batches) == 3
    mixed = 0
    for n, batch in enumerate(batches):
        versions, agent = batch["behaviour_versions"], batch["tool_mask"].bool() & batch["completion_mask"].bool()
        for i in range(versions.size(0)):
            real = batch["completion_mask"][i].bool()
            v, a = versions[i][real].tolist(), agent[i][real].tolist()
            assert max(n - 1, 0) <= min(v) <= max(v) <= n  # the lag bound, per token
            for j in range(1, len(v)):
                if not a[j]:  # a tool token: the version of the token before it
                    assert v[j] == v[j - 1]
            if strict:
                assert len(set(v)) == 1
            mixed += len(set(v)) > 1
            agent_text, shown = agent_and_tool_text(tok, batch, i)
            assert "total 2" in shown and "total" not in agent_text
        assert (batch["sampling_per_token_logps"][~agent] == 0).all()  # tool tokens: no behaviour log-prob
    if not strict:
        assert mixed > 0  # an update landed inside episodes of batch 1
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["offpolicy/abs_log_ratio_mean"] < 1e-4  # step 1: the forced tokens' log-probs are the trainer's
    assert all(h["rewards/Counter/mean"] == 0.5 for h in logs)


def test_routing_detectors_see_the_tool_transcript(model_dir, tmp_path):
    """A detector reading the episodes (``trajectories=``): flags the episodes whose second call added 2 (from the
    transcript's tool calls, not the reward), routed per sample."""

    def overshoot(completions, trajectories=None):
        return [t.turns[1].info["tool_calls"] == [{"name": "add", "arguments": {"n": 2}}] for t in trajectories]

    trainer = make(model_dir, tmp_path, gradient_routing=True, routing_mode="shared", lora_config="r4",
                   eval_routing_steps=0, rh_detector=("overshoot", overshoot))  # fmt: skip
    trainer.train()
    for batch in trainer.batches:
        assert batch["is_rh"].tolist() == [False, True, False, True]  # the odd rows added 2


def test_distillation_teacher_scores_agent_tokens_under_its_system_context(model_dir, tmp_path):
    """The teacher's prompt is the episode's prompt with the context as its system message, rendered with the same
    tools; it scores the agent's tokens only (0 on tool tokens)."""
    from trl_ext.distill import component
    from trl_ext.distill.component import Distillation

    seen, teacher_prompts = [], []
    score, place = Distillation.score_teacher, component.chat_teacher_prompt

    def spy(self, batch, prompts=None, render_kwargs=None):
        seen.append((prompts, render_kwargs))
        return score(self, batch, prompts, render_kwargs)

    def placed(student_ids, student_rendered, teacher_rendered):
        teacher_prompts.append(place(student_ids, student_rendered, teacher_rendered))
        return teacher_prompts[-1]

    with mock.patch.object(Distillation, "score_teacher", spy), mock.patch.object(component, "chat_teacher_prompt",
                                                                                   placed):  # fmt: skip
        trainer = make(model_dir, tmp_path, teacher_tau=0.5, student_tau=0.0, adv_tau=1.0, beta=0.02,
                       use_full_reward_baseline=False, teacher_context="Add 2, then 3.")  # fmt: skip
        trainer.train()
    prompts, kwargs = seen[0]
    assert prompts[0][-1]["content"] == "Count. Reach 5." and [t.__name__ for t in kwargs[0]["tools"]] == ["add"]
    text = trainer.processing_class.decode(teacher_prompts[0])
    assert text.startswith("<|im_start|>system\nAdd 2, then 3.\n\n# Tools") and '"name": "add"' in text
    assert text.endswith("<|im_start|>user\nCount. Reach 5.<|im_end|>\n<|im_start|>assistant\n")
    for batch in trainer.batches:
        lp = batch["distill_lp_teacher"]
        agent = batch["tool_mask"].bool() & batch["completion_mask"].bool()
        assert (lp[~agent] == 0).all() and (lp[agent] < 0).all()
