"""The project's one addition to vLLM's own OpenAI-compatible server: policy versions on `/v1/completions`.

It runs inside the server process, loaded with vLLM's documented ``--middleware trl_ext.serve.endpoint.policy_versions``
(``vllm/entrypoints/serve/middleware/register.py``); everything else is vLLM's server as it ships. No dev mode: the
arbitrary ``/collective_rpc`` route stays off, and the only weight operations a client can ask for are these.

A completion request may carry ``X-Policy-Version: v`` and ``X-Policy-Dir: DIR`` (the checkpoint of version v that
the trainer published, ``trl_ext.vllm.publish``). The server then answers it with exactly version v: if another
version is loaded, the request waits until no request of that version is running, the checkpoint is reloaded into
every worker (vLLM's ``reload_weights``, prime-rl's path) and the prefix cache is reset. Requests of one version run
together (a batch of several trainer processes shares the server), requests of different versions never overlap;
a versioned request must not stream (its answer is sent once its generation has ended).
The response repeats ``X-Policy-Version``: the version that served it, which the trainer checks against the one it
stamps on the tokens.

A version published as a LoRA adapter (``--vllm_lora_sync``: ``X-Policy-Dir`` an adapter directory,
``trl_ext.vllm.lora``; the server started with ``--enable-lora``) is served on its base checkpoint (the ``base``
directory beside it), which the gate loads once like a version (`BASE_VERSION`); the adapter is registered with
vLLM's own ``load_lora_adapter`` under `adapter_name` (the name the request's ``model`` gives) at its first request,
and requests of several adapter versions run together. ``adapter_loads`` counts the adapters taken.

With ``--weight-transfer-config`` the server also takes pushed versions (``trl_ext.serve.transfer``) on
``POST /v1/trl_ext/weights/{init,start,update,finish}``: vLLM's weight-transfer calls, the gate held from ``start``
(once no request runs) to ``finish``; a completion request without ``X-Policy-Dir`` waits for its version's push.

Security: the routes are under ``/v1``, and they check vLLM's own API keys (``--api-key`` or ``VLLM_API_KEY``)
(middlewares added by ``--middleware`` run before vLLM's authentication). A directory is loaded only when it lies
under ``TRL_EXT_WEIGHTS_DIR`` (the server's environment; unset, no weights are loaded): a client can choose a
version among the checkpoints published there, not a file on the host. ``GET /v1/trl_ext/info`` tells a client what
the server runs (model, loaded version, logprobs mode, max_model_len, weights directory, weight transfer) and how each
version it served arrived: ``pushes`` (pushed versions served) and ``checkpoint_loads`` (checkpoints reloaded),
``loads`` their sum; the server's log gets a line for each (`served`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import time

VERSION_HEADER = "X-Policy-Version"
DIR_HEADER = "X-Policy-Dir"
INFO_PATH = "/v1/trl_ext/info"
PUSH_PATH = "/v1/trl_ext/weights/"
"""The push routes (``init``, ``start``, ``update``, ``finish``): vLLM's weight-transfer control plane, gated."""
WEIGHTS_ENV = "TRL_EXT_WEIGHTS_DIR"
GATED_PATHS = ("/v1/completions",)
BASE_VERSION = -1
"""The gate's version while the base weights of adapter versions are loaded (every adapter version runs on it)."""
ADAPTERS_KEPT = 16
"""Adapters a server keeps registered: older ones are unregistered (vLLM's engine evicts its own cache)."""
SHAPE_KEYS = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size")  # fmt: skip
"""The model config fields a policy server reports (``/v1/trl_ext/info``): the trainer's model must have the same."""


def adapter_name(directory: str) -> str:
    """The name an adapter version is served under (the request's ``model``): from its resolved directory."""
    return "trl_ext-" + hashlib.sha256(os.path.realpath(directory).encode()).hexdigest()[:16]


def inside(directory: str, root: str) -> bool:
    """Whether ``directory`` (resolved: no ``..`` or link escapes) lies strictly under ``root``."""
    d, r = os.path.realpath(directory), os.path.realpath(root)
    return d != r and os.path.commonpath([d, r]) == r


def takes_pushes(engine) -> bool:
    """Whether the server was started to take pushed weights (``--weight-transfer-config``); the push routes answer
    409 otherwise, before the gate or the engine is touched."""
    return engine.vllm_config.weight_transfer_config is not None


