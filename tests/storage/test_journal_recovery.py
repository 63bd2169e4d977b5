"""Issue 18, storage side: no acknowledged record lost, bad files quarantined, atomic reads, safe printing.

Everything runs on real parts: a real RecordWriter on a real folder, real `polar-mitm` subprocesses, and a real
gateway (mitmdump + addon) where startup is what breaks.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
import zlib
from datetime import UTC, datetime
from pathlib import Path

import openai
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polar_mitm.engines import keys as engine_keys
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.processes import children, ports, secret_handover
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.journal import QUARANTINE_DIR, RecordWriter
from polar_mitm.storage.journal_format import (
    FILE_HEADER,
    FRAME_HEADER,
    JOURNAL_DIR,
    JOURNAL_SUFFIX,
    encode_frame,
)
from polar_mitm.storage.records import Record, journal_rows_to_table, list_sources, read_all

POLAR = str(Path(sys.executable).with_name("polar-mitm"))


def record(i: int, session: str = "s", task: str | None = None, **changes) -> dict:
    """One journal row of a plausible call (three prompt ids, two sampled ids with logprobs)."""
    now = datetime.now(UTC)
    row = Record(
        request_id=f"{session}-r{i}",
        session_id=session,
        task_id=task,
        seq=i,
        started_at=now,
        finished_at=now,
        provider="openai_chat",
        path="/v1/chat/completions",
        stream=False,
        finish_reason="stop",
        prompt_ids=[1, 2, 3 + i],
        completion_ids=[7, 8],
        completion_logprobs=[-0.5, -0.25],
        request_json="x" * 200,
    ).to_journal()
    row.update(changes)
    return row


def write_shard(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(journal_rows_to_table(rows), path)
    return path


def legacy_journal(path: Path, payloads: list[bytes]) -> Path:
    """A journal in the first on-disk format (length + crc32 + payload, no file header)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(FRAME_HEADER.pack(len(p), zlib.crc32(p)) + p for p in payloads))
    return path


def polar(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [POLAR, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "COLUMNS": "200"},
    )


def request_ids(out: Path) -> list[str]:
    return read_all(out)["request_id"].to_pylist()


def quarantined(out: Path) -> list[str]:
    return sorted(p.name for p in (out / QUARANTINE_DIR).glob("*")) if (out / QUARANTINE_DIR).is_dir() else []


# -- 1. acknowledged records survive a failed or corrupt journal write ------------------------------------------


def journal_of_ten(folder: Path, fmt: str) -> Path:
    """A journal holding ten acknowledged records, as the gateway leaves it after kill -9."""
    if fmt == "legacy":
        return legacy_journal(
            folder / JOURNAL_DIR / f"journal-x-1{JOURNAL_SUFFIX}",
            [orjson.dumps(record(i)) for i in range(10)],
        )
    writer = RecordWriter(folder)
    writer.start()
    for i in range(10):
        writer.write(record(i)).result(timeout=10)
    journal = next((folder / JOURNAL_DIR).glob(f"*{JOURNAL_SUFFIX}"))
    data = journal.read_bytes()
    writer.close()
    for shard in folder.glob("records-*.parquet"):
        shard.unlink()
    journal.write_bytes(data)
    return journal


