"""A byte-level BPE tokenizer of any vocabulary size, made up (no training corpus), for a dummy
checkpoint that has none: `moeserve serve --load-format dummy --tokenizer DIR` can then serve
structured outputs (xgrammar builds its token masks from the tokenizer) at the model's real
vocabulary size, which is what a grammar's per-token cost depends on.

    python scripts/synthetic_tokenizer.py OUT_DIR --vocab-size 163840 [--seed 0]

The vocabulary is the 256 byte tokens, then tokens made by merging two earlier ones (lowercase
letters and a leading space weighted like English text, so JSON keys and words have tokens of
several lengths), each with its merge rule, as a real byte-level BPE has. Ids above the
vocabulary's end up to the model's size are never produced (the engine masks them).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: byte b as one printable character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def synthetic_vocab(size: int, seed: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    alphabet = byte_alphabet()
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    rng = random.Random(seed)
    space = alphabet[ord(" ")]
    letters = [alphabet[b] for b in range(ord("a"), ord("z") + 1)]
    common = letters * 8 + [space] * 20 + [alphabet[b] for b in b'{}":,0123456789_-ABCDEFGHIJKLMNOPQRSTUVWXYZ'] + alphabet
    pieces = list(common)  # what merges draw from: common bytes, then the merged tokens themselves
    while len(vocab) < size:
        left = rng.choice(pieces) if rng.random() < 0.7 else rng.choice(common)
        right = rng.choice(letters if rng.random() < 0.8 else common)
        token = left + right
        if token in vocab or len(token) > 16 or (space in token[1:]):
            continue
        vocab[token] = len(vocab)
        merges.append((left, right))
        pieces.append(token)
    return vocab, merges


def write_tokenizer(out: Path, size: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = synthetic_vocab(size - 2, seed)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.add_special_tokens({"bos_token": "<|bos|>", "eos_token": "<|eos|>"})
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    (out / "synthetic.json").write_text(json.dumps({"vocab_size": len(fast), "seed": seed}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--vocab-size", type=int, default=163840)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    write_tokenizer(Path(args.out), args.vocab_size, args.seed)
    print(f"wrote a {args.vocab_size}-token byte-level BPE tokenizer to {args.out}")


if __name__ == "__main__":
    main()