def authorized(header: str | None, keys: list[str]) -> bool:
    """vLLM's check (``AuthenticationMiddleware.verify_token``): a ``Bearer`` token equal to one of ``keys``, compared
    in constant time; no keys, no check."""
    if not keys:
        return True
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.encode()).digest()
    return any(secrets.compare_digest(digest, hashlib.sha256(k.encode()).digest()) for k in keys)


class VersionGate:
    """The loaded version and the requests running on it: `enter(version, load)` waits until ``version`` is loaded
    (loading it with ``load()`` once no request of another version runs), `leave()` ends a request. First come,
    first served between versions: once a request waits for another version, later requests of the loaded one wait
    behind it (no version starves)."""

    def __init__(self) -> None:
        self.version: int | None = None  # None: the weights the server started with
        self.source: str | None = None  # the checkpoint directory the loaded version came from (None: pushed)
        self.pending: int | None = None  # the version the first waiting request needs
        self.active = 0
        self.pushing: int | None = None  # the version a push is writing (`begin_push`)
        self.push_start = 0.0
        self.pushes = 0  # pushed versions served (`end_push` with every tensor arrived)
        self.checkpoint_loads = 0  # checkpoints loaded (`enter` with a ``load``)
        self.adapter_loads = 0  # adapter versions registered (`take_adapter`)
        self.adapters: list[str] = []  # their names, oldest first
        self.adapter_lock = asyncio.Lock()
        self.load_seconds = 0.0
        self.cond = asyncio.Condition()

    @property
    def loads(self) -> int:
        """Versions loaded, pushed or from a checkpoint."""
        return self.pushes + self.checkpoint_loads

    def served(self, how: str, seconds: float) -> None:
        """One line on the server's output (its log) for a version it now serves (``how``: pushed, or the
        checkpoint's load), whatever ``VLLM_LOGGING_LEVEL`` says (TRL's import sets it to ERROR, and layout.py's
        servers inherit that)."""
        print(f"trl_ext: serving policy version {self.version}, {how} in {seconds:.3f} s (pushes {self.pushes}, "
              f"checkpoint loads {self.checkpoint_loads})", flush=True)  # fmt: skip

    def serves(self, version: int, source: str | None = None) -> bool:
        """Whether ``version`` is loaded, from the checkpoint ``source`` when given: a restarted trainer publishes
        its versions again under new directories, and a version is the weights of its directory, not its number."""
        return self.version == version and (source is None or self.source == source)

    async def enter(self, version: int, load=None, source: str | None = None) -> None:
        """Wait until ``version`` is loaded, then count this request as running on it. ``load``: how to load it
        (the checkpoint ``source``); None: it is pushed (`begin_push` ... `end_push`), so wait for the push."""
        async with self.cond:
            while not (self.serves(version, source) and self.pending in (None, version) and self.pushing is None):
                if load is not None and self.pushing is None:
                    if self.pending is None:
                        self.pending = version
                    if self.pending == version and self.active == 0:
                        start = time.perf_counter()
                        try:
                            await load()
                        finally:
                            self.pending = None
                            self.cond.notify_all()
                        self.version, self.source = version, source
                        self.checkpoint_loads += 1
                        seconds = time.perf_counter() - start
                        self.load_seconds += seconds
                        self.served("checkpoint loaded", seconds)
                        break
                await self.cond.wait()
            self.active += 1

    async def take_adapter(self, models, name: str, directory: str) -> str | None:
        """Register the adapter in ``directory`` as ``name`` with vLLM's ``models`` (``OpenAIServingModels``), once;
        unregister the oldest beyond `ADAPTERS_KEPT`. Returns vLLM's error, or None."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

        async with self.adapter_lock:
            if name in self.adapters:
                return None
            start = time.perf_counter()
            out = await models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=name, lora_path=directory))
            if isinstance(out, ErrorResponse):
                return out.error.message
            self.adapters.append(name)
            self.adapter_loads += 1
            seconds = time.perf_counter() - start
            self.load_seconds += seconds
            print(f"trl_ext: adapter {directory} taken in {seconds:.3f} s (adapter loads {self.adapter_loads}, "
                  f"checkpoint loads {self.checkpoint_loads})", flush=True)  # fmt: skip
            while len(self.adapters) > ADAPTERS_KEPT:
                await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=self.adapters.pop(0)))
        return None

    async def begin_push(self, version: int) -> None:
        """A push of ``version`` takes the weights: once no request runs and no load is pending; new requests wait
        until `end_push`."""
        async with self.cond:
            await self.cond.wait_for(lambda: self.active == 0 and self.pending is None and self.pushing is None)
            self.pushing, self.push_start = version, time.perf_counter()

    async def end_push(self, loaded: bool) -> None:
        """The push ends: ``loaded`` (every tensor arrived), its version is served; else the weights are a mix, and
        no version is (every request waits for the next push or load)."""
        async with self.cond:
            self.version, self.source = (self.pushing if loaded else None), None
            self.pushes += bool(loaded)
            seconds = time.perf_counter() - self.push_start
            self.load_seconds += seconds
            if loaded:
                self.served("pushed", seconds)
            self.pushing = None
            self.cond.notify_all()

    async def abandon_push(self) -> None:
        """A new trainer joins (``init``): a push its predecessor left open (killed between ``start`` and ``finish``)
        ends, serving no version (its weights are a mix) until the next push or checkpoint load."""
        if self.pushing is not None:
            await self.end_push(loaded=False)

    async def leave(self) -> None:
        async with self.cond:
            self.active -= 1
            self.cond.notify_all()


def _keys(app) -> list[str]:
    args = getattr(app.state, "args", None)
    return [k for k in ((getattr(args, "api_key", None) or []) or [os.environ.get("VLLM_API_KEY")]) if k]


def _gate(app) -> VersionGate:
    if not hasattr(app.state, "trl_ext_gate"):
        app.state.trl_ext_gate = VersionGate()
    return app.state.trl_ext_gate


async def policy_versions(request, call_next):
    """vLLM ``--middleware``: the version gate of `/v1/completions` and ``GET /v1/trl_ext/info`` (module docstring)."""
    from starlette.responses import JSONResponse

    path = request.url.path
    pushed = path.startswith(PUSH_PATH)
    if path != INFO_PATH and not pushed and (path not in GATED_PATHS or VERSION_HEADER.lower() not in
                                             request.headers):  # fmt: skip
        return await call_next(request)
    if not authorized(request.headers.get("Authorization"), _keys(request.app)):
        return JSONResponse({"error": "Unauthorized"}, status_code=401)
    engine, gate, root = request.app.state.engine_client, _gate(request.app), os.environ.get(WEIGHTS_ENV)
    if path == INFO_PATH:
        config, transfer = engine.model_config, engine.vllm_config.weight_transfer_config
        shape = {k: getattr(config.hf_config, k, None) for k in SHAPE_KEYS}
        return JSONResponse({"model": config.model, "served_model_name": config.served_model_name, "shape": shape,
                             "max_model_len": config.max_model_len, "logprobs_mode": config.logprobs_mode,
                             "dtype": str(config.dtype).removeprefix("torch."), "weights_dir": root,
                             "weight_transfer": transfer.backend if transfer is not None else None,
                             "world_size": engine.vllm_config.parallel_config.world_size_across_dp,
                             "version": gate.version, "pushing": gate.pushing, "loads": gate.loads,
                             "pushes": gate.pushes, "checkpoint_loads": gate.checkpoint_loads,
                             "adapter_loads": gate.adapter_loads,
                             "max_lora_rank": getattr(engine.vllm_config.lora_config, "max_lora_rank", None),
                             "load_seconds": round(gate.load_seconds, 4)})  # fmt: skip
    if pushed:
        return await _push(request, engine, gate, path.removeprefix(PUSH_PATH))
    try:
        version = int(request.headers[VERSION_HEADER])
    except ValueError:
        return JSONResponse({"error": f"{VERSION_HEADER} must be an integer"}, status_code=400)
    directory = request.headers.get(DIR_HEADER)
    if directory is None:  # a pushed version (trl_ext.serve.transfer): the request waits for its push
        return await _answer(request, call_next, gate, version, None)
    base = os.path.join(os.path.dirname(os.path.normpath(directory)), "base")  # trl_ext.vllm.lora.BASE
    adapter = os.path.isfile(os.path.join(directory, "adapter_config.json"))  # trl_ext.vllm.lora.CONFIG
    if adapter and not (root and inside(directory, root) and inside(base, root) and os.path.isdir(base)):
        return JSONResponse({"error": f"{DIR_HEADER} {directory!r} is not an adapter beside its base under "
                                      f"{WEIGHTS_ENV}"}, status_code=403)  # fmt: skip
    if adapter:
        if engine.vllm_config.lora_config is None:
            return JSONResponse({"error": "this server serves no LoRA adapters: start it with --enable-lora"},
                                status_code=409)  # fmt: skip
        error = await gate.take_adapter(request.app.state.openai_serving_models, adapter_name(directory), directory)
        if error is not None:
            return JSONResponse({"error": f"adapter {directory}: {error}"}, status_code=400)

        async def load_base():
            await engine.collective_rpc("reload_weights", kwargs={"weights_path": base, "is_checkpoint_format": True})
            await engine.reset_prefix_cache()

        return await _answer(request, call_next, gate, version, load_base, base, key=BASE_VERSION)
    if not gate.serves(version, directory):
        if not root:
            return JSONResponse({"error": f"this server loads no weights: it was started without {WEIGHTS_ENV}"},
                                status_code=403)
        if not inside(directory, root) or not os.path.isdir(directory):
            return JSONResponse({"error": f"{DIR_HEADER} {directory!r} is not a checkpoint under {WEIGHTS_ENV}"},
                                status_code=403)

    async def load():
        await engine.collective_rpc("reload_weights",
                                    kwargs={"weights_path": directory, "is_checkpoint_format": True})
        await engine.reset_prefix_cache()

    return await _answer(request, call_next, gate, version, load, directory)


async def _answer(request, call_next, gate: VersionGate, version: int, load, source: str | None = None,
                  key: int | None = None):  # fmt: skip
    """vLLM's answer to ``request`` of ``version``, run while the gate's ``key`` (default ``version``; `BASE_VERSION`
    for an adapter version) is loaded (``load``: how to load it from the checkpoint ``source``; None: pushed)."""
    from starlette.responses import JSONResponse

    try:
        streamed = bool((await request.json()).get("stream"))
    except ValueError:
        streamed = False  # vLLM answers the malformed body itself
    if streamed:
        return JSONResponse({"error": f"{VERSION_HEADER} needs a non-streamed request (the version must stay loaded "
                                      "until its last token)"}, status_code=400)  # fmt: skip
    await gate.enter(version if key is None else key, load, source)
    try:  # a non-streamed answer starts once its generation has ended (vLLM's handler returns the whole response)
        response = await call_next(request)
    finally:
        await gate.leave()
    response.headers[VERSION_HEADER] = str(version)
    return response


async def _push(request, engine, gate: VersionGate, op: str):
    """One step of a push (``trl_ext.serve.transfer``): vLLM's weight-transfer calls, with the gate held from
    ``start`` (no request runs) to ``finish`` (the version is served) or a failure (no version is)."""
    from starlette.responses import JSONResponse
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

    if request.method != "POST" or op not in ("init", "start", "update", "finish"):
        return JSONResponse({"error": f"no route {request.method} {request.url.path}"}, status_code=404)
    if not takes_pushes(engine):
        return JSONResponse({"error": "this server takes no pushed weights: start it with --weight-transfer-config"},
                            status_code=409)  # fmt: skip
    body = await request.json()
    try:
        if op == "init":  # a new trainer: a push its predecessor left unfinished serves no version
            await gate.abandon_push()
            await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=body["init_info"]))
        elif op == "start":
            await gate.begin_push(int(body["version"]))
            try:
                await engine.start_weight_update()
            except BaseException:
                await gate.end_push(loaded=False)
                raise
        elif op == "update":
            if gate.pushing is None:
                return JSONResponse({"error": "update before start"}, status_code=409)
            try:
                await engine.update_weights(WeightTransferUpdateRequest(update_info=body["update_info"]))
            except BaseException:
                await gate.end_push(loaded=False)
                raise
        else:
            if gate.pushing != int(body["version"]):
                return JSONResponse({"error": f"finish of version {body['version']} while pushing {gate.pushing}"},
                                    status_code=409)  # fmt: skip
            try:
                await engine.finish_weight_update(str(gate.pushing))
                await engine.reset_prefix_cache()
            except BaseException:
                await gate.end_push(loaded=False)
                raise
            await gate.end_push(loaded=True)
    except (KeyError, TypeError, ValueError) as e:
        return JSONResponse({"error": f"{op}: {type(e).__name__}: {e}"}, status_code=400)
    except Exception as e:  # the engine's error, named (the trainer fails its step with it)
        return JSONResponse({"error": f"{op}: {type(e).__name__}: {e}"}, status_code=500)
    return JSONResponse({"op": op, "version": gate.version})
