"""The embedded engine's HTTP routes: SGLang 0.5.23's, with its bodies and answers (aiohttp).

    /generate ─► engine.generate (request parser ─► scheduler ─► SGLang's answer)
    /pause_generation, /continue_generation, /flush_cache ─► engine.scheduler (and the prefix cache)
    /init_weights_update_group, /destroy_weights_update_group, /begin_weight_update, /end_weight_update,
    /update_weights_from_distributed, /update_weights_from_disk ─► engine.weights, under the scheduler's model lock
    (the batched calls, weight_update_protocol.BATCHING_FIELD: begin also pauses and flushes, end also continues,
    an update answers with the weight version)
    /health, /health_generate, /model_info

Invariants:
- a RequestError, a missing field or a wrong type is answered with HTTP 400 and the reason; with an API key every
  route but /health* needs it;
- every weight route runs under the model lock, which the batch loop holds while a batch decodes: generation and
  weight loading never overlap; every load and /flush_cache clears the prefix cache;
- the app reads the engine's parts only when a request comes (building it touches nothing of the engine).
"""

from __future__ import annotations

import asyncio

from megatron_dppo.servers.embedded.request_parser import RequestError


def build_app(engine, api_key: str | None = None):
    """The aiohttp app serving an EmbeddedEngine through what it offers: generate, model_info, and its scheduler,
    weights and prefix_cache."""
    from aiohttp import web

    async def json_body(request) -> dict:
        if not request.can_read_body:
            return {}
        try:
            return await request.json()
        except ValueError as error:
            raise RequestError(f"request body is not JSON: {error}") from None

    def handler(fn):
        async def wrapped(request):
            try:
                return await fn(request)
            except (RequestError, KeyError, TypeError) as error:
                message = f"missing field {error}" if isinstance(error, KeyError) else str(error)
                return web.json_response({"error": {"message": message}, "success": False, "message": message},
                                         status=400)
        return wrapped

    @web.middleware
    async def check_api_key(request, handler):
        # As SGLang: health probes stay open; everything else needs "Authorization: Bearer <key>".
        if api_key and not request.path.startswith("/health"):
            if request.headers.get("Authorization", "") != f"Bearer {api_key}":
                return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        return await handler(request)

    async def generate(request):
        return web.json_response(await engine.generate(await json_body(request)))

    async def health(request):
        return web.Response(status=200)

    async def health_generate(request):
        if engine.scheduler.paused or engine.scheduler.running:
            return web.Response(status=200)
        try:
            await asyncio.wait_for(engine.generate({"input_ids": [0], "sampling_params": {
                "max_new_tokens": 1, "temperature": 0.0}}), timeout=20)
        except (TimeoutError, RuntimeError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(request):
        return web.json_response(engine.model_info())

    async def flush_cache(request):
        # Drops the prefix cache. As SGLang 0.5.23's Scheduler.flush_cache, is_fully_idle(ignore_waiting=paused):
        # refused (HTTP 400) while a batch runs or requests wait on an unpaused engine; a paused engine's queue,
        # retracted requests, does not block it, so a sync flushes with requests retracted.
        if not engine.scheduler.fully_idle():
            return web.Response(status=400, text="Cache not flushed: requests are running.\n")
        engine.prefix_cache.clear()
        return web.Response(status=200, text="Cache flushed.\n")

    async def pause_generation(request):
        await engine.scheduler.pause((await json_body(request)).get("mode", "abort"))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(request):
        engine.scheduler.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def locked_call(fn, body, blocking: bool = True) -> None:
        async with engine.scheduler.model_lock:
            if blocking:  # off the event loop, which keeps serving the other routes meanwhile
                await asyncio.get_running_loop().run_in_executor(None, fn, body)
            else:  # bookkeeping only: a hand-over to a thread would cost more than the call
                fn(body)

    def locked_route(method: str, message: str, blocking: bool = True):
        """A control route: `engine.weights.<method>(body)` under the model lock, answered with SGLang's success
        body."""
        async def route(request):
            await locked_call(getattr(engine.weights, method), await json_body(request), blocking)
            return web.json_response({"success": True, "message": message})
        return route

    async def update_distributed(request):
        # An update posted while the one before is loading waits for the model lock, which asyncio hands over in
        # arrival order (the syncer posts bucket k + 1 only once bucket k is being received: handled in order).
        body = await json_body(request)
        await locked_call(engine.weights.update_from_distributed, body)  # generation never sees a half-loaded bucket
        engine.weights.record_version(body)
        return web.json_response({"success": True, "message": "Succeeded to update parameter online.",
                                  "weight_version": engine.weights.weight_version})

    async def begin_update(request):
        # SGLang's /begin_weight_update; with the batched calls (weight_update_batching), the pause and the flush
        # that SGLang takes as two calls before it
        body = await json_body(request)
        pause = body.get("pause_generation")
        if pause is not None:
            if not isinstance(pause, dict):
                raise RequestError(f"pause_generation must be an object like {{'mode': 'retract'}}, got {pause!r}")
            await engine.scheduler.pause(pause.get("mode", "abort"))
        if body.get("flush_cache"):
            if not engine.scheduler.fully_idle():
                raise RequestError("Cache not flushed: requests are running; pause generation first")
            engine.prefix_cache.clear()
        await locked_call(engine.weights.begin_weight_update, body, blocking=False)
        return web.json_response({"success": True, "message": "Success"})

    async def end_update(request):
        # SGLang's /end_weight_update; with {"continue_generation": true}, the continue that follows it (also when
        # closing fails: an engine left paused would serve nothing)
        body = await json_body(request)
        try:
            await locked_call(engine.weights.end_weight_update, body, blocking=False)
        finally:
            if body.get("continue_generation"):
                engine.scheduler.resume()
        return web.json_response({"success": True, "message": "Success"})

    async def update_from_disk(request):
        body = await json_body(request)
        await locked_call(engine.weights.load_from_disk, body)
        engine.weights.record_version(body)
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    app = web.Application(middlewares=[check_api_key], client_max_size=1024**3)
    app.router.add_route("POST", "/generate", handler(generate))
    app.router.add_route("PUT", "/generate", handler(generate))
    app.router.add_get("/health", handler(health))
    app.router.add_get("/health_generate", handler(health_generate))
    app.router.add_get("/model_info", handler(model_info))
    app.router.add_route("*", "/flush_cache", handler(flush_cache))
    app.router.add_post("/pause_generation", handler(pause_generation))
    app.router.add_post("/continue_generation", handler(continue_generation))
    app.router.add_post("/init_weights_update_group", handler(locked_route(
        "join_group", "Succeeded to initialize custom process group.")))
    app.router.add_post("/destroy_weights_update_group", handler(locked_route(
        "leave_group", "Succeeded to destroy custom process group.")))
    app.router.add_post("/begin_weight_update", handler(begin_update))
    app.router.add_post("/update_weights_from_distributed", handler(update_distributed))
    app.router.add_post("/end_weight_update", handler(end_update))
    app.router.add_post("/update_weights_from_disk", handler(update_from_disk))

    async def start_batch_loop(app):
        app["batch_loop"] = engine.scheduler.start()

    async def stop_batch_loop(app):
        app["batch_loop"].cancel()

    app.on_startup.append(start_batch_loop)
    app.on_cleanup.append(stop_batch_loop)
    return app
