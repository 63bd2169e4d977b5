"""`polar-mitm show` decodes with the tokenizer the gateway recorded for the merged records (it assumed the tiny
model's, so SmolLM2's records came out as another vocabulary's text)."""

from __future__ import annotations

import json

from polar_mitm.reconstruct.cli import recorded_tokenizer
from polar_mitm.storage.merged import SUMMARY_FILE


def test_the_recorded_tokenizer_is_found_through_the_merge_summary(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the summary names the engine file as the merge was given it: relative here
    tokenizer = tmp_path / "smollm2-tokenizer"
    tokenizer.mkdir()
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows" / "_engine.json").write_text(json.dumps({"tokenizer_path": str(tokenizer)}))
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / SUMMARY_FILE).write_text(json.dumps({"eot_source": "flows/_engine.json"}))
    assert recorded_tokenizer(str(merged)) == str(tokenizer)
    tokenizer.rmdir()  # recorded on another machine: not here
    assert recorded_tokenizer(str(merged)) is None
    (merged / SUMMARY_FILE).write_text(json.dumps({"eot_source": "--eot-token"}))
    assert recorded_tokenizer(str(merged)) is None
    assert recorded_tokenizer(str(tmp_path / "nowhere")) is None
