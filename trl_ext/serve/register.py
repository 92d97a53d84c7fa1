"""Registration of the vLLM servers (`trl_ext.parts.FEATURES` "serve": TRL's ``--vllm_mode server`` with the
project's server engine, and ``--teacher_server_url``): at parse time every server must answer ``/health`` within
``--vllm_server_timeout`` seconds (exit 2 naming the URL), before any model loads."""

from __future__ import annotations

from contextlib import contextmanager

from trl_ext.parts import FEATURES, Feature
from trl_ext.serve.args import ServeArgs


class ServePart(Feature):
    """Policy and teacher servers (``trl_ext.serve``), from one trainer process or several (DDP, FSDP2: the weights
    are published once per step, streamed from the shards). Not under DeepSpeed: not run there."""

    what = "vLLM servers"
    flags = ServeArgs

    def selected(self, run, cfg) -> bool:
        return cfg.policy_servers or bool(cfg.teacher_server_url)

    def supports(self, launch) -> str | None:
        return None if launch.sharding == "FSDP" else launch.unsharded(self.what)

    started = True
    """Whether the servers are up when the run is checked: layout.py checks the trainer's plan before it starts them
    (`servers_not_started`); every other check runs then."""

    def check(self, plan) -> None:
        from trl_ext.serve.args import check_reachable, server_urls

        cfg = plan.cfg
        if not self.started:
            return
        if cfg.policy_servers:
            check_reachable(server_urls(cfg), cfg.vllm_server_timeout, "policy server")
        if cfg.teacher_server_url:
            check_reachable(server_urls(cfg, teacher=True), cfg.vllm_server_timeout, "teacher server")


SERVE = ServePart()
FEATURES.add("serve", SERVE)


@contextmanager
def servers_not_started():
    """train.py's checks without the servers' ``/health`` wait (layout.py, before it starts the servers)."""
    SERVE.started = False
    try:
        yield
    finally:
        SERVE.started = True
