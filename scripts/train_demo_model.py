"""Train moeserve's demo model: a tiny DeepseekV3 (+ one MTP layer) that speaks Kimi K2.6's chat
format, on data this script generates (moeserve.demo.tasks).

    # once, on a CPU: the BPE tokenizer (committed in src/moeserve/demo/model/; see build_tokenizer)
    python scripts/train_demo_model.py --build-tokenizer
    # the model, on one GPU (about 4 minutes on an H200, 5 with --engine-check):
    python scripts/train_demo_model.py --device cuda --out OUT/demo --engine-check
    # a short check of the whole pipeline on a CPU:
    python scripts/train_demo_model.py --device cpu --out /tmp/demo --steps 200 --samples 20000 --batch-tokens 8192

The training data's city names (moeserve.demo.tasks._city): 30 % real training cities, 25 % spliced
ones (the head of one training city joined to the tail of another, so that the model learns to copy
unfamiliar names piece by piece), 45 % made up; the held-out tasks are pinned, the same whatever
the mix, so that evaluations of retrained models stay comparable.

Writes into --out: model.safetensors (bf16, the router biases float32; the checkpoint layout of
DeepSeek-V3 with its MTP layer), training_log.txt, loss.png and eval.json (held-out accuracy of
greedy replies, MTP next-next-token accuracy, perplexity). Install the weights with
``cp OUT/demo/model.safetensors src/moeserve/demo/model/`` and the log and plot with
``cp OUT/demo/{training_log.txt,loss.png,eval.json} docs/demo-model/``.

Deterministic given --seed: the data (each sample its own seeded rng), the initial weights, the
batch order (conversations packed into rows of --max-len tokens, each attending only to itself:
one shape every step, which torch.compile fuses on a GPU); deterministic GPU kernels on request
(--deterministic-kernels), and attention is a plain softmax.
Needs torch, numpy, safetensors, tokenizers (and matplotlib for the plot, transformers only for
--build-tokenizer); moeserve itself is read from src/ (only its standard-library and torch parts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

MODEL_DIR = ROOT / "src" / "moeserve" / "demo" / "model"
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the data workers are processes

import numpy as np  # noqa: E402
import torch  # noqa: E402

from moeserve.config import parse_model_config  # noqa: E402
from moeserve.demo import chat_format as cf  # noqa: E402
from moeserve.demo import tasks  # noqa: E402
from moeserve.demo.torch_model import DemoModel, text_metrics  # noqa: E402

PROBE_STEPS = 60  # --steps 0: the pace is measured over steps 10..60 (in the warmup)

# ---- tokenizer (built once on a CPU, committed) ----
PRE_TOKENIZER_PATTERN = r"\s+|\w+|[^\w\s]+"  # words, spaces and punctuation apart: a word is the same tokens anywhere


def build_tokenizer(out: Path, vocab_size: int, seed: int = 0, samples: int = 20000) -> None:
    """Byte-level BPE on generated conversations; the special tokens after it (ids from
    ``vocab_size - 16``), the rest reserved; digits one token each. Saved with the chat template
    through transformers (tokenizer.json, tokenizer_config.json, chat_template.jinja).

    The committed tokenizer was built from the training stream before spliced city names joined
    the mix (moeserve.demo.tasks: 40 % training cities, 60 % made up, then). The stream now mixes
    30 % training, 25 % spliced, 45 % made-up names, so rebuilding gives another vocabulary (43 of
    its 752 tokens replaced by others), which the committed weights were not trained with: rebuild
    it only together with retraining the model."""
    import re

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n_added = 16
    added = list(cf.SPECIAL_TOKENS) + list(cf.TEXT_TOKENS)
    added += [f"<|reserved_token_{i}|>" for i in range(n_added - len(added))]
    split = re.compile("|".join(re.escape(t) for t in added))
    texts = [s.prompt() + s.completion() for s in tasks.training_samples(seed, samples)]
    pieces = [p for t in texts for p in split.split(t) if p]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(pieces, trainer)
    assert tok.get_vocab_size() == vocab_size - n_added, tok.get_vocab_size()
    for t in added:
        special = t not in cf.TEXT_TOKENS
        tok.add_tokens([AddedToken(t, special=special, normalized=False)]) if not special else tok.add_special_tokens([t])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=cf.BOS, eos_token=cf.IM_END, pad_token=cf.PAD)
    fast.chat_template = (MODEL_DIR / "chat_template.jinja").read_text()
    fast.model_max_length = json.loads((MODEL_DIR / "config.json").read_text())["max_position_embeddings"]
    fast.save_pretrained(str(out))
    # The class every transformers version knows (5.x saves its own new name, "TokenizersBackend").
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    config = json.loads((MODEL_DIR / "config.json").read_text())
    ids = {t: tok.token_to_id(t) for t in added}
    assert (ids[cf.BOS], ids[cf.IM_END], ids[cf.PAD]) == (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]), ids
    assert max(ids.values()) == vocab_size - 1 == config["vocab_size"] - 1


# ---- data ----
def _encode_chunk(args: tuple[int, int, int, str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Samples start .. start + n, tokenized: (all ids, int16; each sample's length; each prompt's
    length). Arrays, not lists: they cross the process boundary cheaply."""
    seed, start, n, tokenizer_path = args
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    samples = tasks.training_samples(seed, n, start)
    # The tool declaration turn (half a prompt's tokens) repeats: tokenized once per variant. It
    # ends with a special token, so its ids and the rest's are the whole prompt's.
    heads, tails = [], []
    for text in (s.prompt() for s in samples):
        cut = text.index(cf.IM_END) + len(cf.IM_END) if text.startswith(cf.IM_SYSTEM + "tool_declare") else 0
        heads.append(text[:cut])
        tails.append(text[cut:])
    declared = {h: tok.encode(h, add_special_tokens=False).ids for h in set(heads)}
    rest = tok.encode_batch(tails, add_special_tokens=False)
    completions = tok.encode_batch([s.completion() for s in samples], add_special_tokens=False)
    prompts = [declared[h] + r.ids for h, r in zip(heads, rest)]
    seqs = [p + c.ids for p, c in zip(prompts, completions)]
    flat = np.fromiter((t for s in seqs for t in s), dtype=np.int16)
    return flat, np.asarray([len(s) for s in seqs]), np.asarray([len(p) for p in prompts])


