"""Compatibility: every reach of the project into private internals of TRL, vLLM, accelerate, transformers, torch
and argparse, one named function each.

A reach is a use of something its library does not promise to keep: an underscore name (``trainer._metrics``,
``parser._actions``), a module global swapped while the library runs (``vllm_generation.LLM``), an engine's object
graph (``llm.llm_engine.model_executor...``), an undocumented module (``transformers.core_model_loading``). Each
function here is the one place the project does it; ``@reaches`` records what it touches (dotted targets), the
versions it was written and checked for, and why, in `REACHES`. `TRL_HOOKS` lists the TRL / transformers trainer
methods the project's trainers override or call, with the parameters the project relies on. ``tests/test_compat.py``
checks both against the installed versions, so a dependency bump that moves one of them fails there, by name, instead
of deep in a run.

Written for the versions of ``pyproject.toml`` / ``uv.lock`` (`VERSIONS`). Heavy dependencies (vLLM, TRL's vLLM
module) are imported inside the functions: ``import trl_ext.compat`` is cheap and works without vLLM.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager
from dataclasses import dataclass

VERSIONS = {"trl": "1.16.0", "transformers": "5.23.0", "accelerate": "1.15.0", "vllm": "0.30.0",
            "torch": "2.13", "argparse": "CPython 3.11"}  # fmt: skip
"""The versions every reach was read in and checked against (pyproject: trl==1.16.0, transformers>=5.20,<5.24,
accelerate>=1.10,<1.16, vllm==0.30.0)."""

TRL, TF, ACC, VLLM, TORCH = (f"{k} {VERSIONS[k]}" for k in ("trl", "transformers", "accelerate", "vllm", "torch"))
ARGPARSE = f"argparse ({VERSIONS['argparse']})"


@dataclass(frozen=True)
class Reach:
    """One function's reach: the dotted targets it relies on (``module.Class.attr``; an attribute that exists only
    on instances is found as ``self.attr`` in the class's source), the versions, the reason (its docstring's first
    line), and the optional dependency the targets need (``vllm``), or None."""

    function: str
    targets: tuple[str, ...]
    versions: str
    reason: str
    needs: str | None = None


REACHES: list[Reach] = []


def reaches(*targets: str, versions: str, needs: str | None = None):
    """Register the decorated function in `REACHES` with its ``targets``."""

    def register(fn):
        REACHES.append(Reach(fn.__name__, targets, versions, (fn.__doc__ or "").strip().splitlines()[0], needs))
        return fn

    return register


@dataclass(frozen=True)
class Hook:
    """A trainer method the project overrides or calls: the classes that must have it, the leading parameters
    (after ``self``, in order) the project's overrides take and pass on positionally, and parameters it passes or
    reads by name."""

    owners: tuple[str, ...]
    params: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()


_GRPO = ("trl.GRPOTrainer",)
_BOTH = ("trl.GRPOTrainer", "trl.SFTTrainer")  # the run lifecycle hooks: SFT mode's trainer has them too

TRL_HOOKS: dict[str, Hook] = {
    "__init__": Hook(_GRPO, ("model", "reward_funcs", "args"),
                     ("peft_config", "tools", "rollout_func", "environment_factory")),  # fmt: skip
    "_tokenize_prompts": Hook(_GRPO, ("prompts",)),
    "_generate": Hook(_GRPO, ("prompts",)),
    "_generate_single_turn": Hook(_GRPO, ("prompt_ids", "images", "multimodal_fields", "num_generations",
                                          "has_tool_images")),  # fmt: skip
    "_calculate_rewards": Hook(_GRPO, ("inputs", "prompts", "completions", "completion_ids_list")),
    "_generate_and_score_completions": Hook(_GRPO, ("inputs",)),
    "_prepare_inputs": Hook(_GRPO, ("generation_batch",)),
    "_get_per_token_logps_and_entropies": Hook(_GRPO, ("model", "input_ids", "attention_mask", "logits_to_keep",
                                                       "batch_size"), ("compute_entropy",)),  # fmt: skip
    "_compute_loss": Hook(_GRPO, ("model", "inputs")),
    "compute_loss": Hook(_GRPO, ("model", "inputs"), ("num_items_in_batch",)),
    "compute_loss_context_manager": Hook(_GRPO),
    "log": Hook(_GRPO, ("logs", "start_time")),
    "training_step": Hook(_BOTH, ("model", "inputs", "num_items_in_batch")),
    "train": Hook(_BOTH, ("resume_from_checkpoint",)),
    # transformers 5.23 calls create_optimizer(model) when it delays the optimizer (FSDP1, SageMaker MP), else
    # create_optimizer(): an override takes ``model=None``
    "create_optimizer": Hook(_GRPO, ("model",)),
    "_save": Hook(_GRPO, ("output_dir", "state_dict")),
    "_save_checkpoint": Hook(_BOTH, ("model", "trial")),
    "_load_from_checkpoint": Hook(_BOTH, ("resume_from_checkpoint", "model")),
    "_get_grad_norm": Hook(_BOTH, ("model", "grad_norm")),
    "create_accelerator_and_postprocess": Hook(_BOTH),
    "_prepare_for_training": Hook(_BOTH),  # passed on as *args, **kwargs; returns (model, dataloader)
}


# ---------------------------------------------------------------------------------------------------- argparse
@reaches("argparse.ArgumentParser._actions", versions=ARGPARSE)
def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every action of ``parser``, in the order added: argparse keeps them only in ``_actions``."""
    return parser._actions


