"""``moeserve bench --url``: load an OpenAI-compatible server (ours, vLLM, SGLang) at several
concurrency levels and report the numbers vLLM's ``bench serve`` reports.

Requests stream from ``/v1/completions`` with ``ignore_eos`` so that output lengths are exact;
time to first token, inter-token latencies and time per output token come from the stream.

Workloads for prefix caching (random token-id prompts): ``shared_prefix_len`` N puts the same N
tokens before every prompt's ``input_len`` random ones; ``multi_turn`` K groups the requests
into conversations of K turns, each turn's prompt being the previous prompt, its answer (as
token ids: ``logprobs`` with vLLM's ``return_tokens_as_token_ids``; a server that does not
return them gets the prompt without the answer) and ``input_len`` new tokens, so that the last
turn's prompt is ``shared_prefix_len + K * input_len + (K - 1) * output_len`` tokens long.

Random prompts follow ``seed`` (``--seed``), and each concurrency level of a run draws its own
(seed + its index), so that a server's prefix cache does not find one level's prompts in an
earlier one's; the shared prefix is the same for every seed and level, as a system prompt is.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp


@dataclass
class RequestRecord:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, where the server reports it
    answer_ids: list[int] = field(default_factory=list)  # only when asked for (multi-turn)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[k]


def summarize(records: list[RequestRecord], concurrency: int, duration: float) -> dict:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ttft = [1000 * r.ttft for r in ok]
    tpot = [1000 * (r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [1000 * x for r in ok for x in r.itl]
    res = {
        "concurrency": concurrency,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (out_tokens + in_tokens) / duration if duration else 0.0,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
    }
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        res[f"mean_{name}_ms"] = statistics.fmean(vals) if vals else float("nan")
        res[f"median_{name}_ms"] = statistics.median(vals) if vals else float("nan")
        res[f"p99_{name}_ms"] = _pct(vals, 99)
    res["ttfts_ms"] = ttft  # each request's, in the order they were sent (as vLLM's detailed results)
    errors = [r.error for r in records if not r.ok]
    if errors:
        res["errors"] = sorted(set(errors))[:5]
    return res


SHARED_PREFIX_SEED = 7919  # the shared prefix does not follow the run's seed


def random_prompts(n: int, input_len: int, vocab: int, seed: int, shared_prefix_len: int = 0) -> list[list[int]]:
    fixed = random.Random(SHARED_PREFIX_SEED)
    prefix = [fixed.randrange(10, vocab) for _ in range(shared_prefix_len)]
    rng = random.Random(seed)
    return [prefix + [rng.randrange(10, vocab) for _ in range(input_len)] for _ in range(n)]


def conversations(prompts: list, turns: int, input_len: int, vocab: int, seed: int) -> list[list]:
    """``len(prompts)`` requests as conversations of ``turns`` turns (the last one shorter):
    each a first prompt, then the new tokens of each later turn."""
    if turns < 1:
        raise ValueError(f"multi_turn must be at least 1, got {turns}")
    if turns > 1 and not all(isinstance(p, list) for p in prompts):
        raise ValueError("multi_turn needs the random dataset (token-id prompts)")
    rng = random.Random(seed + 1)
    out = []
    for i in range(0, len(prompts), turns):
        n = min(turns, len(prompts) - i)
        out.append([prompts[i]] + [[rng.randrange(10, vocab) for _ in range(input_len)] for _ in range(n - 1)])
    return out


def _token_ids(logprobs: dict | None) -> list[int]:
    tokens = (logprobs or {}).get("tokens") or []
    return [int(t.split(":", 1)[1]) for t in tokens if isinstance(t, str) and t.startswith("token_id:")]


def file_prompts(path: str, n: int) -> list[str]:
    prompts = []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                prompts.append(row.get("prompt") or row.get("text") or "")
    if not prompts:
        raise ValueError(f"{path} has no prompts (one JSON object per line with a 'prompt' field)")
    return [prompts[i % len(prompts)] for i in range(n)]


# What the bench itself sets in every request and measures by: not for --extra-body
BENCH_OWNED_FIELDS = ("model", "prompt", "stream", "stream_options")


def extra_body_fields(extra: dict | str | None) -> dict:
    """``--extra-body``'s fields (a JSON object, or its text), refusing those the bench owns."""
    if extra is None:
        return {}
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body is not JSON: {e}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"--extra-body must be a JSON object, not {type(extra).__name__}")
    owned = sorted(set(extra) & set(BENCH_OWNED_FIELDS))
    if owned:
        raise ValueError(f"--extra-body cannot set {', '.join(owned)}: the bench sets them")
    return extra


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: list[int] | str,
    output_len: int,
    headers: dict,
    want_ids: bool = False,
    temperature: float = 0.0,
    extra_body: dict | None = None,
) -> RequestRecord:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": temperature,
        "ignore_eos": True,
        **(extra_body or {}),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if want_ids:
        body.update(logprobs=0, return_tokens_as_token_ids=True)
    prompt_tokens = len(prompt) if isinstance(prompt, list) else 0
    rec = RequestRecord(ok=False, prompt_tokens=prompt_tokens)
    start = time.perf_counter()
    last = start
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for raw in resp.content:  # one line at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    rec.output_tokens = chunk["usage"].get("completion_tokens", rec.output_tokens)
                    rec.prompt_tokens = chunk["usage"].get("prompt_tokens", rec.prompt_tokens)
                    rec.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if chunk.get("choices"):
                    if want_ids:
                        rec.answer_ids += _token_ids(chunk["choices"][0].get("logprobs"))
                    now = time.perf_counter()
                    if rec.ttft == 0.0:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
        rec.latency = time.perf_counter() - start
        rec.ok = rec.output_tokens > 0
        if not rec.ok:
            rec.error = "no tokens (server sent no usage)"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # ValueError: bad JSON, an overlong line
        rec.error = f"{type(e).__name__}: {e}"
    return rec


