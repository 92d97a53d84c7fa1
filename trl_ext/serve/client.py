"""The trainer's side of a vLLM server (`Replica`): health, what it serves, sampling with per-token log-probs at a
policy version, and scoring given tokens (prompt log-probs, for a teacher). Plain HTTP on vLLM's OpenAI-compatible
``/v1/completions``; the version headers are ``trl_ext.serve.endpoint``'s. `check_replicas` refuses at start a server
serving another model, tokenizer or log-prob mode; `concurrently` sends one request per row, `MAX_CONCURRENT` at once.

Faults fail loudly and name the replica (`ServerError`): a connection error or a 502/503/504 answer is retried once
after `RETRY_PAUSE_S`, then raises; a request that gets no answer within ``timeout`` seconds raises (no retry: the
server stopped answering). A request is never dropped: the batch is complete or the call raises. So a dead server
ends the step within ``RETRY_PAUSE_S`` seconds and a hung one within ``timeout``.

A server that layout.py restarts (``--max_server_restarts``; train.py's ``--vllm_server_restart_timeout``, the
replica's ``restart_wait``): a request that finds it unreachable waits up to ``restart_wait`` seconds for its
``/health`` (one thread of the process waits and says so; the others wait on it), then is sent again, to the same
replica, with its own seed and version (the restarted server loads the version's checkpoint: the same tokens as the
first server would have sampled). Up to `RESENDS` times per request; past ``restart_wait`` the call raises as above.
A pushed version (no checkpoint) does not survive a restart: the resend raises at once, naming the server (the step
fails; layout.py restarts the trainer from its last checkpoint).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from trl_ext.registry import ConfigError
from trl_ext.serve.endpoint import DIR_HEADER, INFO_PATH, SHAPE_KEYS, VERSION_HEADER, adapter_name

RETRY_PAUSE_S = 1.0
"""Seconds between a failed request and its one retry."""
RESENDS = 3
"""Sends of one request after its server came back (`Replica.recover`), at most: a server that dies again and again
fails the step."""
_TRANSIENT_STATUS = (502, 503, 504)
MAX_CONCURRENT = 64
"""Requests in flight at once from one trainer process (each a row)."""
PROBE_TEXT = "Once upon a time, 42 + 7 = 49. <answer> ok </answer>"
"""Text both tokenizers must split alike (`check_replicas`)."""


class ServerError(RuntimeError):
    """A vLLM server failed a request (unreachable, no answer in time, an error answer): the message names it."""


class Transient(Exception):
    """A failure worth one retry (connection error, 502/503/504); ``error`` is what the caller raises after it."""

    def __init__(self, error: ServerError) -> None:
        super().__init__(str(error))
        self.error = error


def retrying(send, recover=None):
    """``send()``, sent once more after `RETRY_PAUSE_S` when it raises `Transient`; the second failure raises. With
    ``recover`` (a server layout.py restarts): each `Transient` is followed by ``recover(failure)``, which returns once
    the server answers again (or raises the failure), and ``send()`` again, up to `RESENDS` times."""
    if recover is None:
        try:
            return send()
        except Transient:
            time.sleep(RETRY_PAUSE_S)
        return send()
    for _ in range(RESENDS):
        try:
            return send()
        except Transient as failure:
            recover(failure)
    return send()


class Replica:
    """One vLLM server at ``url`` (``http://host:port``). ``api_key``: vLLM's ``--api-key`` (sent as a Bearer
    token); ``timeout``: seconds a request may wait for its answer."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 300.0, restart_wait: float = 0.0,
                 say=None) -> None:  # fmt: skip
        """``restart_wait``: seconds a request that finds the server unreachable waits for it to answer ``/health``
        again (`recover`); 0: one retry after `RETRY_PAUSE_S`. ``say``: where a wait is reported (train.log)."""
        self.url, self.api_key, self.timeout, self.restart_wait = url.rstrip("/"), api_key, timeout, restart_wait
        self._local = threading.local()  # one HTTP session per thread (sessions are not shared between threads)
        self.model: str | None = None  # the served model name (`info`)
        self.say = say or (lambda text: print(text, flush=True))
        self.recoveries: list[float] = []  # seconds each wait for the server's return took (`recover`)
        self._recovering = threading.Lock()
        self._back_at = float("-inf")  # time.monotonic() at which the server last answered /health again

    def __repr__(self) -> str:
        return f"vLLM server {self.url}"

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def _request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None,
                 timeout: float | None = None, retry: bool = True, resend_check=None) -> requests.Response:  # fmt: skip
        """The answer to one request, retried once on a transient error when ``retry`` (module docstring);
        ``resend_check()`` runs after the server came back, before the request is sent again (it may raise)."""
        headers = dict(headers or {})
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        timeout = self.timeout if timeout is None else timeout

        def send() -> requests.Response:
            try:
                answer = self._session().request(method, self.url + path, json=body, headers=headers, timeout=timeout)
            except requests.Timeout as e:
                raise ServerError(f"{self} did not answer {path} within {timeout:g} s (--vllm_request_timeout)") from e
            except requests.ConnectionError as e:
                raise Transient(ServerError(f"{self} is unreachable ({path}): {e}")) from e
            if answer.status_code in _TRANSIENT_STATUS:
                raise Transient(ServerError(f"{self} answered {path} with {answer.status_code}: {answer.text[:500]}"))
            if answer.status_code >= 400:
                raise ServerError(f"{self} answered {path} with {answer.status_code}: {answer.text[:500]}")
            return answer

        recover = None
        if self.restart_wait > 0:
            def recover(failure: Transient) -> None:
                self.recover(failure)
                if resend_check is not None:
                    resend_check()

        try:
            return retrying(send, recover) if retry else send()
        except Transient as e:
            raise e.error from e

    def recover(self, failure: Transient) -> None:
        """Return once the server answers ``/health`` again, within ``restart_wait`` seconds of the failure (a
        restart by layout.py); else raise the failure's error. One thread waits and reports; the others, which saw
        the same outage, wait for it and return. A server that answers ``/health`` at once had a transient failure
        (a 502/503/504 answer, a dropped connection), not a restart: the request goes again after `RETRY_PAUSE_S`."""
        seen = time.monotonic()
        with self._recovering:
            up = self.healthy(timeout=5.0)
            if up and self._back_at >= seen - RETRY_PAUSE_S:
                return  # another request's wait has just ended: this one goes again
            if not up:
                self._wait_for_health(failure, seen)
                return
        time.sleep(RETRY_PAUSE_S)

    def _wait_for_health(self, failure: Transient, seen: float) -> None:
        self.say(f"{self} is unreachable ({failure}); waiting up to {self.restart_wait:g} s for it to answer "
                 "/health again (--vllm_server_restart_timeout)")
        deadline = seen + self.restart_wait
        while not self.healthy(timeout=min(5.0, max(0.5, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise ServerError(f"{failure.error} (and it did not answer /health again within "
                                  f"{self.restart_wait:g} s, --vllm_server_restart_timeout)") from failure
            time.sleep(0.5)
        self._back_at = time.monotonic()
        self.recoveries.append(round(self._back_at - seen, 2))
        self.say(f"{self} answers again after {self._back_at - seen:.1f} s (restart {len(self.recoveries)} "
                 "seen by this process); its requests are sent again")

    def healthy(self, timeout: float = 5.0) -> bool:
        """Whether ``GET /health`` answers 200 within ``timeout`` seconds (no retry)."""
        try:
            return self._session().get(self.url + "/health", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def info(self) -> dict:
        """``GET /v1/trl_ext/info`` (``trl_ext.serve.endpoint``): model, max_model_len, logprobs mode, dtype, weights
        directory, loaded version. A server without the project's middleware answers 404: a ServerError saying so."""
        try:
            info = self._request("GET", INFO_PATH).json()
        except ServerError as e:
            if " 404:" in str(e):
                raise ServerError(f"{self} has no {INFO_PATH}: start it with --middleware "
                                  "trl_ext.serve.endpoint.policy_versions (layout.py does)") from e
            raise
        self.model = info["served_model_name"]
        return info

    def tokenize(self, text: str) -> list[int]:
        """The server's tokenizer on ``text`` (vLLM's ``/tokenize``, without special tokens)."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        return list(self._request("POST", "/tokenize", body).json()["tokens"])

    def sample(self, prompt: list[int], *, max_tokens: int, temperature: float, seed: int | None,
               stop_token_ids: list[int], version: int | None = None,
               directory: str | None = None) -> tuple[list[int], list[float]]:  # fmt: skip
        """(token ids, their sampling log-probs) of one continuation of ``prompt``, stopping at a token of
        ``stop_token_ids`` (kept) or after ``max_tokens``; with ``version``, sampled by exactly that policy (its
        checkpoint ``directory``, or None where versions are pushed), which the server confirms. An adapter
        directory (``trl_ext.vllm.lora``) is asked for by its served name (``trl_ext.serve.endpoint.adapter_name``)."""
        model = self.model
        if directory is not None and os.path.isfile(os.path.join(directory, "adapter_config.json")):
            model = adapter_name(directory)
        body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": temperature,
                "seed": seed, "logprobs": 0, "return_token_ids": True, "ignore_eos": True,
                "stop_token_ids": list(stop_token_ids), "skip_special_tokens": False}  # fmt: skip
        headers = {} if version is None else {VERSION_HEADER: str(version)}
        if version is not None and directory is not None:  # else pushed (trl_ext.serve.transfer): no directory
            headers[DIR_HEADER] = directory
        check = None
        if version is not None and directory is None:  # pushed: a restarted server holds its start weights
            def check() -> None:
                if self.info()["version"] != version:
                    raise ServerError(f"{self} was restarted and holds no pushed version (version {version} was "
                                      "pushed to the server that died): the step fails, and the run resumes from its "
                                      "last checkpoint (layout.py restarts the trainer)")  # fmt: skip

        answer = self._request("POST", "/v1/completions", body, headers, resend_check=check)
        if version is not None and answer.headers.get(VERSION_HEADER) != str(version):
            raise ServerError(f"{self} served version {answer.headers.get(VERSION_HEADER)!r} for a request of "
                              f"version {version}: it does not run trl_ext.serve.endpoint")  # fmt: skip
        choice = answer.json()["choices"][0]
        ids, logps = list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])
        if len(ids) != len(logps):
            raise ServerError(f"{self} returned {len(ids)} tokens with {len(logps)} log-probs")
        return ids, logps

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """The log-prob of each token of ``ids`` after the first, given the tokens before it (vLLM's prompt
        log-probs: raw logits, temperature 1)."""
        body = {"model": self.model, "prompt": list(ids), "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
        rows = self._request("POST", "/v1/completions", body).json()["choices"][0]["prompt_logprobs"]
        if len(rows) != len(ids):
            raise ServerError(f"{self} returned {len(rows)} prompt log-probs for {len(ids)} tokens")
        return [row[str(tok)]["logprob"] for row, tok in zip(rows[1:], ids[1:], strict=True)]


_POOL: ThreadPoolExecutor | None = None
"""The request threads, kept for the process: each keeps its HTTP session (`Replica`), so connections are reused
from batch to batch."""


def concurrently(fn, items: list) -> list:
    """``[fn(x) for x in items]``, the calls sent from the process's request threads (`MAX_CONCURRENT`)."""
    global _POOL
    if len(items) <= 1:
        return [fn(x) for x in items]
    if _POOL is None:
        _POOL = ThreadPoolExecutor(MAX_CONCURRENT, thread_name_prefix="trl_ext_serve")
    return list(_POOL.map(fn, items))  # the first failure raises here: no row is dropped


def check_replicas(replicas: list[Replica], tokenizer, max_len: int | None, role: str,
                   model_config=None) -> list[dict]:  # fmt: skip
    """Each server's ``info``, refused (ConfigError naming it) when it cannot serve this run: another tokenizer (the
    probe text splits differently), a max_model_len below the run's longest sequence ``max_len``, sampled log-probs
    other than ``processed_logprobs`` (the policy's; they would not be the behaviour log-probs), or, with
    ``model_config`` (the policy's), another model (architecture or shape: the policy's checkpoints would not load)."""
    infos = []
    want = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
    for r in replicas:
        info = r.info()
        if (got := r.tokenize(PROBE_TEXT)) != want:
            raise ConfigError(f"{role} {r} serves {info['model']!r}, whose tokenizer differs from the run's "
                              f"({PROBE_TEXT!r}: {got[:12]} vs {want[:12]})")  # fmt: skip
        if max_len is not None and info["max_model_len"] < max_len:
            raise ConfigError(f"{role} {r}: max_model_len {info['max_model_len']} < the run's {max_len} tokens "
                              "(prompt + completion); restart it with a larger --max-model-len")
        if role == "policy server" and info["logprobs_mode"] != "processed_logprobs":
            raise ConfigError(f"{role} {r} returns {info['logprobs_mode']}: start it with --logprobs-mode "
                              "processed_logprobs (the behaviour log-probs are log_softmax(logits / T))")
        if model_config is not None:
            ours = {k: getattr(model_config, k, None) for k in SHAPE_KEYS}
            ours["architectures"] = list(ours["architectures"] or []) or None  # none recorded: not compared
            theirs = {k: info["shape"].get(k) for k in SHAPE_KEYS}
            theirs["architectures"] = list(theirs["architectures"] or [])
            differ = {k: (theirs[k], ours[k]) for k in SHAPE_KEYS if theirs[k] != ours[k] and ours[k] is not None}
            if differ:
                raise ConfigError(f"{role} {r} serves another model than the run's ({info['model']!r}; server vs "
                                  f"run: {differ}): start it on --model")  # fmt: skip
        infos.append(info)
    return infos
