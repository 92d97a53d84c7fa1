"""Trainer plumbing of the token records (``--token_records_every N``; rows and labels: `runs.token_records`).

1. When a due step's generation batch is scored (`start_token_records`, from the saved-rollout stage), the
   generator's fields of every local sample open a `TokenTable`, and ``record_index`` (the sample's row in the whole
   generation batch) joins the batch dict, so TRL's shuffle and split carry it to the loss.
2. Every training loss call fills the loss fields of the rows it trains: the off-policy loss
   (`record_offpolicy_tokens`, its masks and clips), or TRL's own (`capture_trl_loss`, the training forward's
   log-probs and TRL's PPO clip). A routed two-pass step calls the loss once per side, each on its own rows.
3. After the last micro-batch of the generation batch (`training_step`), the table is checked (every trained token
   filled), gathered over the processes and written by the main process.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from trl_ext.batch import loss_mask
from trl_ext.runs import token_records as tr


class TokenRecordsMixin:
    """``--token_records_every N`` for ExtGRPOTrainer (see the module docstring)."""

    _token_table: tr.TokenTable | None = None
    _distill_lp_teacher: torch.Tensor | None = None  # distillation's teacher log-probs of the batch (DistillMixin)

    def token_records_due(self) -> bool:
        every = self.args.token_records_every
        return every > 0 and self.model.training and (self.state.global_step + 1) % every == 0

    def start_token_records(self, batch: dict, cols: dict[str, list], first: int) -> None:
        """Stage 1: ``cols`` are this process's saved-rollout columns of ``batch`` (rows ``first`` ...)."""
        step = self.state.global_step + 1
        tok = self.processing_class
        self._token_table = table = tr.TokenTable(step)
        real, trained = batch["completion_mask"].bool(), loss_mask(batch).bool()
        versions = batch.get("behaviour_versions")
        adv = batch["advantages"].detach()
        teacher = self._distill_lp_teacher
        n = real.size(0)
        batch["record_index"] = torch.arange(first, first + n, device=real.device)
        rows = [batch["completion_ids"][i][real[i]].tolist() for i in range(n)]
        texts = iter(tok.batch_decode([[t] for ids in rows for t in ids]))  # every token's text, in one call
        sides = self._adapter_sides()
        for i, ids in enumerate(rows):
            m, k = real[i], len(ids)
            row_adv = adv[i].expand(m.shape) if adv.dim() == 1 else adv[i]
            is_bad = bool(batch["is_bad"][i]) if "is_bad" in batch else None
            table.add_sample(first + i, {
                "step": [step] * k, "sample": [first + i] * k, "position": list(range(k)), "token_id": ids,
                "token": [next(texts) for _ in ids], "trained": trained[i][m].tolist(),
                "source": ["agent" if t else "env" for t in (batch["tool_mask"][i][m].bool().tolist()
                                                            if "tool_mask" in batch else [True] * k)],
                "policy_version": versions[i][m].tolist() if versions is not None else [self.state.global_step] * k,
                "advantage": row_adv[m].double().tolist(),
                "teacher_logprob": teacher[i][m].double().tolist() if teacher is not None else [None] * k,
                "adapter": [sides[is_bad]] * k,
                "reward": [cols["reward"][i]] * k, "is_rh": [cols["is_rh"][i]] * k, "env": [cols["env"][i]] * k,
            })  # fmt: skip

    def _adapter_sides(self) -> dict[bool | None, str | None]:
        """The adapters a sample trains, by its routing label (None: unlabelled): those with a rank > 0; under
        routing a flagged sample trains the forget adapter alone, an unflagged one the retain adapter (and the forget
        adapter too in shared mode)."""
        a = self.args
        if not a.dual_lora:
            return {None: None, False: None, True: None}
        present = "+".join(name for name, rank in zip(("retain", "forget"), a.adapter_ranks) if rank > 0)
        if not a.gradient_routing:
            return {None: present, False: present, True: present}
        return {None: present, True: "forget", False: "retain+forget" if a.routing_mode == "shared" else "retain"}

    # ------------------------------------------------------------------ stage 2: the loss
    def _fill_tokens(self, inputs: dict, lp: torch.Tensor, behaviour: torch.Tensor, masked_by, clipped) -> None:
        """The loss fields of the micro-batch's rows (``masked_by`` / ``clipped``: (B, T) label lists)."""
        real, trained = inputs["completion_mask"].bool().tolist(), loss_mask(inputs).bool().tolist()
        lp_b, lp_t = behaviour.detach().double().tolist(), lp.detach().double().tolist()
        ratio = torch.exp(lp.detach().double() - behaviour.double()).tolist()
        for r, sample in enumerate(inputs["record_index"].tolist()):
            if not any(trained[r]):  # the other side's rows of a routed pass over all rows (keep_rows)
                continue
            cols = [c for c, is_real in enumerate(real[r]) if is_real]
            positions = [p for p, c in enumerate(cols) if trained[r][c]]
            at = [c for c in cols if trained[r][c]]
            self._token_table.fill(sample, positions, {
                "behaviour_logprob": [lp_b[r][c] for c in at], "trainer_logprob": [lp_t[r][c] for c in at],
                "ratio": tr.finite([ratio[r][c] for c in at]),
                "masked_by": [masked_by[r][c] for c in at], "clipped": [clipped[r][c] for c in at],
            })  # fmt: skip

    def recording_loss(self, inputs: dict) -> bool:
        return self._token_table is not None and "record_index" in inputs and self.model.training

    def record_offpolicy_tokens(self, inputs: dict, lp: torch.Tensor, masks: dict, mask: torch.Tensor) -> None:
        """The off-policy loss's rows: behaviour = the generator's log-probs; its masks and clips."""
        if not self.recording_loss(inputs):
            return
        cfg = self.offpolicy_cfg
        self._fill_tokens(inputs, lp, inputs["sampling_per_token_logps"], tr.mask_labels(masks, mask),
                          tr.clip_labels(masks, mask, cfg.ratio_type))  # fmt: skip

    @contextmanager
    def capture_trl_loss(self, inputs: dict):
        """Around TRL's ``_compute_loss``: the training forward's log-probs (its one call of
        ``_get_per_token_logps_and_entropies``), then the rows: behaviour = the sampler's log-probs (vLLM's) or TRL's
        ``old_per_token_logps``, else the trainer's own; TRL's PPO clip on the ratio to the old log-probs."""
        if not self.recording_loss(inputs):
            yield
            return
        seen = []
        cls = type(self)

        def capture(*args, **kwargs):
            out = cls._get_per_token_logps_and_entropies(self, *args, **kwargs)
            seen.append(out[0])
            return out

        self._get_per_token_logps_and_entropies = capture
        try:
            yield
        finally:
            del self._get_per_token_logps_and_entropies
        lp = seen[0].detach()
        old = inputs.get("old_per_token_logps")
        old = lp if old is None else old
        behaviour = inputs.get("sampling_per_token_logps", old)
        mask = loss_mask(inputs)
        clipped = tr.ppo_clip_labels(torch.exp(lp - old), inputs["advantages"], mask, self.epsilon_low,
                                     self.epsilon_high)  # fmt: skip
        self._fill_tokens(inputs, lp, behaviour, [[None] * mask.size(1)] * mask.size(0), clipped)

    # ------------------------------------------------------------------ stage 3: the write
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._token_table is not None and self._step % (self.args.steps_per_generation * self.num_iterations) == 0:
            self.write_token_records()
        return loss

    def write_token_records(self) -> None:
        from trl_ext.runs.rollouts import token_shard_path, write_shard

        table, self._token_table = self._token_table, None
        missing = table.missing()
        if missing:
            raise RuntimeError(f"token records of step {table.step}: no loss call filled the trained tokens of samples "
                               f"{missing[:5]}")
        cols = table.columns()
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            cols = {key: gather_object(values) for key, values in cols.items()}
            if not self.accelerator.is_main_process:
                return
        write_shard(token_shard_path(self.args.output_dir, table.step), cols, tr.features())