@pytest.mark.parametrize("fmt", ["current", "legacy"])
def test_a_flipped_byte_mid_journal_loses_only_the_frame_it_hits(tmp_path, fmt):
    journal = journal_of_ten(tmp_path, fmt)
    data = bytearray(journal.read_bytes())
    data[len(data) * 35 // 100] ^= 0x40  # inside the fourth frame
    journal.write_bytes(bytes(data))
    RecordWriter(tmp_path).start()  # the restarted gateway recovers the journal
    kept = sorted(read_all(tmp_path, include_journal=False)["seq"].to_pylist())
    assert len(kept) == 9 and set(kept) < set(range(10)), kept
    # The unreadable bytes are not silently deleted: the journal is kept aside with the reason and offsets.
    names = quarantined(tmp_path)
    assert journal.name in names and f"{journal.name}.reason" in names
    assert "byte" in (tmp_path / QUARANTINE_DIR / f"{journal.name}.reason").read_text()


def test_frames_appended_after_a_partial_frame_are_recovered(tmp_path):
    # What a full disk left in the first on-disk format: three frames, a partial one, then four acknowledged.
    frames = [
        FRAME_HEADER.pack(len(p), zlib.crc32(p)) + p for p in (orjson.dumps(record(i)) for i in range(8))
    ]
    partial = frames[3][: len(frames[3]) // 2]
    journal = tmp_path / JOURNAL_DIR / f"journal-x-1{JOURNAL_SUFFIX}"
    journal.parent.mkdir()
    journal.write_bytes(b"".join(frames[:3]) + partial + b"".join(frames[4:]))
    RecordWriter(tmp_path).start()
    assert sorted(read_all(tmp_path)["seq"].to_pylist()) == [0, 1, 2, 4, 5, 6, 7]
    assert journal.name in quarantined(tmp_path) and not journal.exists()


DISK_FULL_CHILD = r"""
import json, resource, signal, sys
from datetime import UTC, datetime
from polar_mitm.storage.journal import RecordWriter
from polar_mitm.storage.records import Record

out, limit = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
writer = RecordWriter(out, rotate_seconds=3600)
writer.start()
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

def row(i):
    now = datetime.now(UTC)
    return Record(request_id=f"r{i}", session_id="s", seq=i, started_at=now, finished_at=now,
                  provider="openai_chat", path="/v1/chat/completions", stream=False, finish_reason="stop",
                  prompt_ids=list(range(40)), completion_ids=[7, 8], completion_logprobs=[-0.5, -0.25]).to_journal()

resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # the disk fills up
acked, failed, i = [], [], 0
while len(failed) < 3 and i < 500:
    try:
        writer.write(row(i)).result(timeout=10)
        acked.append(f"r{i}")
    except OSError:
        failed.append(f"r{i}")
    i += 1
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space is back
for _ in range(4):
    writer.write(row(i)).result(timeout=10)
    acked.append(f"r{i}")
    i += 1
writer.close()
print(json.dumps({"acked": acked, "failed": failed}))
"""


def test_acknowledged_records_survive_a_full_disk(tmp_path):
    out = tmp_path / "flows"
    child = subprocess.run(
        [sys.executable, "-c", DISK_FULL_CHILD, str(out), "3000"], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout)
    assert result["failed"], "the file-size limit never made a write fail"
    kept = set(read_all(out, include_journal=False)["request_id"].to_pylist())
    lost = [r for r in result["acked"] if r not in kept]
    assert not lost, f"{len(lost)} of {len(result['acked'])} acknowledged records lost: {lost}"
    assert not set(result["failed"]) & kept  # a failed write was never acknowledged, and is not a record
    assert not list((out / JOURNAL_DIR).glob(f"*{JOURNAL_SUFFIX}"))  # every journal accounted for


# -- 2. unreadable shards and bad rows are quarantined; the gateway keeps serving -------------------------------


def test_gateway_starts_despite_a_truncated_shard_and_a_bad_journal_row(tmp_path):
    out = tmp_path / "flows"
    good = write_shard(out / "records-0001.parquet", [record(i, "old") for i in range(3)])
    truncated = out / "records-0002.parquet"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    # Left behind by kill -9: three acknowledged rows, one with a prompt id no int32 holds.
    legacy_journal(
        out / JOURNAL_DIR / f"journal-x-1{JOURNAL_SUFFIX}",
        [
            orjson.dumps(record(3, "old")),
            orjson.dumps(record(4, "old", prompt_ids=[1, 2**40])),
            orjson.dumps(record(5, "old")),
        ],
    )
    gw = gateway_processes.start_gateway(
        f"http://127.0.0.1:{ports.free_port()}", out, confdir=tmp_path / "conf", log=tmp_path / "gw.log"
    )
    try:
        client = openai.OpenAI(
            api_key="k", base_url=SessionId("old").base_url(gw.reverse_url, "/v1"), max_retries=0
        )
        with pytest.raises(openai.InternalServerError):  # no engine: a recorded, provider-shaped 503
            client.chat.completions.create(model="gpt", messages=[{"role": "user", "content": "hi"}])
    finally:
        gw.stop()
    names = quarantined(out)
    assert "records-0002.parquet" in names and "records-0002.parquet.reason" in names
    assert any(n.endswith(".rows.jsonl") for n in names)
    bad = next((out / QUARANTINE_DIR).glob("*.rows.jsonl")).read_text().splitlines()
    assert len(bad) == 1 and json.loads(bad[0])["row"]["seq"] == 4 and json.loads(bad[0])["reason"]
    seqs = sorted(r["seq"] for r in read_all(out).to_pylist() if r["session_id"] == "old")
    assert seqs == [0, 1, 2, 3, 5, 6]  # the good rows compacted, and numbering went on after them
    reason = (out / QUARANTINE_DIR / "records-0002.parquet.reason").read_text()
    assert "records-0002.parquet" in reason and "unreadable" in reason


def framed_journal(path: Path, rows: list[dict]) -> Path:
    """A journal in the current on-disk format, as a gateway killed with -9 leaves it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(FILE_HEADER + b"".join(encode_frame(orjson.dumps(row)) for row in rows))
    return path


def chat(gw: gateway_processes.GatewayProcess, session: str) -> str:
    """One chat call through the gateway's reverse listener; the sampled text."""
    client = openai.OpenAI(
        api_key="k", base_url=SessionId(session).base_url(gw.reverse_url, "/v1"), max_retries=0
    )
    answer = client.chat.completions.create(
        model="gpt", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
    )
    return answer.choices[0].message.content or ""


def test_gateway_starts_and_quarantines_journal_rows_missing_required_fields(tmp_path, engine_url):
    out = tmp_path / "flows"
    no_version = {k: v for k, v in record(2, "old").items() if k != "schema_version"}
    framed_journal(
        out / JOURNAL_DIR / f"journal-x-1{JOURNAL_SUFFIX}",
        [record(0, "old"), record(1, "old", session_id=None), no_version, record(3, "old")],
    )
    log = tmp_path / "gw.log"
    for _ in range(2):  # and again: a bad row once kept every later start from serving
        with gateway_processes.gateway_running(engine_url, out, confdir=tmp_path / "conf", log=log) as gw:
            chat(gw, "old")
            assert gw.proc.poll() is None
    rows = read_all(out, include_journal=False).to_pylist()
    assert sorted(r["seq"] for r in rows if r["session_id"] == "old") == [0, 3, 4, 5]  # numbering went on
    bad = [
        json.loads(line)
        for p in (out / QUARANTINE_DIR).glob("*.rows.jsonl")
        for line in p.read_text().splitlines()
    ]
    assert sorted(b["row"]["seq"] for b in bad) == [1, 2]
    reasons = {b["row"]["seq"]: b["reason"] for b in bad}
    assert "session_id" in reasons[1] and "schema_version" in reasons[2], reasons
    assert not list((out / JOURNAL_DIR).glob(f"*{JOURNAL_SUFFIX}"))


def start_gateway_with_file_size_limit(
    backend: str, out: Path, tmp_path: Path, limit: int, rotate_seconds: int
) -> gateway_processes.GatewayProcess:
    """The gateway (reverse listener only) in a process that cannot write a file past `limit` bytes: EFBIG,
    what a full disk is to the writer (CPython ignores SIGXFSZ, so the write fails instead of killing it)."""
    port = ports.free_port()
    cmd = [
        str(Path(sys.executable).with_name("mitmdump")),
        "-s",
        str(gateway_processes.addon_path()),
        "--mode",
        f"reverse:http://127.0.0.1:9@{port}",
        "--set",
        f"confdir={tmp_path / 'conf'}",
        "--set",
        f"polar_backend={backend}",
        "--set",
        f"polar_out={out}",
        "--set",
        f"polar_rotate_seconds={rotate_seconds}",
    ]

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    handover = secret_handover.Handover({"engine_key": engine_keys.key_for(backend)})  # the engine's key
    with open(tmp_path / "gw.log", "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=limit_file_size,
            **handover.popen_kwargs(dict(os.environ)),
        )
    handover.close()
    try:
        ports.wait_port(port, proc=proc)
    except BaseException:
        children.stop(proc)
        raise
    return gateway_processes.GatewayProcess(proc, port, port, tmp_path / "conf", out)


def test_a_failed_compaction_at_startup_does_not_stop_serving_and_is_retried(tmp_path, engine_url):
    out = tmp_path / "flows"
    # Left behind by kill -9: records too big to compact while the disk is "full" (a 64 KiB file-size limit).
    big = [record(i, "old", request_json=os.urandom(30_000).hex()) for i in range(4)]
    journal = framed_journal(out / JOURNAL_DIR / f"journal-x-1{JOURNAL_SUFFIX}", big)
    gw = start_gateway_with_file_size_limit(engine_url, out, tmp_path, 64 << 10, rotate_seconds=1)
    try:
        chat(gw, "old")  # served and recorded while the old journal cannot be compacted
        assert journal.exists() and not list(out.glob("records-*-1.parquet"))
        assert "will be retried" in (tmp_path / "gw.log").read_text()
        resource.prlimit(gw.proc.pid, resource.RLIMIT_FSIZE, resource.getrlimit(resource.RLIMIT_FSIZE))
        deadline = time.monotonic() + 30
        while journal.exists() and time.monotonic() < deadline:  # space is back: the writer retries by itself
            time.sleep(0.2)
        assert not journal.exists() and list(out.glob("records-*-1.parquet"))
        assert gw.proc.poll() is None
    finally:
        gw.stop()
    rows = read_all(out, include_journal=False).to_pylist()
    assert sorted(r["seq"] for r in rows) == [0, 1, 2, 3, 4]  # numbering went on past the uncompacted journal
    assert {f"old-r{i}" for i in range(4)} < {r["request_id"] for r in rows}


def test_records_and_merge_do_not_crash_on_a_bad_journal_row(tmp_path):
    out = tmp_path / "flows"
    write_shard(out / "records-0001.parquet", [record(0)])
    legacy_journal(
        out / JOURNAL_DIR / f"journal-x-1{JOURNAL_SUFFIX}",
        [
            orjson.dumps(record(1)),
            orjson.dumps(record(2, completion_ids=["seven", 8])),
            orjson.dumps(record(3)),
        ],
    )
    listed = polar("records", str(out))
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    assert "3 records" in listed.stdout and "skipped" in listed.stdout and "seven" in listed.stdout
    merged = polar("merge", str(out), "-o", str(tmp_path / "merged"), "--builder", "per_request")
    assert merged.returncode == 0, merged.stdout + merged.stderr
    assert "Traceback" not in merged.stdout + merged.stderr
    assert pq.read_table(tmp_path / "merged").num_rows == 3


# -- 3. readers never miss nor double a record while the journal is compacted ----------------------------------


def test_concurrent_readers_see_every_acknowledged_record_once_during_rotation(tmp_path):
    writer = RecordWriter(tmp_path, rotate_seconds=0.25)
    writer.start()
    acked: list[str] = []
    stop = threading.Event()
    problems: list[str] = []
    reads = [0]

    def write() -> None:
        i = 0
        while not stop.is_set():
            writer.write(record(i)).result(timeout=10)
            acked.append(f"s-r{i}")
            i += 1
            time.sleep(0.005)

    def check(seen: list[str], expected: list[str], how: str) -> None:
        missing = set(expected) - set(seen)
        if missing or len(seen) != len(set(seen)):
            problems.append(f"{how}: {len(missing)} missing, {len(seen) - len(set(seen))} doubled")
        reads[0] += 1

    def read_live() -> None:
        while not stop.is_set():
            expected = list(acked)
            check(request_ids(tmp_path), expected, "read_all")
            expected = list(acked)
            sources = list_sources([str(tmp_path)]).sources
            check(
                [r for s in sources for r in s.read(["request_id"]).column(0).to_pylist()], expected, "merge"
            )

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read_live) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(8)
    stop.set()
    for t in threads:
        t.join()
    writer.close()
    assert len(writer.shards_written) >= 5 and reads[0] >= 50
    assert not problems, f"{len(problems)} of {reads[0]} reads were wrong: {problems[:5]}"


# -- 6. untrusted text is printed, never interpreted --------------------------------------------------------------


ODD_SESSION = "a[/]b"
ESC_TASK = "t\x1b[31mred\x1b]0;title\x07"


def test_odd_ids_are_printed_escaped_by_records_and_show(tmp_path):
    out = tmp_path / "flows"
    write_shard(out / "records-0001.parquet", [record(i, ODD_SESSION, ESC_TASK) for i in range(2)])
    listed = polar("records", str(out))
    assert listed.returncode == 0, listed.stderr
    assert ODD_SESSION in listed.stdout and "\x1b" not in listed.stdout and "\x07" not in listed.stdout
    merged = polar("merge", str(out), "-o", str(tmp_path / "merged"), "--builder", "per_request")
    assert merged.returncode == 0, merged.stdout + merged.stderr
    shown = polar("show", ODD_SESSION, "--data", str(tmp_path / "merged"), "--tokenizer", "none")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert ODD_SESSION in shown.stdout and "\x1b" not in shown.stdout
    missing = polar("show", "[bold]x[/]\x1b[2J", "--data", str(tmp_path / "merged"), "--tokenizer", "none")
    assert missing.returncode == 1 and "[bold]x[/]" in missing.stdout and "\x1b" not in missing.stdout


def test_rollout_tables_print_task_ids_as_text():
    from rich.console import Console

    from polar_mitm.rollout.runner import SessionRun
    from polar_mitm.rollout.view import summary_table
    from polar_mitm.tasks.task_file import Task

    console = Console(record=True, width=200, force_terminal=False)
    run = SessionRun(
        task=Task(task_id=f"{ODD_SESSION}{ESC_TASK}", prompt="p"),
        index=0,
        session_id="x",
        stage="done",
        status="ok",
        reward=1.0,
    )
    console.print(summary_table([run]))
    text = console.export_text()
    assert ODD_SESSION in text and "\x1b" not in text


# -- 12. merge answers bad input with one line naming the file --------------------------------------------------


def good_flows(folder: Path) -> Path:
    return write_shard(folder / "records-0001.parquet", [record(i, "good") for i in range(2)])


def bad_inputs(root: Path) -> dict[str, tuple[Path, str]]:
    """Each bad input next to a good shard: the file to name, and a word the message must contain."""
    cases: dict[str, tuple[Path, str]] = {}
    for name, content in (("truncated", None), ("empty", b""), ("not-parquet", b"hello, this is text\n")):
        folder = root / name
        good = good_flows(folder)
        bad = folder / "records-0002.parquet"
        bad.write_bytes(good.read_bytes()[:300] if content is None else content)
        cases[name] = (bad, "parquet")
    folder = root / "wrong-types"
    good_flows(folder)
    table = journal_rows_to_table([record(5, "w")])
    wrong = table.set_column(
        table.schema.get_field_index("prompt_ids"),
        "prompt_ids",
        pa.array([["one", "two"]], pa.list_(pa.string())),
    )
    pq.write_table(wrong, folder / "records-0002.parquet")
    cases["wrong-types"] = (folder / "records-0002.parquet", "prompt_ids")
    folder = root / "frame-not-a-record"
    good_flows(folder)
    legacy_journal(folder / JOURNAL_DIR / f"journal-x-2{JOURNAL_SUFFIX}", [b"[1, 2, 3]", b'"text"'])
    cases["frame-not-a-record"] = (folder / JOURNAL_DIR / f"journal-x-2{JOURNAL_SUFFIX}", "record")
    folder = root / "journal-dir"
    good_flows(folder)
    (folder / JOURNAL_DIR / f"journal-x-3{JOURNAL_SUFFIX}").mkdir(parents=True)
    cases["journal-dir"] = (folder / JOURNAL_DIR / f"journal-x-3{JOURNAL_SUFFIX}", "folder")
    folder = root / "no-schema-version"
    good_flows(folder)
    pq.write_table(
        journal_rows_to_table([record(6, "nv")]).drop_columns(["schema_version"]),
        folder / "records-0002.parquet",
    )
    cases["no-schema-version"] = (folder / "records-0002.parquet", "schema_version")
    return cases


def test_merge_skips_bad_record_files_with_one_line_each(tmp_path):
    for case, (bad, word) in bad_inputs(tmp_path / "in").items():
        folder = tmp_path / "in" / case
        result = polar("merge", str(folder), "-o", str(tmp_path / "out" / case), "--builder", "per_request")
        said = result.stdout + result.stderr
        assert "Traceback" not in said, f"{case}: {said}"
        assert result.returncode == 0, f"{case}: {said}"
        line = next((ln for ln in said.splitlines() if bad.name in ln), "")
        assert word in line.lower(), f"{case}: no line names {bad.name} with {word!r}: {said}"
        assert pq.read_table(tmp_path / "out" / case).num_rows >= 2, case


def test_merge_fails_in_one_line_when_nothing_usable_or_fatal(tmp_path):
    only_bad = tmp_path / "only-bad"
    only_bad.mkdir()
    (only_bad / "records-0001.parquet").write_bytes(b"PAR1 not really")
    flows = tmp_path / "flows"
    good_flows(flows)
    latin = tmp_path / "rewards.jsonl"
    latin.write_bytes(b'{"session_id": "good", "reward": 1, "note": "\xe9t\xe9"}\n')
    garbage = tmp_path / "rewards.parquet"
    garbage.write_bytes(b"\x00\x01garbage")
    a_file = tmp_path / "out-is-a-file"
    a_file.write_text("x")
    cases = {
        "nothing usable": ([str(only_bad)], "records-0001.parquet"),
        "non-UTF-8 rewards": ([str(flows), "--rewards", str(latin)], "rewards.jsonl"),
        "garbage rewards": ([str(flows), "--rewards", str(garbage)], "rewards.parquet"),
        "output is a file": ([str(flows), "-o", str(a_file)], "out-is-a-file"),
    }
    for case, (args, name) in cases.items():
        if "-o" not in args:
            args = [*args, "-o", str(tmp_path / "merged")]
        result = polar("merge", *args, "--builder", "per_request")
        said = result.stdout + result.stderr
        assert result.returncode == 1 and "Traceback" not in said, f"{case}: {said}"
        assert any(name in ln and "merge failed" in ln for ln in said.splitlines()), f"{case}: {said}"