@reaches("argparse.ArgumentParser._option_string_actions", versions=ARGPARSE)
def option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """``{option string: action}`` of ``parser`` (``--lr`` and ``--learning_rate`` alike): argparse's own index."""
    return parser._option_string_actions


@reaches("argparse._StoreFalseAction", versions=ARGPARSE)
def is_store_false(action: argparse.Action) -> bool:
    """Whether ``action`` is a ``store_false`` flag (HfArgumentParser's ``--no_X``): argparse names no public type."""
    return isinstance(action, argparse._StoreFalseAction)


@reaches("argparse.ArgumentParser._action_groups", "argparse._ArgumentGroup._group_actions",
         "argparse.ArgumentParser._optionals", versions=ARGPARSE)  # fmt: skip
def action_groups(parser: argparse.ArgumentParser) -> list[tuple[argparse._ArgumentGroup, list[argparse.Action]]]:
    """``(group, its actions)`` of ``parser``, both live lists (``--help`` prints them in this order)."""
    return [(group, group._group_actions) for group in parser._action_groups]


@reaches("argparse.ArgumentParser._action_groups", "argparse.ArgumentParser._optionals", versions=ARGPARSE)
def drop_empty_groups(parser: argparse.ArgumentParser) -> None:
    """Remove the argument groups left without actions (argparse's own optionals group stays)."""
    parser._action_groups = [g for g in parser._action_groups if g._group_actions or g is parser._optionals]


# ---------------------------------------------------------------------------------------------------- accelerate
@reaches("accelerate.state.PartialState._shared_state", versions=ACC)
def record_distributed_type(distributed_type) -> None:
    """Record ``distributed_type`` in PartialState's shared state, as ``AcceleratorState.__init__`` does."""
    from accelerate.state import PartialState

    PartialState._shared_state["distributed_type"] = distributed_type


# ---------------------------------------------------------------------------------------------------- transformers
@reaches("transformers.PreTrainedModel._no_split_modules", versions=TF)
def no_split_modules(model) -> set[str]:
    """The class names of ``model``'s decoder blocks as its family declares them (for device maps), or empty."""
    return set(getattr(model, "_no_split_modules", None) or ())


@reaches("transformers.PreTrainedModel._tied_weights_keys", "transformers.PreTrainedModel.all_tied_weights_keys",
         versions=TF)  # fmt: skip