def encode_samples(seed: int, n: int, tokenizer_path: Path, max_len: int, workers: int) -> tuple[list[np.ndarray], np.ndarray]:
    """-> token ids of each sample (prompt + completion) and where its completion starts."""
    chunk = 5000
    jobs = [(seed, s, min(chunk, n - s), str(tokenizer_path)) for s in range(0, n, chunk)]
    if workers > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(workers) as pool:
            parts = pool.map(_encode_chunk, jobs)
    else:
        parts = [_encode_chunk(j) for j in jobs]
    seqs, starts = [], []
    for flat, lengths, prompt_lens in parts:
        for s, p in zip(np.split(flat, np.cumsum(lengths)[:-1]), prompt_lens):
            if len(s) <= max_len:
                seqs.append(s)
                starts.append(p)
    return seqs, np.asarray(starts)


def pack(lengths: np.ndarray, row_len: int, rng: np.random.Generator) -> list[list[int]]:
    """Conversations packed into rows of ``row_len`` tokens, in a shuffled order, each into the
    fullest row it still fits (best fit): every step has the same shape, and almost no padding."""
    rows_with_free = np.zeros(row_len + 1, dtype=np.int64)  # how many rows have exactly s tokens free
    free: list[list[int]] = [[] for _ in range(row_len + 1)]
    rows: list[list[int]] = []
    for i in rng.permutation(len(lengths)):
        n = int(lengths[i])
        fits = np.flatnonzero(rows_with_free[n:])
        if len(fits):
            space = n + int(fits[0])
            r = free[space].pop()
            rows_with_free[space] -= 1
        else:
            space, r = row_len, len(rows)
            rows.append([])
        rows[r].append(int(i))
        if space > n:
            free[space - n].append(r)
            rows_with_free[space - n] += 1
    return rows


