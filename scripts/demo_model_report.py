"""The demo model's figures for BENCHMARKS.md, on the weights in the package (CPU, about a minute):
held-out task accuracy through the engine (greedy; bf16, INT4 and FP8 copies), the perplexity of
each on held-out text (its weights dequantized, in the training model, float32) and the MTP
layer's next-next-token accuracy there.

    python scripts/demo_model_report.py [--tasks 200] [--text 200] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from moeserve import LLM, SamplingParams  # noqa: E402
from moeserve.config import load_model_config  # noqa: E402
from moeserve.demo import MODEL_DIR, ensure_demo_model, training_record  # noqa: E402
from moeserve.demo import tasks  # noqa: E402
from moeserve.demo.quantize import dequantized_tensors  # noqa: E402
from moeserve.demo.torch_model import DemoModel, text_metrics  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=200)
    p.add_argument("--text", type=int, default=200)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    samples = tasks.held_out_tasks(args.tasks)
    text = tasks.held_out_text(args.text)
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    encode = lambda t: tok.encode(t, add_special_tokens=False).ids  # noqa: E731
    rows = []
    for fmt in ("bf16", "int4", "fp8"):
        path = ensure_demo_model(None if fmt == "bf16" else fmt)
        t = time.time()
        with LLM(str(path), device=args.device) as llm:
            outs = llm.generate(
                [{"prompt_token_ids": encode(s.prompt())} for s in samples],
                SamplingParams(temperature=0, max_tokens=tasks.REPLY_MAX_TOKENS),
            )
        seconds = time.time() - t
        acc = tasks.accuracy(samples, [o.outputs[0].text for o in outs])
        model = DemoModel(load_model_config(str(path)))
        model.load_hf_state_dict(dequantized_tensors(path))
        m = text_metrics(model, encode, text)
        rows.append((fmt, acc["call"], acc["answer"], m["perplexity"], m["mtp_accuracy"], m["tokens"], seconds))
        print(f"{fmt}: done in {seconds:.0f}s", file=sys.stderr, flush=True)
    n_call = sum(s.kind == "call" for s in samples)
    print(f"weights: {training_record()}; {args.tasks} held-out tasks ({n_call} calls), {rows[0][5]} tokens of held-out text")
    print(f"torch {torch.__version__}, device {args.device}\n")
    print("| copy | tool calls exact | answers hold the results | perplexity (held-out text) | MTP next-next-token accuracy |")
    print("|---|---|---|---|---|")
    for fmt, call, answer, ppl, mtp, _, _ in rows:
        print(f"| {fmt} | {call:.1%} | {answer:.1%} | {ppl:.4f} | {mtp:.1%} |")


if __name__ == "__main__":
    main()