def tied_weights_keys(model) -> set[str]:
    """The parameter names ``model`` ties to another (the expanded map, else its family's ``_tied_weights_keys``)."""
    return set(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or ())


@reaches("transformers.PreTrainedModel._tied_weights_keys", "transformers.PreTrainedModel.all_tied_weights_keys",
         versions=TF)  # fmt: skip
def rename_tied_weights(model, rename: dict[str, str]) -> None:
    """Rename tied parameters in ``model``'s tie maps (a wrapped head moved its weight), so ties stay true."""
    for attr in ("_tied_weights_keys", "all_tied_weights_keys"):
        if getattr(model, attr, None):
            setattr(model, attr, {rename.get(k, k): rename.get(v, v) for k, v in getattr(model, attr).items()})


@reaches("transformers.conversion_mapping.get_model_conversion_mapping",
         "transformers.core_model_loading.WeightRenaming", "transformers.core_model_loading.WeightConverter",
         "transformers.core_model_loading.rename_source_key", versions=TF)  # fmt: skip
def saved_key_renamer(model):
    """``key -> (model key, converter or None)``: from_pretrained's renaming of ``model``'s saved keys."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return lambda key: rename_source_key(key, renamings, converters)


@reaches("transformers.Trainer._get_output_dir", versions=TF)
def output_dir_of(trainer, trial=None) -> str:
    """The directory the Trainer writes ``checkpoint-N`` into (``output_dir``, or a hyperparameter search's)."""
    return trainer._get_output_dir(trial=trial)


@reaches("torch.nn.Module._non_persistent_buffers_set", versions=TORCH)
def is_persistent_buffer(module, name: str) -> bool:
    """Whether ``module``'s own buffer ``name`` goes into its state dict (torch keeps the others in a private set)."""
    return name not in module._non_persistent_buffers_set


@reaches("torch.distributed.fsdp.FSDPModule._get_fsdp_state", "torch.distributed.fsdp._fully_shard._fsdp_state."
         "FSDPState._lazy_init", versions=TORCH)  # fmt: skip
def fsdp2_lazy_init(model) -> None:
    """FSDP2's lazy initialisation of a prepared model, run now (else at its first forward)."""
    model._get_fsdp_state()._lazy_init()


# ---------------------------------------------------------------------------------------------------- TRL trainer
@reaches("trl.GRPOTrainer._metrics", versions=TRL)
def trl_metrics(trainer, mode: str | None = None):
    """TRL's metric lists of ``mode`` (default: the model's), ``{name: [value per step]}``, averaged at each log."""
    return trainer._metrics[mode or ("train" if trainer.model.training else "eval")]


@reaches("trl.GRPOTrainer._logs", versions=TRL)
def trl_logs(trainer) -> dict:
    """TRL's sample log (``prompt``, ``completion``, ``rewards``, ``advantages``, ...) since the last ``log``."""
    return trainer._logs


@reaches("trl.GRPOTrainer._step", versions=TRL)
def at_generation_boundary(trainer) -> bool:
    """Whether TRL's next ``_prepare_inputs`` starts a generation batch (``_step`` at a multiple of its length)."""
    return trainer._step % (trainer.args.steps_per_generation * trainer.num_iterations) == 0


@reaches("trl.GRPOTrainer._step", "trl.GRPOTrainer._buffered_inputs", "trl.GRPOTrainer._prepare_inputs",
         versions=TRL)  # fmt: skip
def new_generation_batch_due(trainer) -> bool:
    """Whether TRL's ``_prepare_inputs`` generates now: at a generation boundary, or with no buffer (a resume)."""
    return at_generation_boundary(trainer) or trainer._buffered_inputs is None


@reaches("trl.GRPOTrainer._buffered_inputs", versions=TRL)
def reset_buffered_inputs(trainer) -> None:
    """Drop TRL's buffered generation batch: its next ``_prepare_inputs`` builds one from the batch it is given."""
    trainer._buffered_inputs = None


@reaches("trl.GRPOTrainer._step", "trl.GRPOTrainer._current_train_step_time", "trl.GRPOTrainer._metrics",
         "trl.GRPOTrainer.training_step", versions=TRL)  # fmt: skip
def finish_training_step(trainer, started_at: float) -> None:
    """GRPOTrainer.training_step's bookkeeping, for a step that replaces it: ``_step`` and the ``step_time`` metric."""
    trainer._step += 1
    trainer._current_train_step_time += time.perf_counter() - started_at
    if trainer._step % trainer.current_gradient_accumulation_steps == 0:
        trainer._metrics["train"]["step_time"].append(trainer._current_train_step_time)
        trainer._current_train_step_time = 0.0


@reaches("trl.GRPOTrainer._tokenizer", versions=TRL)
def trl_tokenizer(trainer):
    """The trainer's text tokenizer (``processing_class``, or a processor's ``tokenizer``)."""
    return trainer._tokenizer


@reaches("trl.GRPOTrainer._tokenize_prompts", versions=TRL)
def tokenize_prompts(trainer, prompts: list):
    """``(prompt_ids, images, multimodal_fields)`` of ``prompts`` as the trainer tokenizes them (chat template)."""
    return trainer._tokenize_prompts(prompts)


@reaches("trl.GRPOTrainer._generate_single_turn", versions=TRL)
def generate_single_turn(trainer, prompt_ids, images=None, multimodal_fields=None, num_generations: int = 1):
    """One generation turn by the trainer's backend: ``(completion_ids, logprobs)`` (TRL may add more fields)."""
    return trainer._generate_single_turn(prompt_ids, images, multimodal_fields or {}, num_generations)


@reaches("trl.GRPOTrainer._get_per_token_logps_and_entropies", versions=TRL)
def per_token_logps(trainer, model, input_ids, attention_mask, logits_to_keep: int, batch_size: int | None = None,
                    compute_entropy: bool = False):  # fmt: skip
    """``(log-probs, entropies or None, aux loss or None)`` of the last ``logits_to_keep`` tokens, the trainer's way."""
    return trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                      compute_entropy=compute_entropy)  # fmt: skip


