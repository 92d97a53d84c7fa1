"""The flags of the vLLM servers (`ServeArgs`): the policy's servers are TRL's ``--vllm_mode server`` with TRL's
``--vllm_server_base_url`` (one URL, or several comma-separated: the replicas) or ``--vllm_server_host`` /
``--vllm_server_port``; the teacher's are ``--teacher_server_url``. `server_urls` and `check_reachable` are the
parse-time side (a server that does not answer in ``--vllm_server_timeout`` seconds: exit 2 naming its URL)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from urllib.parse import urlparse

from trl import GRPOConfig

from trl_ext.registry import ConfigError

_ADDRESSES = ("vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout")
"""TRL's fields that name the policy servers and how long to wait for them (the timeout last)."""


@dataclass
class ServeArgs:
    _argument_group_name = "vLLM servers (trl_ext.serve)"  # train.py --help group (cli_help.py)

    vllm_request_timeout: float = field(
        default=300.0,
        metadata={"help": "Seconds a request to a vLLM server (--vllm_mode server, --teacher_server_url) may wait for "
                  "its answer; a server that stops answering ends the run with an error naming it after this long "
                  "(an unreachable one after one retry, 1 s later). A request is never dropped."},
    )  # fmt: skip
    vllm_server_restart_timeout: float = field(
        default=0.0,
        metadata={"help": "Seconds a request to an unreachable vLLM server waits for it to answer /health again (a "
                  "server layout.py restarts: its --max_server_restarts; layout.py sets this to its --server_timeout) "
                  "before the step fails; the request is then sent again with its own seed and version. 0: one retry "
                  "after 1 s."},
    )  # fmt: skip
    vllm_weight_transfer: str = field(
        default="files",
        metadata={"help": "How each policy version reaches the policy servers (--vllm_mode server): 'files' (a "
                  "checkpoint in the servers' weights directory, which each reloads; across machines on a shared "
                  "filesystem), 'nccl' (vLLM's NCCL weight transfer: process 0 broadcasts the weights to every "
                  "server's GPUs; CUDA) or 'gloo' (the same transfer over gloo, on CPU). At --max_async_level >= 1 a "
                  "version is pushed once no batch still to be sampled needs an older one, else it goes as a "
                  "checkpoint. The servers must be started for it (layout.py does).",
                  "choices": ["files", "nccl", "gloo"]},
    )  # fmt: skip
    vllm_weight_transfer_address: str = field(
        default="",
        metadata={"help": "With --vllm_weight_transfer nccl|gloo: the address at which the policy servers reach this "
                  "run's process 0 (it hosts the transfer's rendezvous). Empty: 127.0.0.1, allowed only when every "
                  "policy server is on loopback."},
    )  # fmt: skip
    teacher_server_url: str = field(
        default="",
        metadata={"help": "Distillation's teacher on vLLM servers (seed 002's --teacher_gpu_ids): one URL or several "
                  "comma-separated, each a server of the teacher model started by layout.py (docs/layout.md). The "
                  "teacher's log-probs of the student's tokens are the servers' prompt log-probs (temperature 1). "
                  "Replaces --teacher_model; empty: the in-process teacher."},
    )  # fmt: skip

    @property
    def policy_servers(self) -> bool:
        return bool(self.use_vllm) and self.vllm_mode == "server"

    def validate_serve(self) -> None:
        """Raise ConfigError for server settings that cannot run or would be ignored (called by ExtGRPOConfig)."""
        own = {f.name: f.default for f in fields(ServeArgs)}
        if not self.vllm_request_timeout > 0:
            raise ConfigError(f"--vllm_request_timeout must be > 0, got {self.vllm_request_timeout}")
        for name in ("vllm_request_timeout", "vllm_server_restart_timeout"):
            if getattr(self, name) != own[name] and not (self.policy_servers or self.teacher_server_url):
                raise ConfigError(f"--{name} applies to vLLM servers: --use_vllm --vllm_mode server or "
                                  "--teacher_server_url")
        if self.vllm_server_restart_timeout < 0:
            raise ConfigError(f"--vllm_server_restart_timeout must be >= 0 (0: no wait), got "
                              f"{self.vllm_server_restart_timeout}")
        self._validate_transfer()
        if self.policy_servers:
            server_urls(self)
        else:
            defaults = {f.name: f.default for f in fields(GRPOConfig)}
            addresses = _ADDRESSES if not self.teacher_server_url else _ADDRESSES[:-1]  # the timeout: its health too
            for name in addresses:
                if getattr(self, name) != defaults[name]:
                    raise ConfigError(f"--{name} addresses the policy's vLLM servers: it applies only with --use_vllm "
                                      "--vllm_mode server")
        if not self.teacher_server_url:
            return
        server_urls(self, teacher=True)
        if not (self.distill_on and self.teacher_tau > 0):
            raise ConfigError("--teacher_server_url scores the teacher term of distillation: it needs "
                              "--teacher_tau > 0")
        if self.teacher_model:
            raise ConfigError("--teacher_server_url is the teacher: drop --teacher_model (start the teacher server on "
                              "that model: layout.py --teacher_model)")
        if self.eval_baseline:
            raise ConfigError("--eval_baseline samples the teacher in process: not with --teacher_server_url")
        if self.temperature != 1.0:
            raise ConfigError(f"--teacher_server_url: vLLM's prompt log-probs are at temperature 1 (they skip the "
                              f"sampling processors), the run samples at --temperature {self.temperature}; use the "
                              "in-process teacher or temperature 1")  # fmt: skip


    def _validate_transfer(self) -> None:
        own = {f.name: f.default for f in fields(ServeArgs)}
        if self.vllm_weight_transfer == own["vllm_weight_transfer"]:
            if self.vllm_weight_transfer_address != own["vllm_weight_transfer_address"]:
                raise ConfigError("--vllm_weight_transfer_address is where servers reach a pushing trainer: it needs "
                                  "--vllm_weight_transfer nccl or gloo")  # fmt: skip
            return
        how = f"--vllm_weight_transfer {self.vllm_weight_transfer}"
        if self.vllm_weight_transfer not in ("nccl", "gloo"):
            raise ConfigError(f"{how}: choose files, nccl or gloo")
        if not self.policy_servers:
            raise ConfigError(f"{how} pushes weights into the policy servers: it needs --use_vllm --vllm_mode server")
        if self.vllm_weight_transfer == "nccl":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(f"{how} broadcasts from the trainer's GPU (vLLM's NCCL engine): no CUDA here; on "
                                  "CPU use gloo")  # fmt: skip
        if not self.vllm_weight_transfer_address:
            remote = [u for u in server_urls(self) if urlparse(u).hostname not in ("127.0.0.1", "localhost", "::1")]
            if remote:
                raise ConfigError(f"{how}: {remote[0]} is not on loopback; name the address at which it reaches "
                                  "this run's process 0: --vllm_weight_transfer_address")  # fmt: skip

    @property
    def weight_transfer_address(self) -> str:
        return self.vllm_weight_transfer_address or "127.0.0.1"


