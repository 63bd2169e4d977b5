"""A checkpoint's tokenizer files, written so that every later load takes half the time.

transformers 5 drops `added_tokens_decoder` from `tokenizer_config.json` when it saves a tokenizers-backed
tokenizer, and then, on each load, parses the whole `tokenizer.json` in Python only to read its `added_tokens` back
(0.75 s of 1.4 s for the tiny model's 18 MB Qwen vocabulary) before the Rust backend parses the same file again.
Every engine, gateway, merge and training loads a tokenizer, so the suite and the loop paid it thousands of times.
With the added tokens in the config, transformers takes them from there (its own format, the one transformers 4
writes): the tokenizer loaded is the same, token for token (tests/storage/test_tokenizer_files.py).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILE = "tokenizer.json"
ADDED_TOKENS_KEY = "added_tokens_decoder"
ADDED_TOKEN_FIELDS = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")


def save_tokenizer(tokenizer: Any, directory: str | Path) -> None:
    """`tokenizer.save_pretrained(directory)`, with the added tokens kept in its config."""
    tokenizer.save_pretrained(str(directory))
    keep_added_tokens_in_config(directory, tokenizer)


def keep_added_tokens_in_config(directory: str | Path, tokenizer: Any = None) -> bool:
    """Write `added_tokens_decoder` into DIRECTORY/tokenizer_config.json unless it is there; True if written.

    The tokens come from `tokenizer` (a loaded one: free) or else from DIRECTORY/tokenizer.json (one parse, the
    cost a single load used to pay). A directory without both files is left alone."""
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return False
    if ADDED_TOKENS_KEY in config or not (directory / TOKENIZER_FILE).exists():
        return False
    if tokenizer is not None:
        added = {
            str(index): {field: getattr(token, field) for field in ADDED_TOKEN_FIELDS}
            for index, token in sorted(tokenizer.added_tokens_decoder.items())
        }
    else:
        rows = json.loads((directory / TOKENIZER_FILE).read_text()).get("added_tokens") or []
        added = {str(row["id"]): {field: row[field] for field in ADDED_TOKEN_FIELDS} for row in rows}
    config[ADDED_TOKENS_KEY] = added
    _write_atomically(config_path, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return True


def _write_atomically(path: Path, text: str) -> None:
    """Readers (another worker's engine loading the same cached model) see the old file or the new, never half."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