def _session(concurrency: int, timeout: float) -> aiohttp.ClientSession:
    """aiohttp, not httpx: against a stub server that paces 32 streams (scripts/stub_server.py),
    a bare httpx client on an H200 host saw 2,347 tok/s and a mean TTFT of 129 ms, a bare
    aiohttp one 2,708 tok/s and 48 ms (BENCHMARKS.md). vLLM's benchmark client is aiohttp too."""
    connector = aiohttp.TCPConnector(limit=concurrency + 4, force_close=False)
    # a line may be a whole chunk with logprobs: no 64 KiB line limit
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout), read_bufsize=1 << 20)


async def run_level(
    url: str,
    model: str,
    prompts: list,
    output_len: int,
    concurrency: int,
    headers: dict,
    progress=None,
    timeout: float = 600.0,
    temperature: float = 0.0,
    extra_body: dict | None = None,
) -> dict:
    """``prompts``: one per request, or conversations (lists of turns, see ``conversations``)
    whose turns go one after another; ``concurrency`` bounds the requests in flight."""
    sem = asyncio.Semaphore(concurrency)
    async with _session(concurrency, timeout) as session:

        async def bounded(p, want_ids=False):
            async with sem:
                rec = await one_request(session, url, model, p, output_len, headers, want_ids, temperature, extra_body)
                if progress is not None:
                    progress()
                return rec

        async def converse(turns):
            records, prompt = [], []
            for t, new in enumerate(turns):
                prompt = prompt + new
                records.append(await bounded(prompt, want_ids=t + 1 < len(turns)))
                if not records[-1].ok:
                    break
                prompt = prompt + records[-1].answer_ids
            return records

        start = time.perf_counter()
        if prompts and isinstance(prompts[0], list) and prompts[0] and isinstance(prompts[0][0], list):
            records = [r for conv in await asyncio.gather(*(converse(c) for c in prompts)) for r in conv]
        else:
            records = await asyncio.gather(*(bounded(p) for p in prompts))
        duration = time.perf_counter() - start
    return summarize(list(records), concurrency, duration)


