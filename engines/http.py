"""The engines' HTTP surface: SGLang's API over one `EngineCore`, whatever model it schedules.

One module, over 600 lines: it is one route table and its handlers, each a few lines over the
core, read side by side against reference/sglang-protocol.md; the work is in the modules it calls.

It answers the subset of SGLang's HTTP API that RL rollout clients use, with SGLang's shapes
(reference/sglang-protocol.md sections 1-4 and 7), so the project's SGLang client and the real
sglang-router cannot tell an engine of this package from SGLang. Where it differs, on purpose:

- no prompt log-probs, no penalties, no grammars, no multimodal input, no LoRA, and top-logprobs
  (SC) and routed experts (R3, MoE models) from the torch forwards only:
  asking for one is an HTTP 400, never silently ignored; `cached_tokens` is always 0;
- weights change through `/update_weights_from_disk`, over torch.distributed where the launcher
  set `weight_group`, and by CUDA IPC (`/update_weights_from_tensor`, flattened buckets only) where
  it set `weight_tensors` (the built-in engine on a GPU: `tensor_weights.py`); elsewhere those answer
  400 `success: false`. Memory release/resume (`occupation.py`) work on a GPU engine started with
  `--enable-memory-saver` and are refused with the reason elsewhere; while memory is released,
  `/generate` answers 503 saying why (SGLang would decode on unmapped memory);
- `/flush_cache` succeeds while requests are retracted by `pause_generation(mode=retract)`: they hold
  no cache (slime patches SGLang to behave the same, so that a weight publish can flush);
- `/health` is a liveness check (200 while the decode loop runs); `/health_generate` proves a decode
  step happens within its deadline, so it answers 503 while generation is paused.

Every request passes `guards.py` first: SGLang's `--api-key` (401 without it, except the health
probes) and a bound on the body (413 over it); a /generate body over 1 MiB is parsed on a worker thread.
What differs between engines (identity, device, load, extra routes) comes from the core's
`ModelForward` (seam.py) or from routes its launcher adds to `app` before serving.
Over 400 lines because it is one short handler per SGLang endpoint; splitting the handlers of
one HTTP surface across files would hide which endpoints exist.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import asdict
from typing import Any

import anyio
import orjson
from aiohttp import web

from engines.guards import MIB, default_max_body, guard_middlewares
from engines.occupation import MemoryOccupation, OccupationError, parse_tags
from engines.protocol import GenerateCall, parse_generate, render_output
from engines.request import (
    EngineClosedError,
    FinishKind,
    GenerationHeldError,
    InvalidRequestError,
    PauseMode,
    Request,
)
from engines.scheduler import EngineCore
from engines.seam import SamplingParams, WeightLoadError

__all__ = ["FLUSHED", "EngineServer", "json_body", "json_response"]

log = logging.getLogger(__name__)
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)

# A body larger than this is parsed on a worker thread (see `EngineServer.generate`); a /generate
# of one full-context prompt (32k tokens) is about 200 kB and stays on the loop.
_PARSE_OFF_LOOP_BYTES = 1 * MIB

# ---- the server ----------------------------------------------------------------------------------------


class EngineServer:
    """The HTTP face of one `EngineCore`. Build with an engine's `open_*server`, or mount `app` yourself."""

    def __init__(
        self,
        core: EngineCore,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        served_model_name: str | None = None,
        health_check_timeout: float = 20.0,
        random_seed: int | None = None,
        api_key: str | None = None,
        max_body_bytes: int | None = None,
    ) -> None:
        self.core = core
        self.host, self.port = host, port
        self.served_model_name = served_model_name or core.model.model_path
        self.tokenizer_path = core.model.model_path
        self.health_check_timeout = health_check_timeout
        self.random_seed = random_seed
        self.created = int(time.time())
        self._generating = 0  # /generate handlers whose requests reached the core
        self._drained = anyio.Event()
        self._drained.set()
        # Set by an engine that takes weights over torch.distributed (`weight_group.WeightGroupReceiver`).
        self.weight_group: Any = None
        # Set by an engine that takes weights by CUDA IPC (`tensor_weights.TensorWeightReceiver`).
        self.weight_tensors: Any = None
        # Set by an engine that can give its GPU memory back (`occupation.MemoryOccupation`).
        self.occupation: MemoryOccupation | None = None
        self.api_key = api_key or None  # SGLang's --api-key: see guards.py
        model = core.model
        self.max_body_bytes = max_body_bytes or default_max_body(model.context_length, core.max_running_requests)
        self.app = self._build_app()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _build_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.max_body_bytes, middlewares=guard_middlewares(self.api_key, self.max_body_bytes)
        )
        r = app.router
        for path, handler in [
            ("/generate", self.generate),
            ("/abort_request", self.abort_request),
            ("/pause_generation", self.pause_generation),
            ("/continue_generation", self.continue_generation),
            ("/update_weights_from_disk", self.update_weights_from_disk),
            ("/update_weight_version", self.update_weight_version),
            ("/update_weights_from_distributed", self.update_weights_from_distributed),
            ("/update_weights_from_tensor", self.update_weights_from_tensor),
            ("/init_weights_update_group", self.init_weights_update_group),
            ("/destroy_weights_update_group", self.destroy_weights_update_group),
            ("/get_weights_by_name", self.get_weights_by_name),
        ]:
            r.add_post(path, handler)
        r.add_put("/generate", self.generate)
        for path, handler in [
            ("/flush_cache", self.flush_cache),
            ("/release_memory_occupation", self.release_memory_occupation),
            ("/resume_memory_occupation", self.resume_memory_occupation),
        ]:
            r.add_get(path, handler)
            r.add_post(path, handler)
        for path, handler in [
            ("/health", self.health),
            ("/health_generate", self.health_generate),
            ("/model_info", self.model_info),
            ("/get_model_info", self.model_info),
            ("/server_info", self.server_info),
            ("/get_server_info", self.server_info),
            ("/get_weight_version", self.get_weight_version),
            ("/weight_version", self.get_weight_version),
            ("/v1/loads", self.loads),
            ("/get_load", self.loads),
            ("/v1/models", self.models),
        ]:
            r.add_get(path, handler)
        return app

    # ---- /generate ---------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if len(raw) > _PARSE_OFF_LOOP_BYTES:
            # Millions of token ids take a second to parse and check; on a worker thread the decode
            # loop and the other requests get the GIL back between its Python steps.
            call, error, stream = await anyio.to_thread.run_sync(self._parse_generate, raw)
        else:
            call, error, stream = self._parse_generate(raw)
        if call is not None:
            try:
                for req in call.requests:
                    self.core.check_rid(req)  # before any of a batch is queued
            except InvalidRequestError as exc:
                call, error = None, str(exc)
        if call is None:
            if stream:  # SGLang reports errors found while streaming inside the stream
                return await self._stream_error(request, str(error))
            return _error(400, str(error))
        if call.stream:
            return await self._generate_stream(request, call)
        return await self._generate_whole(call)

    def _parse_generate(self, raw: bytes) -> tuple[GenerateCall | None, str | None, bool]:
        """(call, None, stream), or (None, why it is refused, stream). Reads no state that changes."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return None, f"the body is not valid JSON: {exc}", False
        stream = isinstance(body, dict) and bool(body.get("stream"))
        try:
            call = parse_generate(
                body,
                tokenizer=self.core.model.tokenizer,
                vocab_size=self.core.model.vocab_size,
                # R3: only a torch forward over an MoE model records routes (engines/moe_routes.py)
                routes=getattr(getattr(self.core.model, "runner", None), "routes", None) is not None,
                top_logprobs=getattr(self.core.model, "runner", None) is not None,  # SC: a real distribution
            )
            for req in call.requests:
                self.core.check_prompt(req)
        except InvalidRequestError as exc:
            return None, str(exc), stream
        return call, None, stream

    async def _submit(self, call: GenerateCall) -> None:
        for req in call.requests:
            await self.core.submit(req)

    async def _generate_whole(self, call: GenerateCall) -> web.StreamResponse:
        try:
            try:
                await self._submit(call)
            except InvalidRequestError as exc:
                return _error(400, str(exc))
            except (EngineClosedError, GenerationHeldError) as exc:
                return _error(503, str(exc))
            self._enter()  # only now: a request held at the pause gate must not block a pause
            try:
                for req in call.requests:
                    await req.wait_finished()
                outs = [self._output(req, call, final=True) for req in call.requests]
            finally:
                self._leave()
            errors = [r.finish for r in call.requests if r.finish and r.finish.kind is FinishKind.ERROR]
            if errors:
                return _error(500, str(errors[0].message))
            return json_response(outs if call.batch else outs[0])
        finally:
            for req in call.requests:
                self.core.cancel(req)  # the client went away, or a later submit of the batch failed

    async def _generate_stream(self, request: web.Request, call: GenerateCall) -> web.StreamResponse:
        (req,) = call.requests
        try:
            await self.core.submit(req)
        except InvalidRequestError as exc:
            return await self._stream_error(request, str(exc))
        except (EngineClosedError, GenerationHeldError) as exc:
            return _error(503, str(exc))
        self._enter()
        try:
            response = _sse_response()
            await response.prepare(request)
            async for _ in req.changes():
                if req.finish is not None and req.finish.kind is FinishKind.ERROR:
                    await response.write(_sse({"error": {"message": req.finish.message}}))
                    break
                await response.write(_sse(self._output(req, call, final=req.finished, stream=True)))
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            self.core.cancel(req)
            self._leave()

    async def _stream_error(self, request: web.Request, message: str) -> web.StreamResponse:
        response = _sse_response()
        await response.prepare(request)
        await response.write(_sse({"error": {"message": message}}))
        await response.write(b"data: [DONE]\n\n")
        return response

    def _enter(self) -> None:
        self._generating += 1
        if self._drained.is_set():
            self._drained = anyio.Event()

    def _leave(self) -> None:
        self._generating -= 1
        if self._generating == 0:
            self._drained.set()

    def _output(self, req: Request, call: GenerateCall, *, final: bool, stream: bool = False) -> dict[str, Any]:
        return render_output(
            req,
            tokenizer=self.core.model.tokenizer,
            final=final,
            stream=stream,
            text_in_logprobs=call.text_in_logprobs,
        )

    # ---- control -------------------------------------------------------------------------------------

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all", False))
        if not isinstance(rid, str):
            return _error(400, f"rid must be a string, got {rid!r}")
        n = self.core.abort(rid, abort_all=abort_all)
        log.info("abort_request rid=%r abort_all=%s: %d request(s)", rid, abort_all, n)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            mode = PauseMode(body.get("mode") or "abort")
        except ValueError:
            return _error(400, f"mode must be one of abort, retract, in_place; got {body.get('mode')!r}")
        self.core.pause(mode)
        await self.core.wait_no_step()  # SGLang pauses between batches: no forward runs after this
        if mode is PauseMode.ABORT:
            # SGLang returns once no request holds the model: every aborted /generate has its answer.
            with anyio.move_on_after(10):
                await self._drained.wait()
        log.info("generation paused (%s)", mode.value)
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.core.resume()
        log.info("generation continued")
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if not self.core.flush_cache():
            c = self.core
            return web.Response(
                status=400,
                text=f"Cache not flushed: {c.num_running} running and {c.num_waiting} waiting request(s).\n",
            )
        return web.Response(status=200, text=FLUSHED)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        model_path, version = body.get("model_path"), body.get("weight_version")
        if not isinstance(model_path, str) or not model_path:
            return _weights_failed(f"model_path must be a non-empty string, got {model_path!r}")
        if version is not None and not isinstance(version, (str, int)):
            return _weights_failed(f"weight_version must be a string, got {version!r}")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            return _weights_failed(f"load_format {body['load_format']!r} is not supported by the built-in engine")
        if self.occupation is not None:
            try:
                self.occupation.refuse_weights_update("/update_weights_from_disk")
            except OccupationError as exc:
                return _weights_failed(str(exc))
        if body.get("abort_all_requests"):
            self.core.abort(abort_all=True)
        paused = self.core.num_running + self.core.num_waiting if self.core.paused else 0
        try:
            await self.core.update_weights(model_path, weight_version=None if version is None else str(version))
        except WeightLoadError as exc:
            log.warning("update_weights_from_disk failed: %s", exc)
            return _weights_failed(str(exc))
        if self.occupation is not None:
            self.occupation.written(None)  # every weight: a folder holds them all
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return json_response({"success": True, "message": message, "num_paused_requests": paused})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        version = body.get("new_version")
        if not isinstance(version, (str, int)) or isinstance(version, bool):
            return json_response({"success": False, "message": f"new_version must be a string, got {version!r}"}, 400)
        if body.get("abort_all_requests"):
            self.core.abort(abort_all=True)
        self.core.set_weight_version(str(version))
        return json_response(
            {"success": True, "message": f"Weight version updated to {version}.", "new_version": str(version)}
        )

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        return await self._weight_group_call(request, "init_group")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        return await self._weight_group_call(request, "update")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        return await self._weight_group_call(request, "destroy")

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's `{"name", "truncate_size"}` -> the first `truncate_size` values of the live tensor."""
        if self.weight_group is None:
            return await self.unsupported_weights(request)
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            values = self.weight_group.weights_by_name(body)
        except Exception as exc:
            return _error(400, str(exc))
        return json_response(values)

    async def _weight_group_call(self, request: web.Request, method: str) -> web.Response:
        """SGLang's answer shape for the group endpoints: `{"success", "message"}`, 400 on failure."""
        if self.weight_group is None:
            return await self.unsupported_weights(request)
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        if method == "update" and body.get("abort_all_requests"):
            self.core.abort(abort_all=True)
        try:
            message = await getattr(self.weight_group, method)(body)
        except Exception as exc:  # WeightGroupError and friends: the engine keeps serving
            log.warning("%s failed: %s", request.path, exc)
            return json_response({"success": False, "message": str(exc)}, 400)
        return json_response({"success": True, "message": message})

    async def unsupported_weights(self, request: web.Request) -> web.Response:
        return json_response(
            {
                "success": False,
                "message": f"{request.path} is not supported by this engine; use /update_weights_from_disk",
            },
            400,
        )

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """SGLang's `{"success", "message"}`, 400 on failure; CUDA IPC buckets (`tensor_weights.py`)."""
        if self.weight_tensors is None:
            return await self.unsupported_weights(request)
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        if body.get("abort_all_requests"):
            self.core.abort(abort_all=True)
        try:
            message = await self.weight_tensors.update(body)
        except Exception as exc:  # TensorUpdateError: refused or failed, the engine keeps serving
            log.warning("update_weights_from_tensor failed: %s", exc)
            return json_response({"success": False, "message": str(exc)}, 400)
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        return json_response({"success": True, "message": message})

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        return await self._occupation_call(request, release=True)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        return await self._occupation_call(request, release=False)

    async def _occupation_call(self, request: web.Request, *, release: bool) -> web.Response:
        """SGLang's answer: 200 with a null body; 400 `{"error": {"message"}}` when refused."""
        what = "release_memory_occupation" if release else "resume_memory_occupation"
        if self.occupation is None:
            return _error(400, f"{what} is not supported by this engine: it has no GPU memory to give back")
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            tags = parse_tags(body)
            said = await (self.occupation.release(tags) if release else self.occupation.resume(tags))
        except OccupationError as exc:
            return _error(400, str(exc))
        log.info("%s: %s", what, said)
        return json_response(None)

    # ---- info ------------------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.core.alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 once the engine proves it decodes: the next step of a busy engine, else a 1-token request."""
        if not self.core.alive:
            return web.Response(status=503)
        if self.core.generation_held is not None:  # memory released: alive, but nothing can decode
            return web.Response(status=503, text=self.core.generation_held)
        with anyio.move_on_after(self.health_check_timeout):
            if self.core.num_running and self.core.paused is None:
                await self.core.wait_step()
                return web.Response(status=200)
            probe = Request(
                rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
                prompt_ids=(0,),
                params=SamplingParams(max_new_tokens=1, temperature=0.0),
            )
            try:
                await self.core.submit(probe)
                await probe.wait_finished()
            except (EngineClosedError, GenerationHeldError):
                return web.Response(status=503)
            finally:
                self.core.cancel(probe)
            ok = probe.finish is not None and probe.finish.kind is FinishKind.LENGTH
            return web.Response(status=200 if ok else 503)
        return web.Response(status=503)

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response(
            {
                "model_path": self.core.model_path,
                "tokenizer_path": self.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.core.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                **self.core.model.identity(),
            }
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return json_response({"weight_version": self.core.weight_version})

    async def server_info(self, request: web.Request) -> web.Response:
        """ServerArgs-like fields slime and the router read, plus scheduler info and our statistics."""
        c, model = self.core, self.core.model
        return json_response(
            {
                "model_path": c.model_path,
                "tokenizer_path": self.tokenizer_path,
                "served_model_name": self.served_model_name,
                "host": self.host,
                "port": self.port,
                "tp_size": 1,
                "dp_size": 1,
                "pp_size": 1,
                "ep_size": 1,
                "nnodes": 1,
                "node_rank": 0,
                "disaggregation_mode": "null",
                "disaggregation_bootstrap_port": None,
                "encoder_only": False,
                "skip_tokenizer_init": False,
                "context_length": model.context_length,
                "max_running_requests": c.max_running_requests,
                "max_total_num_tokens": model.context_length * c.max_running_requests,
                "max_req_input_len": model.context_length - 1,
                "random_seed": self.random_seed,
                "weight_version": c.weight_version,
                "stream_interval": 1,
                "incremental_streaming_output": False,
                "internal_states": [asdict(c.statistics())],
                "enable_memory_saver": self.occupation is not None and self.occupation.enabled,
                "memory_occupation": None if self.occupation is None else asdict(self.occupation.statistics()),
                "last_tensor_update_seconds": None if self.weight_tensors is None else self.weight_tensors.last_timings,
                "version": model.engine_version,
                **model.server_details(),
            }
        )

    async def loads(self, request: web.Request) -> web.Response:
        c = self.core
        total = c.model.context_length * c.max_running_requests
        used = c.context_tokens() if c.model.keeps_kv_cache else 0
        accelerator, count = c.model.accelerator()
        return json_response(
            {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "version": c.model.engine_version,
                "accelerator": accelerator,
                "num_accelerators": count,
                "loads": [
                    {
                        "dp_rank": 0,
                        "timestamp": time.time(),
                        "num_running_reqs": c.num_running,
                        "num_waiting_reqs": c.num_waiting,
                        "num_used_tokens": used,
                        "num_total_tokens": total,
                        "max_total_num_tokens": total,
                        "token_usage": used / total,
                        "gen_throughput": 0.0,
                    }
                ],
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        name = self.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "sglang",
            "root": name,
            "max_model_len": self.core.model.context_length,
        }
        return json_response({"object": "list", "data": [card]})


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return json_response({"error": {"message": message}}, status)


def _weights_failed(message: str) -> web.Response:
    return json_response({"success": False, "message": message, "num_paused_requests": 0}, 400)


async def json_body(request: web.Request) -> dict[str, Any] | web.Response:
    """The JSON object body; an empty body is `{}` (slime posts `json={}` or nothing)."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return _error(400, f"the body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return _error(400, f"the body must be a JSON object, got {type(body).__name__}")
    return body


def _sse_response() -> web.StreamResponse:
    return web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"
