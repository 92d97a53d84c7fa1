"""Registration of dual LoRA, gradient routing and the RH detector (`trl_ext.parts.FEATURES` "routing")."""

from __future__ import annotations

from trl_ext.parts import FEATURES, Feature
from trl_ext.routing.args import RoutingArgs


class RoutingPart(Feature):
    """The RH detector (checked and monitored in every run, routed or not) and, with a dual adapter config, the dual
    LoRA / MLP adapters and gradient routing. Under FSDP2 (`trl_ext.routing.distributed`: each backward reduce-scatters
    into the shards, a routed-away side's shard restored; the routing eval generates from the sharded model as TRL
    does; adapter-only checkpoints filter the gathered full state dict). Not under DeepSpeed: not run there."""

    what = "gradient routing / dual LoRA"
    flags = RoutingArgs

    def selected(self, run, cfg) -> bool:
        return True

    def supports(self, launch) -> str | None:
        return None if launch.sharding == "FSDP" else launch.unsharded(self.what)

    def check(self, plan) -> None:
        from trl_ext.routing.args import check_run_routing

        check_run_routing(plan.run, plan.cfg, plan.reward_config)  # story and --env runs alike

    def contribute(self, build) -> None:
        from trl_ext.data.register import prompt_source
        from trl_ext.routing.setup import routing_setup

        plan = build.plan
        build.model, kwargs = routing_setup(plan.run, plan.cfg, plan.reward_config, build.model_path, build.tokenizer,
                                            prompt_source(plan.run), plan.eval_data)  # fmt: skip
        build.kwargs.update(kwargs)


FEATURES.add("routing", RoutingPart())