@reaches("trl.GRPOTrainer._get_tool_suffix_ids", "trl.GRPOTrainer._tokenizer", "trl.GRPOTrainer._is_vlm",
         "trl.GRPOTrainer.chat_template", "trl.GRPOTrainer.chat_template_kwargs", versions=TRL)
def tool_suffix_ids(tok, tool_messages: list[dict], chat_template: str | None) -> list[int]:
    """The tokens that render ``tool_messages`` between an assistant turn's end and the next generation start.

    TRL's ``GRPOTrainer._get_tool_suffix_ids``, called on a stand-in holding what it reads (the tokenizer, the
    training chat template, no images): the episode loop's tool environments (`trl_ext.env.tools`) play outside the
    trainer's thread."""
    from types import SimpleNamespace

    from trl import GRPOTrainer

    stand_in = SimpleNamespace(processing_class=tok, _tokenizer=tok, _is_vlm=False, chat_template=chat_template,
                               chat_template_kwargs={})  # fmt: skip
    return GRPOTrainer._get_tool_suffix_ids(stand_in, tool_messages)


@reaches("trl.trainer.utils.add_fused_lm_head", versions=TRL)
def is_trl_fused_head_forward(module, forward) -> bool:
    """Whether ``forward`` (an instance-level forward of ``module``) is TRL's fused-LM-head wrapper of its class's."""
    return getattr(getattr(forward, "__func__", forward), "__wrapped__", None) is type(module).forward


