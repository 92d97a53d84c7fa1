"""Registration of dual LoRA, gradient routing and the RH detector (`trl_ext.parts.FEATURES` "routing")."""

from __future__ import annotations

from trl_ext.parts import FEATURES, Feature
from trl_ext.routing.args import RoutingArgs


class Routing(Feature):
    """The RH detector (checked and monitored in every run, routed or not) and, with a dual adapter config, the dual
    LoRA / MLP adapters and gradient routing. Not under FSDP / DeepSpeed: routing masks per-sample adapter gradients
    in its own autograd function, which reads whole parameters."""

    what = "gradient routing / dual LoRA"
    flags = RoutingArgs

    def selected(self, run, cfg) -> bool:
        return True

    def supports(self, launch) -> str | None:
        return launch.unsharded(self.what)

    def check(self, plan) -> None:
        from trl_ext.routing.args import check_run_routing

        check_run_routing(plan.run, plan.cfg, plan.reward_config)  # story and --env runs alike

    def contribute(self, build) -> None:
        from trl_ext.prompts import prompt_source
        from trl_ext.routing.setup import routing_setup

        plan = build.plan
        build.model, kwargs = routing_setup(plan.run, plan.cfg, plan.reward_config, build.model_path, build.tokenizer,
                                            prompt_source(plan.run), plan.eval_data)  # fmt: skip
        build.kwargs.update(kwargs)


FEATURES.add("routing", Routing())
