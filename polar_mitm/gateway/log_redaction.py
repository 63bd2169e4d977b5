"""No credential in any log line, ours or mitmproxy's.

mitmproxy logs a request line it cannot parse as it came (`Bad HTTP request line: b'POST http://user:SECRET@…'`):
a client that puts its proxy URL, credentials included, where the request target goes leaks them into the log.
Every log record of the process is redacted as it is created, whoever logs it.
"""

from __future__ import annotations

import logging
import re

# `scheme://userinfo@`: the user name may carry a session id, but both halves may be secrets in a raw line.
USERINFO = re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://|\bCONNECT\s+)[^/\s@'\"]+@")
AUTH_HEADER = re.compile(
    r"(?i)\b((?:proxy-)?authorization|x-api-key|x-goog-api-key|api-key)(['\"]?\s*[:=]\s*['\"]?)"
    r"[^'\"\r\n,}]+"
)

# A rollout session's credential (session_ids.py) in a path (`/s/SESSION/c/CRED`) or an API key (`polarc-CRED-…`).
SESSION_CREDENTIAL = re.compile(r"(/c/|\bpolarc-)[0-9a-f]{32}")


def redact(text: str) -> str:
    """`text` with URL credentials, session credentials and credential header values replaced by `<redacted>`."""
    if "@" in text:
        text = USERINFO.sub(r"\1<redacted>@", text)
    if "/c/" in text or "polarc-" in text:
        text = SESSION_CREDENTIAL.sub(r"\1<redacted>", text)
    if "uthorization" in text or "api-key" in text.lower():
        text = AUTH_HEADER.sub(r"\1\2<redacted>", text)
    return text


def install() -> None:
    """Redact every log record from now on (idempotent): the record factory formats and redacts the message."""
    base = logging.getLogRecordFactory()
    if getattr(base, "polar_redacting", False):
        return

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = base(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a bad format string is the logging module's to report, not ours
            return record
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return record

    factory.polar_redacting = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
