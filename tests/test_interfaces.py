"""trl_ext.interfaces: every sampler and publisher of the project implements its protocol, by ``isinstance`` (the
protocols are runtime-checkable) and by signature (the protocol's parameters, in order, with its defaults; a method
the protocol says returns None returns None). The check itself fails for an implementation with a member dropped."""

from __future__ import annotations

import inspect
import typing

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trl_ext.generation.backends import SAMPLERS, make_sampler
from trl_ext.generation.fast import FastSampler
from trl_ext.generation.hf_sampler import HFSampler
from trl_ext.interfaces import (
    EnginePublisher,
    ModelSampler,
    Publisher,
    Sampler,
    SamplingParams,
    VersionedSampler,
)
from trl_ext.offpolicy.store import PolicyStore
from trl_ext.offpolicy.worker import RolloutWorker, WorkerConfig
from trl_ext.serve.transfer import WeightPusher
from trl_ext.vllm.publish import CheckpointPublisher
from trl_ext.vllm.sampler import VLLMSampler

PARAMS = SamplingParams(max_new_tokens=2, temperature=1.0, top_k=0, top_p=1.0, eos_token_ids=(1,), pad_token_id=1)


def tiny_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, eos_token_id=1, pad_token_id=1)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


class Accelerator:
    """The one-process accelerator a `CheckpointPublisher` reads."""

    is_local_main_process = is_main_process = True
    num_processes = 1

    def wait_for_everyone(self):
        pass


def members(proto) -> tuple[list[str], list[str]]:
    """(methods, data attributes) a protocol declares, its protocol bases' included."""
    methods, data = [], []
    for base in reversed(proto.__mro__):
        if not getattr(base, "_is_protocol", False) or base is typing.Protocol:
            continue
        methods += [n for n, v in vars(base).items() if inspect.isfunction(v) and not n.startswith("_")]
        data += [n for n in vars(base).get("__annotations__", {}) if n not in methods]
    return methods, data


def mismatches(obj, proto) -> list[str]:
    """How ``obj`` falls short of ``proto`` (empty: it conforms)."""
    if not isinstance(obj, proto):
        return [f"{type(obj).__name__} is not a {proto.__name__}"]
    methods, data = members(proto)
    out = [f"{type(obj).__name__}.{name} is not set" for name in data if getattr(obj, name, None) is None]
    for name in methods:
        want, got = inspect.signature(getattr(proto, name)), inspect.signature(getattr(type(obj), name))
        wp, gp = list(want.parameters.values()), list(got.parameters.values())
        if [(p.name, p.kind) for p in wp] != [(p.name, p.kind) for p in gp]:
            out.append(f"{type(obj).__name__}.{name}{got} is not {proto.__name__}.{name}{want}")
        elif any(w.default is not w.empty and g.default is w.empty for w, g in zip(wp, gp, strict=True)):
            out.append(f"{type(obj).__name__}.{name}{got} lacks the defaults of {proto.__name__}.{name}{want}")
        if want.return_annotation == "None" and got.return_annotation not in ("None", None):
            out.append(f"{type(obj).__name__}.{name} returns {got.return_annotation}, {proto.__name__}'s None")
    return out


@pytest.fixture(scope="module")
def samplers() -> dict[str, object]:
    model = tiny_model()
    return {"fast": FastSampler(model), "trl": HFSampler(model), "vllm": VLLMSampler(object(), inflight_tokens=4)}


@pytest.fixture(scope="module")
def publishers(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("weights")
    worker = RolloutWorker(make_sampler("trl", tiny_model()), PolicyStore(), PARAMS,
                           WorkerConfig(1, True, start_step=0, seed=0))  # not started
    return {"store": PolicyStore(), "worker": worker,
            "checkpoints": CheckpointPublisher(Accelerator(), 1, nbytes=0, root=str(root)),
            "pusher": object.__new__(WeightPusher)}  # its methods are the class's: no servers needed  # fmt: skip


SAMPLER_KINDS = {"fast": ModelSampler, "trl": ModelSampler, "vllm": VersionedSampler}
PUBLISHER_KINDS = {"store": Publisher, "worker": Publisher, "checkpoints": EnginePublisher, "pusher": EnginePublisher}


def test_every_generation_backend_is_listed():
    assert set(SAMPLERS) <= set(SAMPLER_KINDS)


@pytest.mark.parametrize("name", SAMPLER_KINDS)
def test_samplers_conform(samplers, name):
    sampler, kind = samplers[name], SAMPLER_KINDS[name]
    assert mismatches(sampler, Sampler) == [] and mismatches(sampler, kind) == []
    assert type(sampler).loads_versions is (kind is VersionedSampler)  # what the generator tells them apart by
    assert not isinstance(sampler, VersionedSampler if kind is ModelSampler else ModelSampler)


@pytest.mark.parametrize("name", PUBLISHER_KINDS)
def test_publishers_conform(publishers, name):
    assert mismatches(publishers[name], PUBLISHER_KINDS[name]) == []


def test_model_samplers_sample_with_the_shared_types(samplers):
    for name in ("fast", "trl"):
        out = samplers[name].sample([[5, 6], [7]], PARAMS, torch.Generator().manual_seed(0), lambda t: 3)
        assert len(out.completion_ids) == 2 and all(set(v) == {3} for v in out.versions), name


def stripped(obj, name: str):
    """``obj`` with member ``name`` dropped (set to None in a subclass, as a protocol reads a missing method)."""
    cls = type(f"No_{name}", (type(obj),), {name: None})
    copy = object.__new__(cls)
    copy.__dict__.update(getattr(obj, "__dict__", {}))
    copy.__dict__.pop(name, None)
    return copy


@pytest.mark.parametrize("proto", [ModelSampler, VersionedSampler, Publisher, EnginePublisher])
def test_the_check_fails_without_any_member(samplers, publishers, proto):
    impls = [o for o in [*samplers.values(), *publishers.values()] if isinstance(o, proto)]
    methods, data = members(proto)
    assert impls and methods
    for obj in impls:
        for name in methods + data:
            assert mismatches(stripped(obj, name), proto) != [], (type(obj).__name__, name)


def test_the_check_fails_on_a_changed_signature():
    class Renamed(PolicyStore):
        def publish(self, step: int, model) -> None: ...

    class Returns(PolicyStore):
        def publish(self, version: int, model) -> str: ...

    class NoDefault(VLLMSampler):
        def sample(self, prompt_ids, params, rng, before_step): ...

    assert mismatches(Renamed(), Publisher) and mismatches(Returns(), Publisher)
    assert mismatches(object.__new__(NoDefault), Sampler)


def test_a_store_over_an_engine_publisher_keeps_its_snapshots():
    """`PolicyStore.of(publisher)`: each version published, and the publisher's snapshot of it kept for the engine's
    sampler; a store whose snapshot function is a `Publisher`'s publish (it returns None) fails at once."""

    class Checkpoints:
        def __init__(self) -> None:
            self.published = []

        def publish(self, version: int, model) -> None:
            self.published.append(version)

        def snapshot(self, version: int) -> str:
            return f"v{version}"

        def close(self) -> None: ...

    publisher = Checkpoints()
    assert mismatches(publisher, EnginePublisher) == []
    store = PolicyStore.of(publisher)
    store.publish(0, None)
    store.publish(1, None)
    assert publisher.published == [0, 1] and store.take(1) == "v1" and store.held_versions() == []
    with pytest.raises(TypeError, match=r"PolicyStore\.of"):
        PolicyStore(publisher.publish).publish(2, None)
