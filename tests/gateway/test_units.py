"""Gateway building blocks without servers: provider detection, identity resolution, the durable journal."""

from __future__ import annotations

import base64
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime

import pyarrow.parquet as pq
import pytest

from polar_mitm import session_ids
from polar_mitm.codecs import detect
from polar_mitm.gateway import identity
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.journal import RecordWriter, compact_journal
from polar_mitm.storage.journal_format import JOURNAL_DIR, read_journal
from polar_mitm.storage.records import RECORD_SCHEMA, Record, read_all


@pytest.mark.parametrize(
    ("path", "headers", "body", "expected"),
    [
        ("/v1/messages", {}, {}, "anthropic"),
        ("/s/abc/v1/messages", {}, {}, "anthropic"),
        ("/v1/chat/completions", {}, {}, "openai_chat"),
        ("/api/v1/chat/completions", {}, {}, "openai_chat"),
        ("/chat/completions", {}, {}, "openai_chat"),
        ("/v1/responses", {}, {}, "openai_responses"),
        ("/backend-api/codex/responses", {}, {}, "openai_responses"),
        ("/v1beta/models/gemini-2.5-pro:generateContent", {}, {}, "google"),
        ("/v1/models/gemini-2.5-pro:streamGenerateContent", {}, {}, "google"),
        # No known path: headers, then the body's shape decide.
        ("/proxy/x", {"anthropic-version": "2023-06-01"}, {"messages": [], "model": "c"}, "anthropic"),
        ("/proxy/x", {}, {"contents": []}, "google"),
        ("/proxy/x", {}, {"model": "m", "input": "hi"}, "openai_responses"),
        ("/proxy/x", {}, {"model": "m", "messages": []}, "openai_chat"),
        ("/v1/messages/count_tokens", {}, {"foo": 1}, None),
        ("/telemetry", {}, {"events": []}, None),
    ],
)
def test_provider_detection_by_path_then_headers_then_body(path, headers, body, expected):
    codec = detect(path, headers, body)
    assert (codec.name if codec else None) == expected


