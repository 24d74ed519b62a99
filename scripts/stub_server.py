"""A stub OpenAI completions server that streams at a fixed pace, to measure what a benchmark
client itself can keep up with: every request gets its first token after ``--ttft-ms`` and
the rest ``--tpot-ms`` apart, whatever the prompt. ``moeserve bench --url`` against it shows
the client's own ceiling (what it reports beyond the stub's pace is the client's cost).

    python scripts/stub_server.py --port 8130 &
    moeserve bench --url http://127.0.0.1:8130 --concurrency 32 --num-prompts 64 \\
        --input-len 128 --output-len 128 --shared-prefix-len 4096 --vocab 100000
    # ideal for that workload: 2 waves x (20 + 127 x 11 ms) -> 2,896 output tok/s
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


def build_app(ttft_s: float, tpot_s: float) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        n = int(body.get("max_tokens", 16))
        prompt_tokens = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 0

        async def events():
            await asyncio.sleep(ttft_s)
            for i in range(n):
                choice = {"index": 0, "text": "a", "finish_reason": None if i < n - 1 else "length"}
                yield f"data: {json.dumps({'object': 'text_completion', 'choices': [choice]})}\n\n"
                if i < n - 1:
                    await asyncio.sleep(tpot_s)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            yield f"data: {json.dumps({'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8130)
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--tpot-ms", type=float, default=11.0)
    args = ap.parse_args()
    uvicorn.run(build_app(args.ttft_ms / 1e3, args.tpot_ms / 1e3), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
