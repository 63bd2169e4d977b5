"""The engine requests of every recorded test session (sample_flows/: the SDK sessions and the six harnesses'),
decoded by the gateway's own codecs, in call order per session — what the token-exact renderer is proven on.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polar_mitm.codecs import detect
from polar_mitm.conversation import Conversation
from polar_mitm.engine.tiny_model import chat_template
from polar_mitm.gateway.import_flows import iter_flows

SAMPLES = Path(__file__).resolve().parents[2] / "sample_flows"
FLOW_FILES = sorted([SAMPLES / "sdk_sessions.flow", *(SAMPLES / "harness").glob("*.flow")])
TEMPLATES = ("qwen3", "smollm2")  # the two chat templates the project's engines render with


def engine_requests() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(flow file stem, session id, engine request) for every recorded model call."""
    for source, session, conv in conversations():
        yield source, session, conv.to_engine_request()


def conversations() -> Iterator[tuple[str, str, Conversation]]:
    """(flow file stem, session id, decoded request) for every recorded model call."""
    for flow_file in FLOW_FILES:
        for flow in iter_flows([flow_file]):
            record = flow.metadata.get("polar_record")
            if not record:
                continue
            path = record["path"]
            body = json.loads(flow.request.get_text())
            headers = {k.lower(): v for k, v in flow.request.headers.items()}
            codec = detect(path, headers, body)
            if codec is None:
                continue
            conv = codec.decode_request(body, path, dict(flow.request.query.items()))
            yield flow_file.stem, record["session_id"], conv


def tokenizer_with_template(model_dir: Path, template: str, folder: Path) -> Path:
    """A copy of the tiny model's tokenizer folder whose chat template is the named one of ours."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, folder / name)
    (folder / "chat_template.jinja").write_text(chat_template(template))
    return folder
