"""The server's limits by default (here, so that the command line can show them without
importing the server)."""

DEFAULT_MAX_N = 128  # completions per prompt: OpenAI's limit
DEFAULT_MAX_PROMPTS = 2048  # prompts in one /v1/completions request: OpenAI's limit
DEFAULT_STALL_TIMEOUT_S = 60.0  # /health says engine_stalled after this long without a step while work is pending
DEFAULT_MAX_BODY_BYTES = 8 << 20  # a full 256k-token context as token-id JSON is about 2 MB
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # on SIGTERM, for the requests in flight to finish
