"""Prompts and completions as the text detectors and base rewards judge (`as_text`), and the reference policy of a
dual LoRA run (`AdaptersDisabledReference`)."""

from __future__ import annotations

import json

from torch import nn

from trl_ext.routing.adapters import adapters_disabled


def _message_text(m: dict) -> str:
    """A message's content, then its tool calls (TRL's tool loop) as ``call NAME({"arg": ...})``."""
    calls = [f"call {c['function']['name']}({json.dumps(c['function']['arguments'])})"
             for c in m.get("tool_calls") or []]
    return " ".join(part for part in (m.get("content") or "", *calls) if part)


def as_text(x) -> str:
    """A prompt or completion as text: plain text as is; chat messages (TRL's conversational format) as their
    contents, each after its role (``"system: ...\nuser: ..."``; a completion's one assistant message: its
    content), tool calls written ``call NAME(JSON arguments)`` (`_message_text`), so detectors, base rewards and
    the per-prompt hackability draw see text either way."""
    if isinstance(x, str):
        return x
    if len(x) == 1 and x[0].get("role") == "assistant":
        return _message_text(x[0])
    return "\n".join(f"{m['role']}: {_message_text(m)}" for m in x)


class AdaptersDisabledReference(nn.Module):
    """TRL's ``ref_model`` for a dual LoRA policy: the policy itself, run with both adapters off."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        object.__setattr__(self, "policy", policy)  # not a submodule: no second set of parameters

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.policy):
            return self.policy(*args, **kwargs)
