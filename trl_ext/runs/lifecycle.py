"""The run lifecycle of every trainer of a run (`RunLifecycle`: GRPO and SFT alike), the only override of its hooks.

- ``_save_checkpoint``: HF's checkpoint, then the project's state (``trl_ext_state.json``: what HF does not save, e.g.
  the zero-signal monitor and the components' state), a copy of ``run_config.yaml``, and last the completion marker
  (`checkpoints.mark_complete`).
- resume (`restore_run_state`, called by the trainer's ``train``): restores the project's state, then HF restores
  weights, optimizer, scheduler, RNG states and trainer state and skips the batches already trained.
- Numeric faults (`check_loss`, called by the trainer's ``training_step``, and ``_get_grad_norm``): a NaN/inf loss or
  gradient norm stops the run before the optimizer applies it; the last good state (the weights and optimizer after
  the previous step) is saved as a checkpoint first, its marker naming the fault.
- Sharding: FSDP on CPU processes (``create_accelerator_and_postprocess``), and the parallelism in effect read from
  the prepared model (``self.parallelism``, ``_prepare_for_training``), a ConfigError when a requested sharding is not
  in effect (`trl_ext.launch.fsdp`).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from trl_ext import compat
from trl_ext.launch.fsdp import Parallelism, check_parallelism, init_fsdp2_now, read_parallelism, use_fsdp_on_cpu
from trl_ext.runs.checkpoints import RUN_CONFIG, is_complete, mark_complete
from trl_ext.runs.faults import NumericFault

STATE_FILE = "trl_ext_state.json"


class RunLifecycle:
    """Atomic checkpoints, project state across resume, loud numeric faults and sharding (module docstring). Every
    trainer of a run inherits it; its ``train`` and ``training_step`` call `restore_run_state` and `check_loss`."""

    parallelism: Parallelism | None = None

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        use_fsdp_on_cpu(self)

    def _prepare_for_training(self, *args, **kwargs):
        model, dataloader = super()._prepare_for_training(*args, **kwargs)
        self.parallelism = read_parallelism(model, self.accelerator.num_processes)
        check_parallelism(self.args, self.parallelism)
        if self.parallelism.kind == "FSDP2":
            init_fsdp2_now(model)
        return model, dataloader

    def checkpoint_state(self) -> dict:
        """Project state to save with each checkpoint (JSON); subclasses extend it."""
        return {}

    def load_checkpoint_state(self, state: dict) -> None:
        """Restore what `checkpoint_state` saved."""

    def _save_checkpoint(self, model, trial, fault: str | None = None) -> None:
        super()._save_checkpoint(model, trial)
        self.accelerator.wait_for_everyone()  # every rank's files (its RNG state) are written before the marker
        if not self.args.should_save:
            return
        ckpt = Path(compat.output_dir_of(self, trial)) / f"checkpoint-{self.state.global_step}"
        (ckpt / STATE_FILE).write_text(json.dumps(self.checkpoint_state(), indent=2))
        run_config = Path(self.args.output_dir) / RUN_CONFIG
        if run_config.is_file():
            shutil.copyfile(run_config, ckpt / RUN_CONFIG)
        mark_complete(ckpt, self.state.global_step, **({"fault": fault} if fault else {}))

    def restore_run_state(self, resume_from_checkpoint) -> None:
        """Before HF's resume: the project's state of the checkpoint (which must be complete)."""
        if resume_from_checkpoint:
            path = Path(resume_from_checkpoint)
            if not is_complete(path):
                raise ValueError(f"{path} is not a complete checkpoint")
            state_file = path / STATE_FILE
            self.load_checkpoint_state(json.loads(state_file.read_text()) if state_file.is_file() else {})

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Full-model weights as ``from_pretrained`` reads them: transformers 5 saves some families under their hub
        key names (GPT-NeoX's ``lm_head`` as ``embed_out``) and HF's resume loads the file non-strictly, which would
        keep the untrained head and only log the missing key. Keys are renamed back and any key still missing or
        unexpected (besides tied weights) is an error. PEFT, FSDP and sharded checkpoints: HF's own loader."""
        model = self.model if model is None else model
        safe = Path(resume_from_checkpoint) / "model.safetensors"
        if not safe.is_file() or self.is_fsdp_enabled or hasattr(model, "peft_config"):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        import safetensors.torch

        from trl_ext.routing.checkpoint import saved_to_model_keys

        state = saved_to_model_keys(model, safetensors.torch.load_file(str(safe), device="cpu"))
        result = model.load_state_dict(state, strict=False)
        tied = compat.tied_weights_keys(model)
        missing = [k for k in result.missing_keys if k not in tied]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"{safe} does not fit the model: missing {missing[:5]}, unexpected "
                               f"{result.unexpected_keys[:5]}")
        if hasattr(model, "tie_weights"):
            model.tie_weights()

    # ------------------------------------------------------------------ numeric faults
    def check_loss(self, loss: torch.Tensor) -> None:
        """A `numeric_fault` on every process when the step's loss is not finite on one."""
        local_ok = bool(torch.isfinite(loss.detach()).all())
        where = ""
        if self.accelerator.num_processes > 1:  # every rank stops together (a rank alone would hang the others)
            flag = torch.tensor([float(local_ok)], device=self.accelerator.device)
            all_ok = bool(self.accelerator.reduce(flag, reduction="mean").item() == 1.0)
            where = " on this process" if not local_ok else " on another process"
            local_ok = all_ok
        if not local_ok:
            self.numeric_fault(f"loss is {loss.detach().float().mean().item()}{where}")

    def _get_grad_norm(self, model, grad_norm=None):
        norm = super()._get_grad_norm(model, grad_norm)
        value = float(norm)
        if not math.isfinite(value):
            self.numeric_fault(f"gradient norm is {value}")
        return norm

    def numeric_fault(self, what: str) -> None:
        """Save the last good state (unless a complete checkpoint of it exists) and raise NumericFault."""
        step = self.state.global_step
        ckpt = Path(compat.output_dir_of(self)) / f"checkpoint-{step}"
        if not is_complete(ckpt):
            self._save_checkpoint(self.model, None, fault=f"step {step + 1}: {what}")
        raise NumericFault(f"step {step + 1}: the {what}; training stopped before the optimizer applied it. The last "
                           f"good state (after step {step}) is {ckpt}")
