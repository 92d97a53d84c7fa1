"""The client's side of a server restarted by layout.py (`trl_ext.serve.client.Replica` with ``restart_wait``,
train.py's ``--vllm_server_restart_timeout``), on a local HTTP stand-in that goes away and comes back on the same
port: the requests in flight wait for it and are sent again (none dropped), one thread reports the wait, a pushed
version does not survive the restart, and the wait is bounded."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trl_ext.serve import client as client_mod
from trl_ext.serve.client import Replica, ServerError, concurrently


class _Server(BaseHTTPRequestHandler):
    """``/health``; ``/v1/completions`` answers the row's seed as its token (so each answer shows which request it
    is); ``/v1/trl_ext/info`` reports ``loaded`` as the served version."""

    loaded = None
    seen: list = []

    def log_message(self, *a):
        pass

    def _send(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        if "X-Policy-Version" in self.headers:
            self.send_header("X-Policy-Version", self.headers["X-Policy-Version"])
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._send(200, {})
        else:
            self._send(200, {"version": self.loaded, "served_model_name": "m"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(body["seed"])
        time.sleep(0.05)
        self._send(200, {"choices": [{"token_ids": [body["seed"]], "logprobs": {"token_logprobs": [-1.0]}}]})


def _serve(port: int = 0) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _down(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def _fast_retry(monkeypatch):
    monkeypatch.setattr(client_mod, "RETRY_PAUSE_S", 0.01)
    _Server.loaded, _Server.seen = None, []


def _sample(replica: Replica, seed: int, directory: str | None = "/w/v3"):
    return replica.sample([1, 2], max_tokens=1, temperature=1.0, seed=seed, stop_token_ids=[], version=3,
                          directory=directory)  # fmt: skip


def test_requests_wait_for_a_restarted_server_and_are_sent_again(tmp_path):
    """The server is down when 16 rows are sent and comes back 1.5 s later on its port: every row is answered, each
    with its own seed (nothing dropped or answered twice in the batch), one thread said it waited and one that the
    server is back, and the replica records one restart seen."""
    server = _serve()
    port = server.server_address[1]
    _down(server)
    said = []
    replica = Replica(f"http://127.0.0.1:{port}", restart_wait=20.0, say=said.append)
    threading.Timer(1.5, lambda: _serve(port)).start()
    start = time.monotonic()
    out = concurrently(lambda seed: _sample(replica, seed), list(range(16)))
    assert [ids for ids, _ in out] == [[seed] for seed in range(16)]
    assert sorted(set(_Server.seen)) == list(range(16))
    assert 1.4 < time.monotonic() - start < 10
    assert len(said) == 2 and "waiting up to 20 s" in said[0] and "answers again after" in said[1], said
    assert len(replica.recoveries) == 1 and replica.recoveries[0] >= 1.0


def test_without_a_restart_wait_the_outage_fails_the_step_after_one_retry():
    """``restart_wait`` 0 (no launcher restarts the server): one retry, then the error naming the server."""
    server = _serve()
    port = server.server_address[1]
    _down(server)
    threading.Timer(1.0, lambda: _serve(port)).start()
    with pytest.raises(ServerError, match=f"vLLM server http://127.0.0.1:{port} is unreachable"):
        _sample(Replica(f"http://127.0.0.1:{port}"), 0)


def test_the_wait_is_bounded():
    """A server that does not come back within ``restart_wait`` fails the request, saying so."""
    server = _serve()
    port = server.server_address[1]
    _down(server)
    start = time.monotonic()
    with pytest.raises(ServerError, match=r"did not answer /health again within 1.5 s"):
        _sample(Replica(f"http://127.0.0.1:{port}", restart_wait=1.5, say=lambda _: None), 0)
    assert time.monotonic() - start < 5


def test_a_pushed_version_does_not_survive_a_restart():
    """A request of a pushed version (no checkpoint directory) to a restarted server, which serves no version,
    fails at once naming it (instead of waiting out --vllm_request_timeout for a push that never comes); a
    checkpointed version is sent again (the restarted server loads its directory)."""
    server = _serve()
    port = server.server_address[1]
    _down(server)
    replica = Replica(f"http://127.0.0.1:{port}", timeout=60.0, restart_wait=20.0, say=lambda _: None)
    threading.Timer(0.5, lambda: _serve(port)).start()
    start = time.monotonic()
    with pytest.raises(ServerError, match="was restarted and holds no pushed version"):
        _sample(replica, 0, directory=None)
    assert time.monotonic() - start < 10 and _Server.seen == []
    assert _sample(replica, 1)[0] == [1]  # the same replica serves a checkpointed version


def test_a_restarted_trainers_version_is_loaded_from_its_own_directory():
    """A trainer restarted from checkpoint N publishes version N again under a new directory while the server (left
    running) still holds the dead trainer's version N: the gate loads the new directory (a version is its
    directory's weights, not its number); the same directory again is not reloaded."""
    import asyncio

    from trl_ext.serve.endpoint import VersionGate

    loads = []

    async def scenario():
        gate = VersionGate()

        def loader(directory):
            async def load():
                loads.append(directory)
            return load

        for directory in ("/w/old/v00000004", "/w/old/v00000004", "/w/new/v00000004", "/w/new/v00000004"):
            await gate.enter(4, loader(directory), directory)
            assert gate.serves(4, directory) and gate.source == directory
            await gate.leave()
        assert gate.serves(4) and not gate.serves(4, "/w/old/v00000004") and not gate.serves(3)

    asyncio.run(scenario())
    assert loads == ["/w/old/v00000004", "/w/new/v00000004"]


def test_a_busy_answer_is_not_taken_for_a_restart():
    """A server that answers 503 once but answers /health is busy, not restarted: the request goes again after the
    retry pause, nothing is reported and no restart is counted."""

    class Busy(_Server):
        posts = 0

        def do_POST(self):
            Busy.posts += 1
            if Busy.posts == 1:
                self.rfile.read(int(self.headers["Content-Length"]))
                self._send(503, {"error": "busy"})
                return
            super().do_POST()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    said = []
    replica = Replica(f"http://127.0.0.1:{server.server_address[1]}", restart_wait=20.0, say=said.append)
    try:
        assert _sample(replica, 5)[0] == [5]
    finally:
        _down(server)
    assert Busy.posts == 2 and said == [] and replica.recoveries == []
