"""The gateway's tokenizer, kept ready to load: a supported `tokenizer.json`'s BPE tables (gateway/bpe.py) by content.

Tokens mode needs the engine's tokenizer in every gateway. Building it from a 19 MB `tokenizer.json` parses the
whole file in Python and translates 150k tokens to bytes: ~0.6 s of CPU at every gateway start (the suite starts
~200). The tables it builds are kept here, named by a hash of the file's bytes (so a copied checkpoint folder hits
the same entry and an edited file never does), as plain arrays (numpy `.npz`, read without pickle): loading them
takes a fraction of that. Written once, atomically; a missing, unreadable or foreign entry is simply rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the tables' meaning changes: older entries are then rebuilt, never misread


@dataclass
class BpeTables:
    """What `gateway.bpe.TiktokenBPE` is built from."""

    ranks: dict[bytes, int]  # each token's bytes → its id (tiktoken's mergeable ranks)
    vocab: dict[str, int]  # the tokenizer.json's own vocabulary (GPT-2 alphabet strings) → id
    added: dict[str, int]  # added tokens (matched as whole strings) → id
    pattern: str  # the pre-tokenizer's split regex
    nfc: bool  # NFC normalizer


def entry_name(tokenizer_json: bytes) -> str:
    return f"{hashlib.blake2b(tokenizer_json, digest_size=16).hexdigest()}.npz"


def load(folder: Path, tokenizer_json: bytes) -> BpeTables | None:
    """The tables kept for these `tokenizer.json` bytes, or None (not kept yet, or unreadable: rebuild)."""
    path = folder / entry_name(tokenizer_json)
    try:
        with np.load(path, allow_pickle=False) as arrays:
            meta = json.loads(str(arrays["meta"]))
            if meta.get("format") != FORMAT:
                return None
            ranks = dict(
                zip(
                    _split(arrays["rank_bytes"].tobytes(), arrays["rank_ends"]),
                    arrays["rank_ids"].tolist(),
                    strict=True,
                )
            )
            vocab_text = str(arrays["vocab_text"])
            if len(vocab_text) != int(arrays["vocab_ends"][-1]):  # numpy drops a string's trailing NULs
                return None
            vocab = dict(
                zip(_split(vocab_text, arrays["vocab_ends"]), arrays["vocab_ids"].tolist(), strict=True)
            )
    except FileNotFoundError:
        return None
    except Exception as exc:  # a cut or foreign file: rebuilt and replaced
        log.debug("bpe cache entry %s unreadable: %s", path, exc)
        return None
    return BpeTables(ranks, vocab, dict(meta["added"]), meta["pattern"], bool(meta["nfc"]))


def save(folder: Path, tokenizer_json: bytes, tables: BpeTables) -> None:
    """Keep `tables` for these bytes (best effort: a read-only or full disk only costs the next start the build)."""
    rank_items = list(tables.ranks.items())
    vocab_items = list(tables.vocab.items())
    meta = {"format": FORMAT, "added": tables.added, "pattern": tables.pattern, "nfc": tables.nfc}
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".bpe-", suffix=".npz")
    except OSError as exc:
        log.debug("bpe cache entry not written in %s: %s", folder, exc)
        return
    try:
        with os.fdopen(fd, "wb") as out:
            np.savez(
                out,
                meta=np.array(json.dumps(meta)),
                rank_bytes=np.frombuffer(b"".join(token for token, _ in rank_items), dtype=np.uint8),
                rank_ends=_ends(len(token) for token, _ in rank_items),
                rank_ids=np.array([rank for _, rank in rank_items], dtype=np.int64),
                vocab_text=np.array("".join(token for token, _ in vocab_items)),
                vocab_ends=_ends(len(token) for token, _ in vocab_items),
                vocab_ids=np.array([rank for _, rank in vocab_items], dtype=np.int64),
            )
        os.replace(tmp, folder / entry_name(tokenizer_json))
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if not isinstance(exc, OSError):
            raise
        log.debug("bpe cache entry not written in %s: %s", folder, exc)


def _ends(lengths) -> np.ndarray:
    return np.cumsum(np.fromiter(lengths, dtype=np.int64))


def _split(joined, ends: np.ndarray) -> list:
    """The pieces of `joined` (bytes or str) that end at `ends`."""
    starts = [0, *ends[:-1].tolist()]
    return [joined[start:end] for start, end in zip(starts, ends.tolist(), strict=True)]
