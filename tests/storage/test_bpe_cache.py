"""The gateway's tokenizer tables kept by content: a kept entry encodes exactly as the build it replaces, a bad or
stale entry is never used, and a cache that cannot be written only costs the build."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from polar_mitm.gateway.bpe import TiktokenBPE, tables_of
from polar_mitm.gateway.renderer import TokenizersEncoder, load_encoder
from polar_mitm.storage import bpe_cache
from tests.gateway.test_renderer import TRICKY_TEXTS


@pytest.fixture
def tokenizer(tiny_model_dir, tmp_path):
    path = tmp_path / "model" / "tokenizer.json"
    path.parent.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", path)
    return path


def test_the_first_load_keeps_the_tables_and_the_next_encodes_alike_from_them(tokenizer, tmp_path):
    cache = tmp_path / "cache"
    built = load_encoder(tokenizer, cache)
    entries = list(cache.glob("*.npz"))
    assert len(entries) == 1 and oct(cache.stat().st_mode & 0o777) == "0o700"
    kept = bpe_cache.load(cache, tokenizer.read_bytes())
    assert kept == tables_of(json.loads(tokenizer.read_text()))  # every table, exactly
    reloaded = load_encoder(tokenizer, cache)
    reference = TokenizersEncoder(tokenizer)
    assert isinstance(reloaded, TiktokenBPE) and reloaded.tables == built.tables
    for text in TRICKY_TEXTS:
        assert reloaded.encode(text) == built.encode(text) == reference.encode(text), text


def test_a_copied_tokenizer_hits_the_entry_and_an_edited_one_does_not(tokenizer, tmp_path):
    cache = tmp_path / "cache"
    load_encoder(tokenizer, cache)
    copy = tmp_path / "copy" / "tokenizer.json"
    copy.parent.mkdir()
    shutil.copy(tokenizer, copy)
    assert bpe_cache.load(cache, copy.read_bytes()) is not None
    data = json.loads(tokenizer.read_text())
    data["added_tokens"][0]["content"] = "<|renamed|>"
    tokenizer.write_text(json.dumps(data))
    assert bpe_cache.load(cache, tokenizer.read_bytes()) is None
    assert "<|renamed|>" in load_encoder(tokenizer, cache).added


def test_a_cut_or_foreign_entry_is_rebuilt_and_replaced(tokenizer, tmp_path):
    cache = tmp_path / "cache"
    load_encoder(tokenizer, cache)
    (entry,) = cache.glob("*.npz")
    entry.write_bytes(entry.read_bytes()[:1000])
    assert bpe_cache.load(cache, tokenizer.read_bytes()) is None
    assert load_encoder(tokenizer, cache).encode(TRICKY_TEXTS[0]) == TokenizersEncoder(tokenizer).encode(
        TRICKY_TEXTS[0]
    )
    assert bpe_cache.load(cache, tokenizer.read_bytes()) is not None  # replaced by a good entry


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_cache_that_cannot_be_written_still_loads(tokenizer, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o500)
    assert isinstance(load_encoder(tokenizer, cache), TiktokenBPE)
    assert not list(cache.iterdir())


def test_a_cache_path_that_is_a_file_still_loads(tokenizer, tmp_path):
    cache = tmp_path / "cache"
    cache.write_text("not a folder")
    assert isinstance(load_encoder(tokenizer, cache), TiktokenBPE)
