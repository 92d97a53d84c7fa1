"""What a launch refuses, asked of the registered parts (`trl_ext.parts`): this module knows processes and sharding,
the parts know themselves. `Launch` describes a launch and words the two refusals a part may give
(`Launch.one_process`, `Launch.unsharded`); `check_launch` asks every part that a flag of the parsed arguments
engages (`Part.flag`) whether it `supports` the launch, and names the flag in the refusal."""

from __future__ import annotations

from dataclasses import dataclass

from trl_ext.registry import ConfigError

ONE_PROCESS = "runs on one process for now"


@dataclass(frozen=True)
class Launch:
    """How train.py was started: its processes (count, and the launcher's variable that says so) and the sharding of
    its training state ("FSDP", "DeepSpeed", or None)."""

    processes: int = 1
    variable: str | None = None
    sharding: str | None = None

    def one_process(self, what: str) -> str | None:
        """The refusal of ``what`` (a part that runs on one process only) under several processes; None on one."""
        n, var = self.processes, self.variable
        if n == 1:
            return None
        return (f"{what} {ONE_PROCESS}; this launch has {n} processes ({var}={n}). Start train.py once, without "
                "torchrun/accelerate launch, or drop the flag")

    def unsharded(self, what: str, why: str | None = None) -> str | None:
        """The refusal of ``what`` (a part not run under sharding: it reads or copies whole parameters, or ``why``)
        under FSDP or DeepSpeed; None unsharded."""
        kind = self.sharding
        if kind is None:
            return None
        why = why or f"it reads or copies whole parameters, which {kind} may shard"
        return f"{what} has not been run under {kind} ({why}); run it without {kind} (DDP or one process)"


def shown(flag: str, value) -> str:
    """A flag as the command line reads it: ``--flag`` (a boolean) or ``--flag value``."""
    return f"--{flag}" if isinstance(value, bool) else f"--{flag} {value}"


def check_launch(args, launch: Launch) -> None:
    """ConfigError ``--flag value: <the part's reason>`` for the first registered part (registration order) that a flag
    of ``args`` (a RunArgs or an ExtGRPOConfig) engages and that refuses ``launch``."""
    from trl_ext.parts import registered

    for part in registered():
        found = part.flag(args)
        reason = part.supports(launch) if found is not None else None
        if reason is not None:
            raise ConfigError(f"{shown(*found)}: {reason}")


def refused_flags(launch: Launch) -> list[tuple[str, str]]:
    """(flag, part) of every flag whose part refuses ``launch``, in registration order."""
    from trl_ext.parts import registered

    return [(name, part.what) for part in registered() if part.supports(launch) for name in part.flag_names()]
