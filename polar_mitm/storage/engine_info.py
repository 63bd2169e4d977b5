"""What the records' engine was, written next to the records: `<polar_out>/_engine.json` — the file's contract.

`polar-mitm merge` needs the end-of-turn token id to splice turns, and the gateway knows the engine: its
`GET /model_info` names the model and tokenizer (and, on the embedded engine, the EOS ids), and in tokens mode the
gateway's own renderer has found the chat template's end-of-turn token. The gateway writes that description once
the engine answers, so `polar-mitm merge flows/` needs no `--eot-token`/`--tokenizer` for records it wrote (those
flags still override). A sidecar file rather than a record column: it describes the engine, not a call, and the
record schema stays as it is. The leading underscore keeps Parquet dataset readers from looking at it.

Here: its name, its content (`engine_description`), the atomic write and the reader (merge, the report).
Asking the engine and deciding when to write is the gateway's (`engines/description.py`).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

ENGINE_FILE = "_engine.json"
# /model_info fields worth keeping (SGLang's and the embedded engine's names).
MODEL_INFO_FIELDS = (
    "model_path",
    "tokenizer_path",
    "served_model_name",
    "weight_version",
    "context_length",
    "eos_token_ids",
    "tool_call_parser",
    "reasoning_parser",
    "engine",
    "engine_kind",  # sglang | vllm | embedded: the dialect the gateway spoke (polar_engine)
    "engine_version",
    "logprobs_mode",  # vLLM's --logprobs-mode
    "logprobs_temperature_scaled",  # are the records' logprobs after temperature (what the trainer assumes)?
)


def engine_description(
    model_info: dict[str, Any], backend: str, *, eot_token_id: int | None = None, eot_text: str | None = None
) -> dict[str, Any]:
    """The sidecar's content: the kept /model_info fields, the backend URL, and the end-of-turn token if known."""
    description: dict[str, Any] = {"backend": backend}
    description.update({k: model_info[k] for k in MODEL_INFO_FIELDS if model_info.get(k) is not None})
    if eot_token_id is not None:
        description["eot_token_id"] = int(eot_token_id)
        description["eot_text"] = eot_text
    return description


def write_engine_file(out_dir: str | Path, description: dict[str, Any]) -> Path:
    """Write `<out_dir>/_engine.json` atomically (temp file + rename): a reader never sees half a file."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".engine-", suffix=".json", dir=out)
    with os.fdopen(fd, "w") as handle:
        json.dump(description, handle, indent=2)
    os.replace(tmp, out / ENGINE_FILE)
    return out / ENGINE_FILE


def read_engine_file(directory: str) -> dict[str, Any] | None:
    """The sidecar of a record directory (local path or pyarrow filesystem URI); None when absent or unreadable."""
    import pyarrow.fs as pafs

    try:
        fs, root = (
            pafs.FileSystem.from_uri(directory) if "://" in directory else (pafs.LocalFileSystem(), directory)
        )
        with fs.open_input_stream(f"{root.rstrip('/')}/{ENGINE_FILE}") as stream:
            data = json.loads(stream.read())
    except (
        OSError,
        ValueError,
    ):  # no sidecar (older records, other gateways) or a damaged one: merge falls back
        return None
    return data if isinstance(data, dict) else None
