"""The FastAPI app: routes, API key, health, metrics; the engine client lives in its lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import secrets
import time
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pydantic import BaseModel

from moeserve.server.body_limit import BodySizeLimit
from moeserve.server.body_process import BodyPreparer
from moeserve.server.chat import create_chat_completion
from moeserve.server.chat_settings import ChatSettings
from moeserve.server.completions import create_completion
from moeserve.server.engine_client import AsyncEngineClient
from moeserve.server.errors import APIError, install_error_handlers
from moeserve.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics, watch_event_loop
from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest
from moeserve.server.tokenize import DetokenizeRequest, TokenizeRequest, detokenize_route, tokenize_route
from moeserve.server.defaults import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS, DEFAULT_STALL_TIMEOUT_S
from moeserve.server.openai_shared import ServerContext

if TYPE_CHECKING:
    from moeserve.engine.config import EngineConfig

log = logging.getLogger("moeserve.server")


@dataclass
class ServerConfig:
    model_names: list[str]
    # The engine's settings, validated once where the command line is read, and sent to the engine
    # process as they are (pickled). ``model`` is set.
    engine: EngineConfig | None = None
    api_key: str | None = None
    max_waiting: int | None = 1024
    max_n: int = DEFAULT_MAX_N
    max_prompts: int = DEFAULT_MAX_PROMPTS
    max_request_bytes: int = DEFAULT_MAX_BODY_BYTES
    engine_log_level: int = logging.WARNING
    docs: bool = False  # serve /docs and /redoc (their pages load scripts from a CDN)
    engine_stall_timeout: float = DEFAULT_STALL_TIMEOUT_S  # /health: engine_stalled after this long (0: never)
    # (path, trust_remote_code) of the tokenizer, for the processes that prepare large bodies;
    # None: they are prepared in worker threads of this process (holding its GIL while validated)
    tokenizer_source: tuple[str, bool] | None = None
    chat: ChatSettings = field(default_factory=ChatSettings)  # template, parsers, generation defaults
    started_at: float = field(default_factory=time.monotonic)
    on_engine_death: Callable[[str], None] | None = None  # e.g. stop the HTTP server
    engine_kwargs: InitVar[dict | None] = None  # or EngineConfig's keyword arguments, made into ``engine``

    def __post_init__(self, engine_kwargs: dict | None) -> None:
        if self.engine is None:
            from moeserve.engine.config import EngineConfig

            if engine_kwargs is None:
                raise TypeError("ServerConfig needs the engine's settings: engine=EngineConfig(...)")
            self.engine = EngineConfig(**engine_kwargs)
        elif engine_kwargs is not None:
            raise TypeError("give ServerConfig engine= or engine_kwargs=, not both")
        if self.engine_stall_timeout < 0:
            raise ValueError(f"engine_stall_timeout must be >= 0 (0: off), got {self.engine_stall_timeout}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: give a real key, or none at all to serve without one")
        for name in ("max_n", "max_prompts", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


def _request_body(model: type[BaseModel]) -> dict:
    """OpenAPI for a body the route parses itself (off the event loop) instead of FastAPI."""
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    }


def _install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = default()
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(body.pop("$defs", {}))
                schemas[model.__name__] = body
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _layout(engine: EngineConfig) -> str:
    return f"tp={engine.tensor_parallel_size} pp={engine.pipeline_parallel_size} ep={engine.expert_parallel_size}"


def create_app(config: ServerConfig, tokenizer: Any | None) -> FastAPI:
    from moeserve import __version__

    metrics = ServerMetrics(config.model_names[0])

    def on_ready(info: dict) -> None:
        took = time.monotonic() - config.started_at
        log.info(
            "ready in %.1f s (engine built in %.1f s, warm-up of %d tokens in %.2f s), %s, max_model_len %d",
            took,
            info["build_s"],
            info["warmup_tokens"],
            info["warmup_s"],
            _layout(config.engine),
            info["max_model_len"],
        )
        for line in info.get("layout", []):
            log.info("  %s", line)

    client = AsyncEngineClient(
        config.engine,
        config.max_waiting,
        metrics,
        on_progress=lambda text: log.info("engine: %s", text),
        on_ready=on_ready,
        on_death=config.on_engine_death,
        engine_log_level=config.engine_log_level,
    )
    ctx = ServerContext(
        client,
        tokenizer,
        config.model_names,
        config.engine.model,
        metrics,
        max_n=config.max_n,
        max_prompts=config.max_prompts,
        preparer=BodyPreparer(config.tokenizer_source, config.chat) if config.tokenizer_source is not None else None,
        chat=config.chat,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client.start()
        log.info("engine process %d started; /health answers 503 until it is ready", client.pid)
        await ctx.warm_up([CompletionRequest, ChatCompletionRequest])
        # What start-up made (modules, the tokenizer, schemas) lives as long as the server: out of
        # the garbage collector's sight, so that its full passes, which hold the GIL and so the
        # event loop, scan only what requests make (a large answer triggered 0.3 s passes).
        gc.collect()
        gc.freeze()
        watch = asyncio.ensure_future(watch_event_loop(metrics))
        try:
            yield
        finally:
            watch.cancel()
            if ctx.preparer is not None:
                ctx.preparer.shutdown()
            client.shutdown()

    docs = {} if config.docs else {"docs_url": None, "redoc_url": None}
    app = FastAPI(title="moeserve", version=__version__, lifespan=lifespan, **docs)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes)
    _install_openapi(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest])

    async def check_api_key(request: Request) -> None:
        if config.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if not secrets.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid API key", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "moeserve",
            "root": ctx.model_path,
            "max_model_len": client.info.get("max_model_len"),
        }

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(name) for name in ctx.model_names]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id not in ctx.model_names:  # (the message does not list the served names: see check_model)
            raise APIError(
                404, f"the model {model_id[:200]!r} does not exist (GET /v1/models lists this server's)", "model", "model_not_found"
            )
        return model_card(model_id)

    @v1.post("/completions", openapi_extra=_request_body(CompletionRequest))
    async def completions(raw: Request) -> Any:
        return await create_completion(raw, ctx)

    @v1.post("/chat/completions", openapi_extra=_request_body(ChatCompletionRequest))
    async def chat(raw: Request) -> Any:
        return await create_chat_completion(raw, ctx)

    app.include_router(v1)

    # vLLM's, beside /v1 as there; behind the API key as /v1 is
    @app.post("/tokenize", dependencies=[Depends(check_api_key)], openapi_extra=_request_body(TokenizeRequest))
    async def tokenize(raw: Request) -> Any:
        return await tokenize_route(raw, ctx)

    @app.post("/detokenize", dependencies=[Depends(check_api_key)], openapi_extra=_request_body(DetokenizeRequest))
    async def detokenize(raw: Request) -> Any:
        return await detokenize_route(raw, ctx)

    @app.get("/health")
    async def health() -> JSONResponse:
        elapsed = round(time.monotonic() - config.started_at, 1)
        stalled = client.stalled_for()
        if config.engine_stall_timeout and stalled > config.engine_stall_timeout:
            return JSONResponse(
                {
                    "status": "engine_stalled",
                    "detail": f"the engine has not stepped for {stalled:.1f} s while {client.num_in_flight} request(s) are "
                    f"pending (--engine-stall-timeout {config.engine_stall_timeout:g}); it answers again once it steps",
                    "engine_pid": client.pid,
                    **client.stats,
                },
                status_code=503,
            )
        if client.state == "ready":
            return JSONResponse(
                {
                    "status": "ready",
                    "model": ctx.model_name,
                    "uptime_s": elapsed,
                    "engine_pid": client.pid,
                    "max_model_len": client.info.get("max_model_len"),
                    "layout": client.info.get("layout", []),
                    **client.stats,
                }
            )
        if client.state == "failed":
            return JSONResponse({"status": "failed", "error": client.error}, status_code=503)
        if client.state == "draining":
            return JSONResponse(
                {"status": "draining", "detail": client.detail, "in_flight": client.num_in_flight, **client.stats}, status_code=503
            )
        return JSONResponse(
            {"status": "loading" if client.state != "stopped" else "stopped", "detail": client.detail, "elapsed_s": elapsed},
            status_code=503,
        )

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