def packed_arrays(seqs, starts, rows: list[list[int]], row_len: int, pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The packed rows: token ids [R, row_len], the loss mask (completion tokens) and each token's
    document (its conversation's place in the row; padding is a document of its own)."""
    ids = np.full((len(rows), row_len), pad, dtype=np.int32)
    mask = np.zeros((len(rows), row_len), dtype=bool)
    docs = np.full((len(rows), row_len), -1, dtype=np.int16)
    for r, row in enumerate(rows):
        at = 0
        for d, i in enumerate(row):
            s = seqs[i]
            ids[r, at : at + len(s)] = s
            mask[r, at + starts[i] : at + len(s)] = True
            docs[r, at : at + len(s)] = d
            at += len(s)
    return ids, mask, docs


def epochs(seqs, starts, lengths: np.ndarray, rows_per_step: int, row_len: int, pad: int, rng: np.random.Generator, device):
    """Endless steps of packed rows (ids [B, row_len] long, loss mask, documents), on the device:
    each epoch repacks in a new order and moves once."""
    while True:
        rows = pack(lengths, row_len, rng)
        arrays = packed_arrays(seqs, starts, rows, row_len, pad)
        ids, mask, docs = (torch.from_numpy(a).to(device) for a in arrays)
        order = torch.from_numpy(rng.permutation(len(rows))).to(device)
        for b in range(0, len(rows) - rows_per_step + 1, rows_per_step):
            take = order[b : b + rows_per_step]
            yield ids[take].long(), mask[take], docs[take]


# ---- model ----
def losses(model: DemoModel, ids: torch.Tensor, mask: torch.Tensor, docs: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of the next token over completion tokens, and of the MTP layer's
    next-next token (a completion token's inputs are always in its own conversation)."""
    valid = ids != pad
    h = model.hidden(ids, valid, docs)
    main = _masked_ce(model.logits(h[:, :-1]), ids[:, 1:], mask[:, 1:])
    mtp = _masked_ce(model.mtp_logits(h, ids, valid, docs)[:, :-1], ids[:, 2:], mask[:, 2:])  # position i predicts i + 2
    return main, mtp


def _masked_ce(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the masked positions (weights, not indexing: no host sync)."""
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    m = mask.reshape(-1).float()
    return (ce * m).sum() / m.sum().clamp(min=1)


def update_router_biases(model: DemoModel, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: raise the selection bias of experts that got
    fewer tokens than average, lower it for those that got more."""
    for r in model.routers():
        if r.last_load is not None:
            r.e_score_correction_bias += rate * torch.sign(r.last_load.mean() - r.last_load)


def bf16_copy(model: DemoModel) -> dict[str, torch.Tensor]:
    """The checkpoint: bf16 everywhere but the router's selection bias (float32, as published)."""
    return {
        k: (v.float() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)).cpu().contiguous()
        for k, v in model.hf_state_dict().items()
    }


@torch.no_grad()
def greedy(model: DemoModel, prompts: list[list[int]], max_new: int, stop: int, pad: int, device, batch: int = 64) -> list[list[int]]:
    """Greedy completions without a KV cache (each step recomputes the batch): for evaluation."""
    outs = []
    for b in range(0, len(prompts), batch):
        seqs = [list(p) for p in prompts[b : b + batch]]
        n0 = [len(s) for s in seqs]
        done = [False] * len(seqs)
        for _ in range(max_new):
            T = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), T), pad, dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, : len(s)] = torch.tensor(s)
            h = model.hidden(ids.to(device))
            last = torch.tensor([len(s) - 1 for s in seqs], device=device)
            nxt = model.logits(h[torch.arange(len(seqs), device=device), last]).argmax(-1).tolist()
            for r, t in enumerate(nxt):
                if not done[r]:
                    seqs[r].append(t)
                    done[r] = t == stop
            if all(done):
                break
        outs += [s[n:] for s, n in zip(seqs, n0)]
    return outs


@torch.no_grad()
def evaluate(model: DemoModel, tok, device, n_tasks: int, n_text: int, pad: int, stop: int) -> dict:
    """Held-out task accuracy (greedy), and on held-out text: perplexity of the completions and
    the MTP layer's next-next-token accuracy (teacher-forced, completion tokens)."""
    model.eval()
    result: dict = {}
    if n_tasks:
        samples = tasks.held_out_tasks(n_tasks)
        prompts = [tok.encode(s.prompt(), add_special_tokens=False).ids for s in samples]
        outs = greedy(model, prompts, tasks.REPLY_MAX_TOKENS, stop, pad, device)
        texts = [tok.decode(o, skip_special_tokens=True) for o in outs]
        acc = tasks.accuracy(samples, texts)
        result.update(call_accuracy=acc["call"], answer_accuracy=acc["answer"], call_ids_exact=acc["ids"])
        result["call_tasks"] = sum(s.kind == "call" for s in samples)
        result["answer_tasks"] = sum(s.kind == "answer" for s in samples)
        result["examples"] = [tok.decode(o, skip_special_tokens=False) for o in outs[:6]]
        missed = [(s, o) for s, o, t in zip(samples, outs, texts) if not tasks.accuracy([s], [t])[s.kind]]
        result["missed"] = [{"asked": s.messages[-1]["content"], "wrote": tok.decode(o, skip_special_tokens=False)} for s, o in missed[:20]]
    metrics = text_metrics(model, lambda t: tok.encode(t, add_special_tokens=False).ids, tasks.held_out_text(n_text), device)
    result["held_out_perplexity"] = metrics["perplexity"]
    result["mtp_next_next_token_accuracy"] = metrics["mtp_accuracy"]
    result["held_out_text_tokens"] = metrics["tokens"]
    model.train()
    return result


def plot(log: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in log]
    ax.plot(steps, [r["loss"] for r in log], label="next token (completion tokens)")
    ax.plot(steps, [r["mtp_loss"] for r in log], label="MTP: next-next token")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title("moeserve demo model (tiny DeepseekV3 + MTP)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def train(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    t_start = time.time()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        if args.deterministic_kernels:
            torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config_dict = json.loads((MODEL_DIR / "config.json").read_text())
    config = parse_model_config(config_dict)
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    pad, stop = config_dict["pad_token_id"], config_dict["eos_token_id"]
    lines: list[str] = []

    def say(msg: str) -> None:
        line = f"[{time.time() - t_start:7.1f}s] {msg}"
        print(line, flush=True)
        lines.append(line)

    workers = args.workers or min(16, os.cpu_count() or 1)
    seqs, starts = encode_samples(args.seed, args.samples, MODEL_DIR / "tokenizer.json", args.max_len, workers)
    lengths = np.asarray([len(s) for s in seqs])
    say(
        f"data: {len(seqs)} samples (seed {args.seed}), {lengths.sum() / 1e6:.1f}M tokens, "
        f"{(lengths - starts).sum() / 1e6:.1f}M in completions, longest {lengths.max()}"
    )

    model = DemoModel(config)
    model.init_weights(torch.Generator().manual_seed(args.seed))
    if args.init_from:  # fine-tune: start from a trained checkpoint instead of the seeded init
        from safetensors.torch import load_file

        model.load_hf_state_dict({k: v.float() for k, v in load_file(args.init_from).items()})
        say(f"weights from {args.init_from}")
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    experts = f"{config_dict['n_routed_experts']} experts, top-{config_dict['num_experts_per_tok']}"
    say(f"model: {n_params / 1e6:.2f}M parameters (MTP layer included); {experts}")
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() > 1 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        **({"fused": True} if device.type == "cuda" else {}),
    )

    total = args.steps or args.max_steps  # --steps 0: set from the measured pace after PROBE_STEPS

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        p = (step - args.warmup) / max(1, total - args.warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    rows_per_step = max(1, args.batch_tokens // args.max_len)
    feed = epochs(seqs, starts, lengths, rows_per_step, args.max_len, pad, np.random.default_rng(args.seed), device)
    # One shape every step (packed rows): compiled once, the step's many small kernels fused.
    step_losses = torch.compile(losses) if args.compile else losses
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    log: list[dict] = []
    t_train = time.time()
    t_probe = t_train
    acc = torch.zeros(2, device=device)  # summed on the device: no sync but at log steps
    acc_n = 0
    step = 0
    while step < total:
        ids, mask, docs = next(feed)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with autocast:
            main, mtp = step_losses(model, ids, mask, docs, pad)
            loss = main + args.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            update_router_biases(model, args.bias_rate)
        acc += torch.stack([main.detach(), mtp.detach()]).float()
        acc_n += 1
        step += 1
        if step == 10:
            sync()
            t_probe = time.time()
        if args.profile and step == PROBE_STEPS + 1:  # after the pace probe, which it would slow
            sync()
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    ids, mask, docs = next(feed)
                    with autocast:
                        main, mtp = step_losses(model, ids, mask, docs, pad)
                        loss = main + args.mtp_weight * mtp
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                sync()
            say(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
        if not args.steps and step == PROBE_STEPS:
            sync()
            per_step = (time.time() - t_probe) / (PROBE_STEPS - 10)
            left = args.train_seconds - (time.time() - t_train)
            total = int(min(args.max_steps, max(args.warmup + 100, step + left / per_step)))
            say(f"pace {per_step * 1e3:.1f} ms/step: {total} steps fit in {args.train_seconds:.0f}s")
            say(f"(rerun with --steps {total} to reproduce this run)")
        if step % args.log_every == 0 or step == 1:
            elapsed = time.time() - t_train
            mean_main, mean_mtp = (acc / acc_n).tolist()
            record = {"step": step, "loss": mean_main, "mtp_loss": mean_mtp, "lr": lr_at(step - 1), "seconds": round(elapsed, 1)}
            log.append(record)
            batch = f"{ids.numel() / 1e3:.0f}k tok/batch"
            say(f"step {step:6d}  loss {mean_main:.4f}  mtp {mean_mtp:.4f}  lr {record['lr']:.2e}  {batch}  {elapsed:.0f}s")
            acc.zero_()
            acc_n = 0
        if time.time() - t_train > args.time_limit:
            say(f"time limit ({args.time_limit:.0f}s) reached: stopped after step {step} of {total}")
            break
    sync()
    say(f"trained {step} steps in {time.time() - t_train:.0f}s")

    tensors = bf16_copy(model)
    provenance = {"trained_on": device.type, "steps": str(step), "seed": str(args.seed), "samples": str(len(seqs))}
    if args.init_from:
        from safetensors import safe_open

        with safe_open(args.init_from, "pt") as f:
            before = f.metadata() or {}
        # the run it continues, so the record says every step the weights have seen
        provenance["fine_tuned_from"] = json.dumps({k: before[k] for k in ("trained_on", "steps", "seed", "samples") if k in before})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", **provenance})
    size = (out / "model.safetensors").stat().st_size
    say(f"wrote model.safetensors: {len(tensors)} tensors, {size / 2**20:.2f} MiB")
    # Evaluate exactly the saved (bf16-rounded) weights, computing in float32.
    evaluated = DemoModel(config)
    evaluated.load_hf_state_dict({k: v.float() for k, v in tensors.items()})
    evaluated.to(device)
    result = evaluate(evaluated, tok, device, args.eval_tasks, args.eval_text, pad, stop)
    result.update(steps=step, seed=args.seed, samples=len(seqs), train_seconds=round(time.time() - t_train, 1), device=str(device))
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    for k, v in result.items():
        if k != "examples":
            if k != "missed":
                say(f"eval {k}: {v:.4f}" if isinstance(v, float) else f"eval {k}: {v}")
    plot(log, out / "loss.png")

    def write_results() -> None:
        (out / "eval.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
        (out / "training_log.txt").write_text("\n".join([" ".join(sys.argv)] + lines) + "\n")

    write_results()
    if args.engine_check:
        del model, opt, evaluated  # the engine sizes its KV cache from the free GPU memory
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            result["engine"] = engine_check(out / "model.safetensors", device, min(args.eval_tasks, args.engine_tasks), say)
        except Exception as e:  # noqa: BLE001 - the weights are written; say what failed and go on
            say(f"engine check failed: {type(e).__name__}: {e}")
    say(f"done in {time.time() - t_start:.0f}s")
    write_results()


def engine_check(weights: Path, device: torch.device, n_tasks: int, say) -> dict:
    """moeserve itself on the new weights, on the held-out tasks (greedy): the fast path (Triton
    kernels) against the reference path in bf16 (equal tokens?), and the task accuracy of bf16
    and of the INT4 and FP8 copies."""
    import shutil
    import tempfile

    from moeserve import LLM, SamplingParams
    from moeserve.demo.quantize import write_quantized_copy

    root = Path(tempfile.mkdtemp(prefix="moeserve-demo-check-"))
    bf16 = root / "bf16"
    shutil.copytree(MODEL_DIR, bf16, ignore=shutil.ignore_patterns("model.safetensors"))
    shutil.copy(weights, bf16 / "model.safetensors")
    samples = tasks.held_out_tasks(n_tasks)
    params = SamplingParams(temperature=0, max_tokens=tasks.REPLY_MAX_TOKENS)
    runs: dict[str, list] = {}
    for name, path, backend in (
        ("bf16_reference", bf16, "reference"),
        ("bf16_fast", bf16, "triton"),
        ("int4", write_quantized_copy(bf16, root / "int4", "int4"), "triton"),
        ("fp8", write_quantized_copy(bf16, root / "fp8", "fp8"), "triton"),
    ):
        t = time.time()
        # An explicit KV size: sized from free memory, this model's tiny pages would number millions.
        kw = dict(device=device.type, dtype="bfloat16", backend=backend, enforce_eager=True, num_kv_pages=8192)
        with LLM(str(path), **kw) as llm:
            tok = llm.get_tokenizer()
            prompts = [{"prompt_token_ids": tok.encode(s.prompt(), add_special_tokens=False)} for s in samples]
            runs[name] = [o.outputs[0] for o in llm.generate(prompts, params)]
        say(f"engine {name}: {len(samples)} held-out tasks in {time.time() - t:.0f}s")
    result: dict = {}
    ref = runs["bf16_reference"]
    result["fast_equals_reference"] = sum(a.token_ids == b.token_ids for a, b in zip(ref, runs["bf16_fast"])) / len(ref)
    for name, outs in runs.items():
        acc = tasks.accuracy(samples, [o.text for o in outs])
        result[f"{name}_call_accuracy"], result[f"{name}_answer_accuracy"] = acc["call"], acc["answer"]
    for k, v in result.items():
        say(f"engine {k}: {v:.4f}")
    shutil.rmtree(root, ignore_errors=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-tokenizer", action="store_true", help="train the BPE tokenizer into src/moeserve/demo/model/ and stop")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=0, help="training steps (0: as many as fit in --train-seconds at the measured pace)")
    p.add_argument("--max-steps", type=int, default=40000, help="--steps 0: at most this many")
    p.add_argument("--train-seconds", type=float, default=150.0, help="--steps 0: the training time to fill")
    p.add_argument("--samples", type=int, default=600_000, help="training conversations generated")
    p.add_argument("--batch-tokens", type=int, default=65536, help="tokens per step (rows of --max-len packed conversations)")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--init-from", default=None, help="a model.safetensors to fine-tune (default: train from the seeded init)")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP loss (DeepSeek-V3: 0.3, later 0.1)")
    p.add_argument("--bias-rate", type=float, default=1e-3, help="router bias update speed (DeepSeek-V3: 0.001)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument(
        "--deterministic-kernels",
        action="store_true",
        help="ask torch for deterministic GPU kernels (the data, initial weights and batch order are seeded either way); "
        "the first H200 run with them on paced 366 ms a step",
    )
    p.add_argument("--compile", type=int, default=None, help="torch.compile the step (default: 1 on a GPU, 0 on a CPU)")
    p.add_argument("--profile", action="store_true", help="print the GPU kernels of 5 steps after the pace probe")
    p.add_argument("--time-limit", type=float, default=260.0, help="stop training after this many seconds whatever --steps says")
    p.add_argument("--engine-check", action="store_true", help="then run moeserve on the weights: fast path vs reference, INT4 and FP8")
    p.add_argument("--engine-tasks", type=int, default=200, help="--engine-check: held-out tasks per engine run")
    p.add_argument("--eval-tasks", type=int, default=None, help="held-out tasks to answer greedily (default 300 on a GPU, 0 on a CPU)")
    p.add_argument("--eval-text", type=int, default=200, help="held-out conversations for perplexity and MTP accuracy")
    p.add_argument("--workers", type=int, default=None, help="processes generating the data (default: up to 16)")
    args = p.parse_args()
    if args.build_tokenizer:
        config = json.loads((MODEL_DIR / "config.json").read_text())
        build_tokenizer(MODEL_DIR, config["vocab_size"], args.seed)
        print(f"wrote the tokenizer into {MODEL_DIR}")
        return
    if args.out is None:
        p.error("--out is needed to train")
    if args.compile is None:
        args.compile = int(args.device.startswith("cuda"))
    if args.eval_tasks is None:
        args.eval_tasks = 300 if args.device.startswith("cuda") else 0
    train(args)


if __name__ == "__main__":
    main()
