"""The checkpoint's own tokenizer, from local files only (never the network)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("moeserve")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")


def load_tokenizer(path: str | Path | None, trust_remote_code: bool = False) -> Any | None:
    """The transformers tokenizer in ``path``, or None when the directory has none."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_dir() or not any((p / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=trust_remote_code)