def basic(user: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:x".encode()).decode()


def test_identity_first_match_wins_in_documented_order():
    resolve = identity.resolve
    h = {"x-polar-session": "hdr", "x-polar-task": "T", "x-api-key": "polar-key"}
    # A session bound by its proxy user or path ignores x-polar-session/x-polar-task (issue 36 item 10).
    who, path = resolve(h, "/s/p/v1/messages", {}, proxy_user_name="u", connection_id="c1")
    assert (who.session_id, who.task_id, who.source, path) == ("u", None, "proxy_auth", "/v1/messages")
    who, path = resolve(h, "/s/p/v1/messages", {}, proxy_user_name=None, connection_id="c1")
    assert (who.session_id, who.task_id, who.source, path) == ("p", None, "path", "/v1/messages")
    who, path = resolve(h, "/v1/messages", {}, proxy_user_name=None, connection_id="c1")
    assert (who.session_id, who.task_id, who.source, path) == ("hdr", "T", "header", "/v1/messages")
    who, _ = resolve(
        {"x-api-key": "polar-key"}, "/s/p/v1/messages", {}, proxy_user_name="task9/u", connection_id="c1"
    )
    assert (who.session_id, who.task_id, who.source) == ("u", "task9", "proxy_auth")
    who, path = resolve(
        {"x-api-key": "polar-key"}, "/t/tk/s/p/v1/messages", {}, proxy_user_name=None, connection_id="c1"
    )
    assert (who.session_id, who.task_id, who.source, path) == ("p", "tk", "path", "/v1/messages")
    who, _ = resolve(
        {"authorization": "Bearer polar-tt/kk"}, "/v1/x", {}, proxy_user_name=None, connection_id="c1"
    )
    assert (who.session_id, who.task_id, who.source) == ("kk", "tt", "api_key")
    who, _ = resolve(
        {}, "/v1beta/models/g:generateContent", {"key": "polar-gk"}, proxy_user_name=None, connection_id="c1"
    )
    assert (who.session_id, who.source) == ("gk", "api_key")
    who, _ = resolve({"x-api-key": "sk-real"}, "/v1/messages", {}, proxy_user_name=None, connection_id="c9")
    assert (who.session_id, who.task_id, who.source) == ("conn-c9", None, "connection")


def test_proxy_user_is_decoded_and_harness_ids_are_kept():
    assert identity.proxy_user(basic("task%2Fsess")) == "task/sess"
    assert identity.proxy_user("Bearer abc") is None and identity.proxy_user(None) is None
    who, _ = identity.resolve(
        {"x-claude-code-session-id": "cc-1", "authorization": "Bearer sk"},
        "/v1/messages",
        {},
        proxy_user_name=None,
        connection_id="c",
    )
    assert who.harness_ids == {"x-claude-code-session-id": "cc-1"}
    assert identity.scrub_headers({"Authorization": "x", "X-Api-Key": "y", "ok": "1"}) == {"ok": "1"}


def make_record(i: int, session: str = "s") -> dict:
    now = datetime.now(UTC)
    return Record(
        request_id=f"r{i}",
        session_id=session,
        seq=i,
        started_at=now,
        finished_at=now,
        provider="openai_chat",
        path="/v1/chat/completions",
        stream=False,
        finish_reason="stop",
        prompt_ids=list(range(i + 3)),
        completion_ids=[7, 8],
        completion_logprobs=[-0.5, -0.25],
    ).to_journal()


def test_writer_acknowledges_after_disk_and_compacts_on_close(tmp_path):
    writer = RecordWriter(tmp_path)
    writer.start()
    futures = [writer.write(make_record(i)) for i in range(10)]
    for f in futures:
        f.result(timeout=10)
    journals = list((tmp_path / JOURNAL_DIR).glob("*.polarj"))
    assert len(journals) == 1 and len(read_journal(journals[0])) == 10
    writer.close()
    shards = list(tmp_path.glob("records-*.parquet"))
    assert len(shards) == 1 and not list((tmp_path / JOURNAL_DIR).glob("*.polarj"))
    table = pq.read_table(shards[0])
    assert table.schema.equals(RECORD_SCHEMA, check_metadata=False)
    assert table["seq"].to_pylist() == list(range(10))
    assert table["completion_logprobs"].to_pylist()[0] == [-0.5, -0.25]


def test_writer_rotates_by_size(tmp_path):
    writer = RecordWriter(tmp_path, rotate_bytes=2000)
    writer.start()
    for i in range(30):
        writer.write(make_record(i)).result(timeout=10)
    writer.close()
    assert len(list(tmp_path.glob("records-*.parquet"))) > 1
    assert sorted(read_all(tmp_path)["seq"].to_pylist()) == list(range(30))


_COMPACTION_CHILDREN: list[str] = []


def _note_compaction_child(event: str, args: tuple) -> None:
    if event == "subprocess.Popen" and "polar_mitm.storage.compact_child" in map(str, args[1] or ()):
        _COMPACTION_CHILDREN.append(str(args[1]))


sys.addaudithook(_note_compaction_child)  # audit hooks stay for the process: this one only notes our children


def test_rotation_compacts_in_a_child_process_and_appends_go_on_meanwhile(tmp_path):
    """While serving, compaction (JSON parsing and Arrow building under the GIL) runs in a child process on a
    thread of its own: a rotation holds up neither the event loop nor the next acknowledgement. Closing
    compacts in-process (no call waits any more)."""
    _COMPACTION_CHILDREN.clear()
    writer = RecordWriter(tmp_path, rotate_bytes=2000)
    writer.start()
    for i in range(30):
        writer.write(make_record(i)).result(timeout=10)
    deadline = time.monotonic() + 30
    while not writer.shards_written and time.monotonic() < deadline:
        time.sleep(0.05)
    assert writer.shards_written, "no rotation was compacted while the writer ran"
    # Rotations still queued are compacted in a child too (seen under load: a second child after the first shard);
    # what close() adds must be none, so the count is taken once nothing closed waits for compaction.
    while (writer._closed or not writer._compact_requests.empty()) and time.monotonic() < deadline:
        time.sleep(0.05)
    children = len(_COMPACTION_CHILDREN)
    assert children >= 1
    writer.close()
    assert len(_COMPACTION_CHILDREN) == children  # the last journal: in-process at close
    assert not list((tmp_path / JOURNAL_DIR).glob("*.polarj"))
    assert sorted(read_all(tmp_path, include_journal=False)["seq"].to_pylist()) == list(range(30))


def test_torn_journal_tail_is_ignored_and_recovered_at_start(tmp_path):
    writer = RecordWriter(tmp_path)
    writer.start()
    for i in range(3):
        writer.write(make_record(i)).result(timeout=10)
    journal = next((tmp_path / JOURNAL_DIR).glob("*.polarj"))
    # A crash in the middle of the fourth frame: the journal as it was, the writer gone (it held the folder's lock).
    left_behind = journal.read_bytes() + b"\x40\x00\x00\x00garbage"
    writer.close()
    for shard in tmp_path.glob("records-*.parquet"):
        shard.unlink()
    journal.write_bytes(left_behind)
    assert len(read_journal(journal)) == 3
    # A second writer on the same directory (the restarted gateway) compacts what the crash left behind.
    RecordWriter(tmp_path).start()
    assert not journal.exists()
    assert sorted(read_all(tmp_path, include_journal=False)["seq"].to_pylist()) == [0, 1, 2]


def test_compacting_an_empty_journal_writes_no_shard(tmp_path):
    (tmp_path / JOURNAL_DIR).mkdir()
    empty = tmp_path / JOURNAL_DIR / "journal-x.polarj"
    empty.write_bytes(b"")
    assert compact_journal(empty, tmp_path) is None and not empty.exists()


def test_a_rollout_gateway_takes_only_credentialed_ids_and_never_headers():
    """With a session key, an identity counts only when its credential matches its ids: another session's ids
    (which are on every harness command line) with no or a forged credential are refused, in every form."""
    key = "k" * 43
    mine = SessionId("s-1", "t/0").signed(key)
    other = SessionId("s-2", "t/0")
    resolve = identity.resolve
    hdr = {"x-polar-session": other.session, "x-polar-task": "t/9"}
    for path, user, headers in [
        (mine.path_prefix + "/v1/messages", None, hdr),
        ("/v1/messages", f"{mine.compact}{session_ids.PASSWORD_SEPARATOR}{mine.credential}", hdr),
        ("/v1/messages", None, {**hdr, "x-api-key": mine.api_key}),
    ]:
        who, rest = resolve(headers, path, {}, proxy_user_name=user, connection_id="c", session_key=key)
        assert (who.session_id, who.task_id, rest) == ("s-1", "t/0", "/v1/messages")
    forged = replace(other, credential=mine.credential)  # a valid credential, for someone else's ids
    for path, user, headers in [
        (other.path_prefix + "/v1/messages", None, {}),
        (forged.path_prefix + "/v1/messages", None, {}),
        ("/v1/messages", other.compact, {}),
        ("/v1/messages", f"{forged.compact}{session_ids.PASSWORD_SEPARATOR}{forged.credential}", {}),
        ("/v1/messages", None, {"x-api-key": forged.api_key}),
        ("/v1/messages", None, {"x-api-key": other.api_key}),
        ("/v1/messages", None, {"x-polar-session": mine.session, "x-polar-task": mine.task}),
        ("/v1/messages", None, {}),
    ]:
        with pytest.raises(identity.SessionRefused):
            resolve(headers, path, {}, proxy_user_name=user, connection_id="c", session_key=key)
    # The credential's forms parse back to the same ids.
    assert session_ids.parse_api_key(mine.api_key) == mine
    assert session_ids.parse_path(mine.path_prefix + "/v1")[0] == mine
    assert identity.proxy_user(basic_with(mine.proxy_user, mine.credential)).endswith(mine.credential)


def basic_with(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
