"""The OpenAI-compatible HTTP server: FastAPI routes in this process, the engine in its own.

Modules: protocol (request bodies), errors (OpenAI error JSON), engine_process (the engine
loop), engine_client (the async handle on it), serving/completions/chat (the endpoints), metrics
(Prometheus), app (routes), cli (serve, wait-ready, systemd-unit), wait_ready, systemd."""
