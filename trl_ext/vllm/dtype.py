"""The dtype of an in-process vLLM engine (``--vllm_dtype``)."""

from __future__ import annotations

import torch


def policy_dtype(model) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def engine_dtype(args, model) -> str:
    """The dtype an in-process vLLM engine runs ``model`` in: ``--vllm_dtype``; its "auto" is bfloat16 on CUDA and
    the policy's own dtype without (vLLM's own "auto" would downcast a float32 model to bfloat16,
    ``vllm.config.model._resolve_auto_dtype``, and the CPU tests check the log-probs to float error)."""
    if args.vllm_dtype != "auto":
        return args.vllm_dtype
    return "bfloat16" if torch.cuda.is_available() else policy_dtype(model)
