"""Tokenizing prompt tails fast: a byte-level BPE `tokenizer.json` run by tiktoken, for the shapes where that is exact.

Tokens mode tokenizes every call's new tail (a tool's output: thousands of tokens) in the gateway. The `tokenizers`
library took 5–8 ms for a 3k-token tail on the project's loaded 2-core machine, nearly all of a call's gateway
time; tiktoken takes ~0.4 ms for the same ids, and builds in less time than `Tokenizer.from_file` (gateway start).
It runs only when the tokenizer is one tiktoken reproduces exactly, checked here at load:

- a BPE model without dropout, unknown token, byte fallback or word prefixes/suffixes, over a byte-level alphabet;
- no normalizer or NFC (applied here), and a pre-tokenizer that is one regex split ("isolated") then byte-level
  without its own regex, or byte-level with GPT-2's regex;
- the merge list in the order of its merged tokens' ids (tiktoken merges by rank = id; the BPE by merge order);
- added tokens matched as whole strings (no lstrip/rstrip/single-word/normalized): they split the text first.

Anything else is tokenized by the `tokenizers` library (renderer.py). Equality with transformers is tested on every
recorded session (tests/gateway/test_renderer.py), and the first call of every chain is still checked against the
engine's own ids.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from polar_mitm.storage.bpe_cache import BpeTables

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character each byte is written as → the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


def unsupported(data: dict[str, Any]) -> str | None:
    """Why this tokenizer.json is not one tiktoken reproduces exactly; None when it is."""
    model = data.get("model") or {}
    if (
        model.get("type") != "BPE"
        or model.get("dropout")
        or model.get("unk_token")
        or model.get("byte_fallback")
    ):
        return "not a plain BPE model"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "word prefixes or suffixes"
    if not model.get("ignore_merges"):
        return "a word in the vocabulary is merged, not taken whole (tiktoken takes it whole)"
    normalizer = data.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return f"normalizer {normalizer.get('type')}"
    if split_pattern(data.get("pre_tokenizer")) is None:
        return "pre-tokenizer"
    for token in data.get("added_tokens") or ():
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word") or token.get("normalized"):
            return f"added token {token.get('content')!r} is not matched as a whole string"
    return None


def split_pattern(pre_tokenizer: dict[str, Any] | None) -> str | None:
    """The one regex a supported pre-tokenizer splits by (then bytes → GPT-2's alphabet), else None."""
    if pre_tokenizer is None:
        return None
    if pre_tokenizer.get("type") == "ByteLevel":
        plain = not pre_tokenizer.get("add_prefix_space")
        return GPT2_PATTERN if pre_tokenizer.get("use_regex", True) and plain else None
    steps = pre_tokenizer.get("pretokenizers") or []
    if pre_tokenizer.get("type") != "Sequence" or len(steps) != 2:
        return None
    split, byte_level = steps
    regex = (split.get("pattern") or {}).get("Regex")
    if (
        split.get("type") != "Split"
        or regex is None
        or split.get("behavior") != "Isolated"
        or split.get("invert")
    ):
        return None
    if (
        byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex")
        or byte_level.get("add_prefix_space")
    ):
        return None
    return regex


class TiktokenBPE:
    """Encodes text like the `tokenizers` library would for a supported tokenizer.json (see the module doc)."""

    def __init__(self, tables: BpeTables) -> None:
        import tiktoken

        self.tables = tables
        self.added, self.vocab, self.nfc = tables.added, tables.vocab, tables.nfc
        self._bpe = tiktoken.Encoding(
            "polar-bpe", pat_str=tables.pattern, mergeable_ranks=tables.ranks, special_tokens={}
        )
        longest_first = sorted(self.added, key=len, reverse=True)
        self._added_re = re.compile("|".join(map(re.escape, longest_first))) if longest_first else None

    def token_id(self, text: str) -> int | None:
        return self.added.get(text, self.vocab.get(text))

    def encode(self, text: str) -> list[int]:
        """Ids of `text`: added tokens first (whole strings), each stretch between them normalized and BPE'd."""
        if self._added_re is None:
            return self._stretch(text)
        ids: list[int] = []
        start = 0
        for match in self._added_re.finditer(text):
            if match.start() > start:
                ids += self._stretch(text[start : match.start()])
            ids.append(self.added[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._stretch(text[start:])
        return ids

    def _stretch(self, text: str) -> list[int]:
        return self._bpe.encode_ordinary(unicodedata.normalize("NFC", text) if self.nfc else text)


def tables_of(data: dict[str, Any]) -> BpeTables:
    """What tiktoken is built from, read off a supported tokenizer.json."""
    to_latin1 = str.maketrans({char: chr(byte) for char, byte in byte_decoder().items()})
    vocab: dict[str, int] = data["model"]["vocab"]
    # Each character of a byte-level token stands for one byte: translate, then latin-1 is the identity.
    ranks = {token.translate(to_latin1).encode("latin-1"): rank for token, rank in vocab.items()}
    if len(ranks) != len(vocab) or not merges_follow_ids(data["model"].get("merges") or [], vocab):
        raise ValueError("the merges do not follow the token ids")
    pattern = split_pattern(data["pre_tokenizer"])
    if pattern is None:
        raise ValueError("pre-tokenizer")
    return BpeTables(
        ranks=ranks,
        vocab=vocab,
        added={token["content"]: int(token["id"]) for token in data.get("added_tokens") or ()},
        pattern=pattern,
        nfc=(data.get("normalizer") or {}).get("type") == "NFC",
    )


def merges_follow_ids(merges: list, vocab: dict[str, int]) -> bool:
    """Whether merging by merge order equals merging by the merged token's id (what tiktoken does)."""
    if merges and isinstance(merges[0], str):
        merges = [merge.split(" ", 1) for merge in merges]
    merged = [vocab.get(left + right, -1) for left, right in merges]
    return -1 not in merged and all(a <= b for a, b in zip(merged, merged[1:], strict=False))
