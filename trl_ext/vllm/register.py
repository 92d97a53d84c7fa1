"""Registration of vLLM generation (`trl_ext.parts.GENERATION_SOURCES` "vllm": TRL's ``--use_vllm``), synchronous
(TRL's colocate engine with the project's weight sync, ``trl_ext.vllm.component``) or as the off-policy generator's
engine (``--max_async_level >= 1``, ``trl_ext.vllm.engine``)."""

from __future__ import annotations

from trl_ext.parts import GENERATION_SOURCES, GenerationSource


class VLLMPart(GenerationSource):
    """vLLM generation on one or several processes (each process its own engine), under DDP or FSDP2 (the weights
    reach the engines streamed from the shards: ``trl_ext.vllm.weights``); not under DeepSpeed."""

    what = "vLLM generation"
    flags = ("use_vllm",)

    def supports(self, launch) -> str | None:
        return None if launch.sharding == "FSDP" else launch.unsharded(self.what)

    def check(self, plan) -> None:
        import torch

        from trl_ext.models.arch import model_config
        from trl_ext.vllm.args import check_model, check_tied_head

        config = model_config(plan.run.model, plan.cfg.trust_remote_code)
        check_tied_head(config, "lm_head" if plan.cfg.dual_lora and plan.cfg.lora_lm_head else None)  # a PEFT
        # target is a block's linear (trl_ext.models.arch), never the head; a Python API model: `head_adapter`
        if plan.cfg.vllm_mode == "server":  # the server checked its model when it started
            return
        check_model(config, cuda=torch.cuda.is_available())


GENERATION_SOURCES.add("vllm", VLLMPart())