async def detect_model(url: str, headers: dict) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(f"{url}/v1/models", headers=headers) as r:
            r.raise_for_status()
            return (await r.json())["data"][0]["id"]


def run_serving(
    url: str,
    concurrencies: list[int],
    num_prompts: int,
    input_len: int,
    output_len: int,
    result_dir: str,
    model: str | None = None,
    dataset: str = "random",
    api_key: str | None = None,
    vocab: int = 256,
    seed: int = 0,
    label: str | None = None,
    quiet: bool = False,
    tags: dict | None = None,
    shared_prefix_len: int = 0,
    multi_turn: int = 1,
    temperature: float = 0.0,
    extra_body: dict | None = None,
) -> list[dict]:
    """``tags`` (e.g. layout, hardware) are copied into every result, so that
    ``moeserve plan --calibrate`` can read them. ``extra_body``: fields added to every request
    (``response_format``, ``top_p``, ...; see ``extra_body_fields``)."""
    from tqdm import tqdm

    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = model or asyncio.run(detect_model(url, headers))
    if shared_prefix_len < 0:
        raise ValueError(f"shared_prefix_len must be >= 0, got {shared_prefix_len}")
    extra_body = extra_body_fields(extra_body)

    def level_prompts(level_seed: int) -> list:
        if dataset != "random":
            return file_prompts(dataset, num_prompts)
        prompts = random_prompts(num_prompts, input_len, vocab, level_seed, shared_prefix_len)
        return conversations(prompts, multi_turn, input_len, vocab, level_seed) if multi_turn != 1 else prompts

    results = []
    for i, c in enumerate(concurrencies):
        prompts = level_prompts(seed + i)
        bar = tqdm(total=num_prompts, desc=f"concurrency {c}", disable=quiet)
        level = run_level(
            url, model, prompts, output_len, c, headers, progress=lambda: bar.update(1), temperature=temperature, extra_body=extra_body
        )
        res = asyncio.run(level)
        bar.close()
        res.update(
            model=model,
            url=url,
            input_len=input_len,
            output_len=output_len,
            num_prompts=num_prompts,
            shared_prefix_len=shared_prefix_len,
            multi_turn=multi_turn,
            temperature=temperature,
        )
        if extra_body:
            res["extra_body"] = extra_body
        if label:
            res["label"] = label
        res.update(tags or {})
        results.append(res)
    write_report(results, result_dir, title=f"moeserve bench: {model} @ {url}")
    return results


def write_report(results: list[dict], result_dir: str, title: str) -> None:
    from moeserve.bench.report import markdown_table, plot_levels

    out = Path(result_dir)
    out.mkdir(parents=True, exist_ok=True)
    for r in results:
        (out / f"concurrency_{r['concurrency']}.json").write_text(json.dumps(r, indent=2))
    (out / "results.json").write_text(json.dumps(results, indent=2))
    md = [f"# {title}", "", markdown_table(results), ""]
    (out / "report.md").write_text("\n".join(md))
    plot_levels({"measured": results}, out)


def run_serving_cli(args) -> int:
    if not args.url:
        raise ValueError("moeserve bench needs --url URL (a server) or --offline (the engine in-process)")
    levels = [int(x) for x in args.concurrency.split(",")]
    results = run_serving(
        args.url,
        levels,
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.result_dir or "bench-results",
        model=args.served_model or args.model,
        dataset=args.dataset,
        api_key=args.api_key,
        vocab=args.vocab,
        seed=args.seed,
        shared_prefix_len=args.shared_prefix_len,
        multi_turn=args.multi_turn,
        temperature=args.temperature,
        extra_body=args.extra_body,
        tags={k: v for k, v in (("layout", args.layout), ("hardware", args.hardware)) if v},
    )
    from moeserve.bench.report import markdown_table

    print(markdown_table(results))
    return 0 if all(r["failed"] == 0 for r in results) else 1