def _url(text: str, flag: str) -> str:
    parsed = urlparse(text.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.port is None:
        raise ConfigError(f"{flag}: {text.strip()!r} is not a server URL (http://HOST:PORT)")
    return text.strip().rstrip("/")


def server_urls(cfg, teacher: bool = False) -> list[str]:
    """The URLs of the policy's servers (``--vllm_server_base_url``, comma-separated, else
    ``http://--vllm_server_host:--vllm_server_port``) or, with ``teacher``, of ``--teacher_server_url``."""
    if teacher:
        raw, flag = cfg.teacher_server_url, "--teacher_server_url"
    elif cfg.vllm_server_base_url:
        raw, flag = cfg.vllm_server_base_url, "--vllm_server_base_url"
    else:
        raw, flag = f"http://{cfg.vllm_server_host}:{cfg.vllm_server_port}", "--vllm_server_host/--vllm_server_port"
    urls = [_url(u, flag) for u in raw.split(",") if u.strip()]
    if not urls:
        raise ConfigError(f"{flag} names no server")
    if len(set(urls)) != len(urls):
        raise ConfigError(f"{flag} names a server twice: {raw}")
    return urls


def check_reachable(urls: list[str], timeout: float, role: str) -> None:
    """ConfigError naming the first of ``urls`` whose ``/health`` does not answer 200 within ``timeout`` seconds
    (all polled together; a starting server answers once its model is loaded)."""
    from trl_ext.serve.client import Replica

    waiting = [Replica(u) for u in urls]
    deadline = time.monotonic() + timeout
    while waiting:
        waiting = [r for r in waiting if not r.healthy(timeout=min(5.0, max(0.5, deadline - time.monotonic())))]
        if waiting and time.monotonic() >= deadline:
            raise ConfigError(f"{role} {waiting[0].url} did not answer GET /health within {timeout:g} s "
                              "(--vllm_server_timeout): start it first (layout.py starts the servers and the trainer "
                              "together: docs/layout.md)")  # fmt: skip
        if waiting:
            time.sleep(0.5)
