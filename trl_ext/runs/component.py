"""Saved rollouts and token records as a component (`Records`: ``--save_rollouts``, ``--token_records_every N``;
schemas: `runs.rollouts`, rows and labels: `runs.token_records`).

1. Records stage of every training batch: this process's samples go to ``{run_dir}/rollouts/`` (one shard per step,
   written by the main process). On a due step of ``--token_records_every``, the generator's fields of every local
   sample open a `TokenTable`, and ``record_index`` (the sample's row in the whole generation batch) joins the batch
   dict, so TRL's shuffle and split carry it to the loss.
2. Every training loss call fills the loss fields of the rows it trains (`loss_tokens`): the off-policy loss's masks
   and clips, or TRL's own loss (the training forward's log-probs and TRL's PPO clip). A routed two-pass step calls
   the loss once per side, each on its own rows.
3. After the last micro-batch of the generation batch (`step_done`), the table is checked (every trained token
   filled), gathered over the processes and written by the main process.
"""

from __future__ import annotations

import torch

from trl_ext import compat
from trl_ext.batch import BatchContext, loss_mask
from trl_ext.components import Component, LossTokens, register
from trl_ext.runs import rollouts
from trl_ext.runs import token_records as tr


@register
class Records(Component):
    """``--save_rollouts`` and its ``--token_records_every`` (module docstring)."""

    name, order = "records", 90

    @classmethod
    def wanted(cls, cfg, kwargs) -> bool:
        return bool(cfg.save_rollouts)

    def __init__(self, trainer, kwargs: dict, options: dict) -> None:
        super().__init__(trainer, kwargs, options)
        self.features = None  # the shards' schema (`setup`: the reward names are the trainer's)
        self.table: tr.TokenTable | None = None

    def setup(self) -> None:
        t = self.trainer
        self.features = rollouts.features(list(t.reward_func_names), list(t.eval_reward_funcs))

    # ------------------------------------------------------------------ 1. the saved rollouts
    def record(self, batch: dict, ctx: BatchContext) -> None:
        if ctx.mode == "train":
            self.write_rollouts(batch, ctx)

    def write_rollouts(self, batch: dict, ctx: BatchContext) -> None:
        """Write this batch's samples to ``{run_dir}/rollouts/`` (schema: `trl_ext.runs.rollouts`)."""
        t = self.trainer
        tok, mask = t.processing_class, batch["completion_mask"]
        trained = loss_mask(batch)
        n = mask.size(0)
        rows = lambda ids, m: [r[k].tolist() for r, k in zip(ids, m.bool(), strict=True)]  # noqa: E731
        prompts = tok.batch_decode(rows(batch["prompt_ids"], batch["prompt_mask"]), skip_special_tokens=True)
        ids = rows(batch["completion_ids"], mask)
        completions = tok.batch_decode(ids, skip_special_tokens=True)
        if "tool_mask" in batch:  # turn boundaries of environment transcripts
            decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
            segments = [rollouts.split_segments(i, m, decode) for i, m in zip(ids, rows(trained, mask), strict=True)]
        else:
            segments = [[{"source": "agent", "text": text}] for text in completions]
        rewards = ctx.local_rewards
        weights = t.reward_weights.to(rewards.device)
        first = ctx.first_row  # this process's rows of the generation batch (TRL's order)
        cols: dict[str, list] = {
            "step": [t.state.global_step + 1] * n, "sample": list(range(first, first + n)),
            "group": [(first + i) // t.num_generations for i in range(n)], "prompt": prompts,
            "completion": completions,
            "segments": segments, "reward": rollouts.weighted_reward(rewards, weights).tolist(),
            **{f"reward/{name}": rewards[:, j].double().tolist() for j, name in enumerate(t.reward_func_names)},
            **{f"eval_reward/{name}": [float(v) for v in values] for name, values in ctx.eval_rewards.items()},
            "advantage": rollouts.sequence_values(batch["advantages"].detach(), trained),
            "completion_tokens": trained.sum(1).long().tolist(),
        }  # fmt: skip
        for key in ("is_rh", "is_bad"):
            cols[key] = batch[key].bool().tolist() if key in batch else [None] * n
        if "behaviour_versions" in batch:
            v, m = batch["behaviour_versions"], trained.bool()
            cols["policy_version_min"] = torch.where(m, v, torch.iinfo(v.dtype).max).amin(1).tolist()
            cols["policy_version_max"] = torch.where(m, v, torch.iinfo(v.dtype).min).amax(1).tolist()
        cols.update(ctx.columns)
        for key in rollouts.OPTIONAL_COLUMNS:
            cols.setdefault(key, [None] * n)
        if self.token_records_due():  # --token_records_every: this step's token rows
            self.start_token_records(batch, cols, first, ctx.teacher_logprobs)
        acc = t.accelerator
        if acc.num_processes > 1:  # one shard per step, written by the main process
            from accelerate.utils import gather_object

            cols = {key: gather_object(values) for key, values in cols.items()}
            if not acc.is_main_process:
                return
        path = rollouts.shard_path(t.args.output_dir, t.state.global_step + 1)
        rollouts.write_shard(path, cols, self.features)

    # ------------------------------------------------------------------ token records
    def token_records_due(self) -> bool:
        t = self.trainer
        every = t.args.token_records_every
        return every > 0 and t.model.training and (t.state.global_step + 1) % every == 0

    def start_token_records(self, batch: dict, cols: dict[str, list], first: int, teacher) -> None:
        """Stage 1: ``cols`` are this process's saved-rollout columns of ``batch`` (rows ``first`` ...); ``teacher``
        the teacher's log-probs (distillation) or None."""
        t = self.trainer
        step = t.state.global_step + 1
        tok = t.processing_class
        self.table = table = tr.TokenTable(step)
        real, trained = batch["completion_mask"].bool(), loss_mask(batch).bool()
        versions = batch.get("behaviour_versions")
        adv = batch["advantages"].detach()
        n = real.size(0)
        batch["record_index"] = torch.arange(first, first + n, device=real.device)
        rows = [batch["completion_ids"][i][real[i]].tolist() for i in range(n)]
        texts = iter(tok.batch_decode([[x] for ids in rows for x in ids]))  # every token's text, in one call
        sides = self._adapter_sides()
        for i, ids in enumerate(rows):
            m, k = real[i], len(ids)
            row_adv = adv[i].expand(m.shape) if adv.dim() == 1 else adv[i]
            is_bad = bool(batch["is_bad"][i]) if "is_bad" in batch else None
            table.add_sample(first + i, {
                "step": [step] * k, "sample": [first + i] * k, "position": list(range(k)), "token_id": ids,
                "token": [next(texts) for _ in ids], "trained": trained[i][m].tolist(),
                "source": ["agent" if x else "env" for x in (batch["tool_mask"][i][m].bool().tolist()
                                                            if "tool_mask" in batch else [True] * k)],
                "policy_version": versions[i][m].tolist() if versions is not None else [t.state.global_step] * k,
                "advantage": row_adv[m].double().tolist(),
                "teacher_logprob": teacher[i][m].double().tolist() if teacher is not None else [None] * k,
                "adapter": [sides[is_bad]] * k,
                "reward": [cols["reward"][i]] * k, "is_rh": [cols["is_rh"][i]] * k, "env": [cols["env"][i]] * k,
            })  # fmt: skip

    def _adapter_sides(self) -> dict[bool | None, str | None]:
        """The adapters a sample trains, by its routing label (None: unlabelled): those with a rank > 0; under
        routing a flagged sample trains the forget adapter alone, an unflagged one the retain adapter (and the forget
        adapter too in shared mode)."""
        a = self.trainer.args
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
            self.table.fill(sample, positions, {
                "behaviour_logprob": [lp_b[r][c] for c in at], "trainer_logprob": [lp_t[r][c] for c in at],
                "ratio": tr.finite([ratio[r][c] for c in at]),
                "masked_by": [masked_by[r][c] for c in at], "clipped": [clipped[r][c] for c in at],
            })  # fmt: skip

    def loss_tokens(self, inputs: dict, tokens: LossTokens) -> None:
        """The loss fields of the micro-batch's rows: the off-policy loss's (behaviour = the generator's log-probs;
        its masks and clips), or TRL's (behaviour = the sampler's log-probs (vLLM's) or TRL's
        ``old_per_token_logps``, else the trainer's own; TRL's PPO clip on the ratio to the old log-probs)."""
        t = self.trainer
        if self.table is None or "record_index" not in inputs or not t.model.training:
            return
        lp, mask = tokens.logps, loss_mask(inputs)
        if tokens.masks is not None:
            self._fill_tokens(inputs, lp, inputs["sampling_per_token_logps"], tr.mask_labels(tokens.masks, mask),
                              tr.clip_labels(tokens.masks, mask, tokens.ratio_type))  # fmt: skip
            return
        old = inputs.get("old_per_token_logps")
        old = lp if old is None else old
        behaviour = inputs.get("sampling_per_token_logps", old)
        clipped = tr.ppo_clip_labels(torch.exp(lp - old), inputs["advantages"], mask, t.epsilon_low, t.epsilon_high)
        self._fill_tokens(inputs, lp, behaviour, [[None] * mask.size(1)] * mask.size(0), clipped)

    # ------------------------------------------------------------------ stage 3: the write
    def step_done(self) -> None:
        t = self.trainer
        if self.table is not None and compat.at_generation_boundary(t):
            self.write_token_records()

    def write_token_records(self) -> None:
        t = self.trainer
        table, self.table = self.table, None
        missing = table.missing()
        if missing:
            raise RuntimeError(f"token records of step {table.step}: no loss call filled the trained tokens of samples "
                               f"{missing[:5]}")
        cols = table.columns()
        if t.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            cols = {key: gather_object(values) for key, values in cols.items()}
            if not t.accelerator.is_main_process:
                return
        rollouts.write_shard(rollouts.token_shard_path(t.args.output_dir, table.step), cols, tr.features())
