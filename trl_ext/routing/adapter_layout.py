"""The dual adapter layout of a routed model (ranks, targets, layer range, adapter type) and its JSON file next to
every checkpoint (``dual_lora_layout.json``): what rebuilding the adapters needs (`routing.checkpoint.apply_layout`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from trl_ext.registry import ConfigError

ROUTING_MODES = ("shared", "exclusive")
LAYOUT_FILENAME = "dual_lora_layout.json"
ADAPTER_FILENAME = "dual_lora_adapter.safetensors"  # adapter-only checkpoints (small-rl --save_adapter_only)


def check_routing_mode(mode: str) -> None:
    if mode not in ROUTING_MODES:
        raise ConfigError(f"unknown routing mode {mode!r}; choose one of {', '.join(ROUTING_MODES)}")


@dataclass(frozen=True)
class DualLoRALayout:
    """Everything needed to rebuild the adapters of a checkpoint (saved as JSON next to it)."""

    retain_rank: int
    forget_rank: int
    alpha: float
    targets: tuple[str, ...]
    layer_start: int
    layer_end: int
    layer_stride: int
    include_lm_head: bool
    adapter_type: str = "lora"  # "mlp": DualMLPAdapter on each layer's MLP (ranks = neurons; alpha unused)

    @property
    def layers(self) -> list[int]:
        return list(range(self.layer_start, self.layer_end, self.layer_stride))

    def to_dict(self) -> dict:
        return {**asdict(self), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, d: dict) -> DualLoRALayout:
        names = {f.name for f in fields(cls)}
        d = {"adapter_type": "lora", **d}  # layouts written before MLP adapters existed are LoRA
        if set(d) != names:
            raise ValueError(f"dual LoRA layout: missing {sorted(names - set(d))}, unknown {sorted(set(d) - names)}")
        return cls(**{**d, "targets": tuple(d["targets"])})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DualLoRALayout:
        return cls.from_dict(json.loads(text))


def save_layout(directory: str | Path, layout: DualLoRALayout, routing_mode: str | None,
                base: dict | None = None) -> Path:
    """Write ``dual_lora_layout.json`` (layout fields + routing_mode; None = trained without routing). ``base``
    ({"path", "fingerprint"}) marks an adapter-only checkpoint: the base weights live at ``path``."""
    if routing_mode is not None:
        check_routing_mode(routing_mode)
    path = Path(directory) / LAYOUT_FILENAME
    extra = {} if base is None else {"base_model": base}
    path.write_text(json.dumps({**layout.to_dict(), "routing_mode": routing_mode, **extra}, indent=2, sort_keys=True))
    return path


def _read_layout(directory: str | Path) -> dict:
    d = json.loads((Path(directory) / LAYOUT_FILENAME).read_text())
    if "routing_mode" not in d:
        raise ValueError(f"{Path(directory) / LAYOUT_FILENAME} has no routing_mode")
    return d


def load_layout(directory: str | Path) -> tuple[DualLoRALayout, str | None]:
    d = _read_layout(directory)
    mode = d.pop("routing_mode")
    d.pop("base_model", None)
    return DualLoRALayout.from_dict(d), mode
