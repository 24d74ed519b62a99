"""Incremental detokenization equals decoding the whole output, for both implementations,
including characters split across tokens (byte-level tokens)."""

import pytest

from moeserve.demo.random_model import ensure_random_model
from moeserve.engine.detokenizer import IncrementalDetokenizer, StreamDetokenizer, WindowDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_random_model()), local_files_only=True)


@pytest.mark.parametrize("kind", [StreamDetokenizer, WindowDetokenizer])
def test_incremental_text_equals_full_decode(tokenizer, kind):
    prompt = tokenizer.encode("Grüße: ")
    output = tokenizer.encode("naïve café — 東京 🙂 ok") + [257, 300]  # eos and a reserved special token
    detok = (
        StreamDetokenizer(tokenizer, tokenizer.backend_tokenizer, prompt, True)
        if kind is StreamDetokenizer
        else WindowDetokenizer(tokenizer, prompt, True)
    )
    text = ""
    partial = []
    for t in output:
        piece = detok.add(t)
        assert "\ufffd" not in piece  # a split character is held back, never emitted half-made
        text += piece
        partial.append(text)
    text += detok.flush()
    assert text == tokenizer.decode(output, skip_special_tokens=True)
    assert any(p != text for p in partial)  # it really was incremental


def test_flush_shows_an_unfinished_character(tokenizer):
    ids = tokenizer.encode("é")  # two byte tokens
    detok = IncrementalDetokenizer(tokenizer, [], True)
    assert detok.add(ids[0]) == ""
    assert detok.flush() == "\ufffd"
