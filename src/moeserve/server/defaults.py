"""The server's limits by default (here, so that the command line can show them without
importing the server)."""

DEFAULT_MAX_N = 128  # completions per prompt: OpenAI's limit
DEFAULT_MAX_BODY_BYTES = 8 << 20  # a full 256k-token context as token-id JSON is about 2 MB
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # on SIGTERM, for the requests in flight to finish
