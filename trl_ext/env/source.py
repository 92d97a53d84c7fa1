"""The run's episode source: what plays a batch's episodes, text environments (``--env``) or a tool environment
(``--env`` naming one, ``--env_factory``, or the Python API's ``environment_factory=``), through the one loop
`trl_ext.env.episodes.play`. The environment component builds it (`episode_source`) and the synchronous rollout, the
off-policy generator and the routing eval play with it (``trainer.episode_source``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from trl_ext.registry import ConfigError


@dataclass
class EpisodeSource:
    """``args``: the run's config (EnvArgs fields); ``factory``: the tool environment's (None: text environments);
    ``name``: its name in metrics and saved rollouts; ``turns``: its agent turns per episode."""

    args: object
    factory: Callable | None = None
    name: str = ""
    turns: int = 0
    heldout: Callable[[int], object] | None = None
    """``n -> Dataset`` of held-out rows (the routing eval), where the environment has them."""
    _tool_names: tuple[str, ...] | None = field(default=None, init=False, repr=False)

    @property
    def tools(self) -> bool:
        return self.factory is not None

    def episodes(self, rows: list[dict], tok) -> list:
        """One episode per generation-batch row (``prompt``, and ``env_seed`` / ``env`` for text environments, the
        columns reset reads for a tool environment)."""
        if self.tools:
            from trl_ext.env.tools import tool_episodes

            return tool_episodes(rows, self.factory, self.turns, tok, self.name)
        from trl_ext.env.episodes import row_envs, text_episodes

        return text_episodes([r["prompt"] for r in rows], [r["env_seed"] for r in rows], self.args, tok,
                             row_envs(rows))  # fmt: skip

    def play(self, rows: list[dict], tok, generate, lockstep=None, max_context: int | None = None) -> dict:
        """`trl_ext.env.episodes.play` on this batch's episodes; a tool environment's instances are returned under
        ``environments`` (TRL passes them to reward functions as ``environments=``)."""
        from trl_ext.env.episodes import play

        episodes = self.episodes(rows, tok)
        out = play(episodes, generate, lockstep, max_context if self.tools else None)
        if self.tools:
            out["environments"] = [e.instance for e in episodes]
            out["episode_prompts"] = [(e.messages, e.render_kwargs) for e in episodes]
        return out

    def heldout_rows(self, n: int, tok) -> list[dict]:
        """``n`` held-out rows (levels from ``HELDOUT_LEVELS``): the routing eval's. ValueError where a tool
        environment has none (the Python API's factory: set eval_routing_steps=0)."""
        if self.tools:
            if self.heldout is None:
                raise ValueError(f"the routing eval plays held-out levels; the tool environment {self.name} has none "
                                 "known (its class has no dataset(n_rows, heldout=False) classmethod): set "
                                 "eval_routing_steps=0")  # fmt: skip
            rows = self.heldout(n)
        else:
            from trl_ext.env.args import HELDOUT_LEVELS
            from trl_ext.env.episodes import env_dataset

            rows = env_dataset(self.args.build_env(), n, tok, start=HELDOUT_LEVELS)
        return [rows[i] for i in range(len(rows))]

    def log_words(self) -> tuple[tuple[str, ...] | None, dict | None]:
        """`trl_ext.env.episodes.log_episodes`' ``words`` and ``mixture``: a tool environment's tool names."""
        if self.tools:
            if self._tool_names is None:  # one probe instance per run, not one per batch
                from trl_ext.env.tools import tool_methods

                self._tool_names = tuple(sorted(t.__name__ for t in tool_methods(self.factory())))
            return self._tool_names, None
        from trl_ext.env.episodes import log_words

        return log_words(self.args)


def episode_source(args, environment_factory=None) -> EpisodeSource:
    """The run's `EpisodeSource`: the Python API's ``environment_factory`` (one factory; turns: ``--max_turns``,
    else TRL's ``max_tool_calling_iterations`` + 1, else the class's ``max_turns_default``; held-out rows from the
    class's ``dataset`` classmethod, if it has one), else ``args``' tool environment, else its text environments."""
    from trl_ext.env.tools import check_factory

    if environment_factory is not None:
        if isinstance(environment_factory, dict):
            raise ConfigError("environment_factory as a dict (TRL's several environments) is not supported by the "
                              "project's episode loop: give one factory (a mixture of text environments: --env a,b)")
        instance = check_factory(environment_factory, "environment_factory")
        turns = args.max_turns
        if turns is None and getattr(args, "max_tool_calling_iterations", None) is not None:
            turns = args.max_tool_calling_iterations + 1  # TRL: tool rounds, each followed by one more turn
        turns = turns if turns is not None else getattr(type(instance), "max_turns_default", None)
        if turns is None:
            raise ConfigError("environment_factory: set max_tool_calling_iterations (or max_turns) in the config, or "
                              "max_turns_default on the class: the episode needs a turn limit")  # fmt: skip
        rows = getattr(type(instance), "dataset", None)  # held-out rows for the routing eval, where the class has them
        heldout = (lambda n: rows(n, heldout=True)) if callable(rows) else None
        return EpisodeSource(args, environment_factory, type(instance).__name__, int(turns), heldout)
    if args.tool_env:
        return EpisodeSource(args, args.tool_factory(), args.env_names[0], args.tool_turns,
                             lambda n: args.tool_dataset(n, heldout=True))  # fmt: skip
    return EpisodeSource(args)


def take_episodes(trainer, ctx, out: dict) -> None:
    """A played batch's episodes (`EpisodeSource.play`'s output, edited in place) into the batch context:
    trajectories, a tool environment's prompts as rendered and its instances; metrics logged."""
    from trl_ext.env.episodes import log_episodes

    ctx.trajectories = out.pop("trajectories")
    ctx.episode_prompts = out.pop("episode_prompts", None)
    ctx.environments = out.pop("environments", None)
    log_episodes(trainer, ctx.trajectories, *trainer.episode_source.log_words())


def context_length(trainer) -> int | None:
    """The longest context the policy takes (a vLLM engine's ``max_model_len``, else the model's position limit):
    a tool episode ends before its context reaches it, as TRL's tool loop does."""
    if getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_mode", "") == "colocate":
        return trainer.vllm_generation.llm.llm_engine.model_config.max_model_len
    config = trainer.accelerator.unwrap_model(trainer.model).config
    return getattr(config, "max_position_embeddings", None)