# ---------------------------------------------------------------------------------------------------- TRL's vLLM
@reaches("trl.generation.vllm_generation.LLM", versions=f"{TRL}, {VLLM}", needs="vllm")
@contextmanager
def swap_trl_vllm_llm(factory):
    """Within: TRL builds its colocate engine with ``factory(vllm.LLM)`` in place of ``vllm.LLM``; yields vllm.LLM."""
    from trl.generation import vllm_generation

    original = vllm_generation.LLM
    vllm_generation.LLM = factory(original)
    try:
        yield original
    finally:
        vllm_generation.LLM = original


@reaches("trl.GRPOTrainer.use_vllm", "trl.GRPOTrainer.vllm_mode", "trl.GRPOTrainer.vllm_generation",
         "trl.GRPOTrainer._last_loaded_step", versions=TRL)  # fmt: skip
def install_vllm_generation(trainer, generation, mode: str) -> None:
    """``generation`` (VLLMGeneration's ``sync_weights`` / ``generate``) as the engine of TRL's vLLM path."""
    trainer.use_vllm, trainer.vllm_mode, trainer._last_loaded_step = True, mode, -1  # -1: sync before the first step
    trainer.vllm_generation = generation


@reaches("trl.generation.vllm_generation.VLLMGeneration.sync_weights", versions=TRL)
def replace_colocate_sync(generation, sync) -> None:
    """TRL's weight sync of its engine replaced by ``sync()`` (TRL calls ``sync_weights()`` once per new step)."""
    generation.sync_weights = sync


@reaches("trl.generation.vllm_generation.VLLMGeneration.llm", "vllm.LLM.llm_engine",
         "vllm.v1.engine.llm_engine.LLMEngine.model_executor",
         "vllm.v1.executor.uniproc_executor.UniProcExecutor.driver_worker",
         "vllm.v1.worker.worker_base.WorkerBase.model_runner", versions=f"{TRL}, {VLLM}", needs="vllm")  # fmt: skip
def colocate_model_runner(generation):
    """The model runner of TRL's colocate engine (in-process, one worker): its model, ``reload_weights``."""
    return generation.llm.llm_engine.model_executor.driver_worker.model_runner


@reaches("trl.generation.vllm_generation.empty_cache",
         "trl.generation.vllm_generation.VLLMGeneration._llm_weights_sleeping", "vllm.LLM.wake_up",
         versions=f"{TRL}, {VLLM}", needs="vllm")  # fmt: skip
def wake_colocate_weights(generation) -> bool:
    """TRL's sleep-mode wake before a weight load (its ``sync_weights``); False when sleep mode is off."""
    if not generation.enable_sleep_mode:
        return False
    from trl.generation.vllm_generation import empty_cache

    empty_cache()
    generation.llm.wake_up(tags=["weights"])
    generation._llm_weights_sleeping = False
    return True


# ---------------------------------------------------------------------------------------------------- vLLM
_NCCL_TRAINER = "vllm.distributed.weight_transfer.nccl_engine.NCCLTrainerWeightTransferEngine"


VLLM_HOOKS: dict[str, Hook] = {
    "_broadcast": Hook((_NCCL_TRAINER,), ("source", "meta")),  # the gloo backend's send (serve/gloo_transfer.py)
}
"""vLLM methods the project's subclasses override, with the parameters they take."""


@reaches(f"{_NCCL_TRAINER}._broadcast", f"{_NCCL_TRAINER}._post_send_sync", versions=VLLM, needs="vllm")
def send_weights(sender, source, meta) -> None:
    """vLLM's trainer-side send of one update (``send_weights`` without its request): broadcast, then sync."""
    sender._broadcast(source, meta)
    sender._post_send_sync()


@reaches(f"{_NCCL_TRAINER}._checked_iter", versions=VLLM, needs="vllm")
def checked_weights(engine, source, meta):
    """``(name, tensor)`` of ``source`` checked against ``meta`` (names, shapes, dtypes), as vLLM's send reads them
    (a static method: ``engine`` may be the class)."""
    return engine._checked_iter(source, meta)
