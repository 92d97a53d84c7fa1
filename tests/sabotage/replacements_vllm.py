"""The sabotage table's switches of vLLM generation (``tests/sabotage/switches.py``; the shared helpers are in
``replacements.py``): each function takes the original of a row's target and returns its sabotaged replacement; its
docstring says what the switch turns off. Replacements import what they need when called: this file is imported at
interpreter start-up."""

from __future__ import annotations


def start_adapter_every_version(orig):
    """adapter_tensors (a version's LoRA adapter, as a publish writes it) yields, at every publish of the process, the
    tensors of its first one (the start adapter): the engines take a new adapter each version, always the start
    policy's."""
    first = []

    def adapter_tensors(model, rank):
        if not first:
            first.append([(name, t.detach().clone()) for name, t in orig(model, rank)])
        yield from first[0]

    return adapter_tensors


def blocks_unscaled(orig):
    """_dual_blocks (dual LoRA's retain and forget blocks of the served adapter) ignores the sides' current
    retain_scale / forget_scale: every routing eval mode serves both blocks, as the whole policy."""

    def dual_blocks(module):
        retain, forget = module.retain_scale, module.forget_scale
        module.retain_scale = module.forget_scale = 1.0
        try:
            return orig(module)
        finally:
            module.retain_scale, module.forget_scale = retain, forget

    return dual_blocks


def gather_whole_model_first(orig):
    """merged_weights, as the publish reads it, gathers and merges every tensor of the model before yielding the
    first (the whole model held at once on every process, as the publishes held it before they were streamed)."""

    def merged_weights(model):
        yield from list(orig(model))

    return merged_weights
