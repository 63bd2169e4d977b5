"""`polar-mitm dashboard` in a real headless Chromium (Debian's, scripts/setup-browser.sh; driven by Playwright, as
tests/report/test_browser.py does), over one short loop on the CPU demo tasks (-n 1 -g 2, the scripted policy,
one held-out task, a push after every optimizer step, flat groups kept so that it always trains) that runs while the page is open: its iteration appears
without a reload. Then every page of the finished run renders with no console error and nothing fetched from
elsewhere, a session row opens its calls and tokens, the Engines page marks the training's pushes and the loop's,
a prompt carrying `<script>` (planted in a task prompt, so it reaches every record) shows as text and never runs,
and the server keeps to loopback, GET and its token.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import expect

from tests.report.test_browser import CHROMIUM

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "cpu_tasks"
BIN = Path(sys.executable).parent
HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
HELD_OUT = "append-done"
LOOP_SECONDS = 240  # ~120 s alone; more on a machine shared with other work


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "POLAR_DASHBOARD_TOKEN"}
    return {**env, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def start_dashboard(run_dir: Path, port: int, log: Path, **env: str) -> subprocess.Popen:
    """`polar-mitm dashboard RUN_DIR --port PORT`, answering once it does."""
    process = subprocess.Popen(
        [str(BIN / "polar-mitm"), "dashboard", str(run_dir), "--port", str(port)],
        env=environment(**env),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            assert process.poll() is None, log.read_text()
            time.sleep(0.2)
    process.terminate()
    raise AssertionError(f"dashboard did not listen: {log.read_text()}")


def task_files(folder: Path) -> tuple[Path, Path]:
    """The demo's tasks as trained + held-out files, a hostile prompt planted in the first (the scripted policy
    matches the prompt's beginning, so it still plays its part)."""
    rows = [json.loads(line) for line in (EXAMPLES / "tasks.jsonl").read_text().splitlines() if line.strip()]
    for row in rows:
        row["workspace"]["dir"] = str((EXAMPLES / row["workspace"]["dir"]).resolve())
    rows[0]["prompt"] += " " + HOSTILE
    train, held_out = folder / "train.jsonl", folder / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows if r["task_id"] != HELD_OUT))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows if r["task_id"] == HELD_OUT))
    return train, held_out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dashboard") / "run"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def dashboard(run_dir, tmp_path_factory):
    """The dashboard's URL, served on the (still empty) run directory."""
    port = free_port()
    process = start_dashboard(run_dir, port, tmp_path_factory.mktemp("dashboard-log") / "dashboard.log")
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def browser(dashboard):
    """(a new page on the dashboard's origin, console errors, requests that tried to leave it)."""
    assert CHROMIUM, "no chromium on PATH: run scripts/setup-browser.sh (scripts/test.sh does)"
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    outside: list[str] = []
    with sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = launched.new_context(viewport={"width": 1280, "height": 900})

        def route(request_route):  # the dashboard's own origin (and data: URLs) only
            url = request_route.request.url
            if url.startswith((dashboard, "data:")):
                request_route.continue_()
            else:
                outside.append(url)
                request_route.abort()

        context.route("**/*", route)
        page = context.new_page()
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        yield page, errors, outside
        launched.close()


@pytest.fixture(scope="module")
def finished_run(run_dir, dashboard, browser, tmp_path_factory):
    """The loop, run while the Overview page is open: (the page's state before, and after, its iteration came)."""
    page, _, _ = browser
    page.goto(f"{dashboard}/#/overview")
    page.wait_for_selector("#iterations")
    page.evaluate("window.__sameDocument = true")
    before = page.locator("#iterations tbody tr").count()
    train, held_out = task_files(tmp_path_factory.mktemp("tasks"))
    log = run_dir.parent / "loop.log"
    loop = subprocess.run(
        [
            str(BIN / "polar-mitm"), "loop", str(train), "-o", str(run_dir), "-n", "1", "-g", "2", "-c", "2",
            "--model", "tiny", "--script", str(EXAMPLES / "policy.json"), "--max-tokens", "128",
            "--eval-tasks", str(held_out), "--eval-samples", "2", "--sandbox", "none",
            "--push-every-steps", "1", "--keep-zero-advantage-groups",  # it always trains, so it always pushes
        ],
        env=environment(),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        timeout=LOOP_SECONDS,
    )  # fmt: skip
    assert loop.returncode == 0, log.read_text()[-3000:]
    page.wait_for_selector("#iterations tbody tr", timeout=15_000)
    return {
        "before": before,
        "after": page.locator("#iterations tbody tr").count(),
        "same_document": page.evaluate("window.__sameDocument === true"),
        "loads": int(page.locator("#main").get_attribute("data-loads")),
    }


def test_a_new_iteration_appears_without_a_reload(finished_run):
    assert finished_run["before"] == 0 and finished_run["after"] == 1
    assert finished_run["same_document"]  # the page was never reloaded: the server's events re-rendered it
    assert finished_run["loads"] > 1


PAGES = {
    "overview": "#chart-reward svg",
    "sessions": "#sessions tbody tr",
    "discarded": "#discarded",
    "engines": "svg.timeline rect.call",
    "evaluation": "#evaluations tbody tr",
    "service": "#service-none",  # a loop run without --service: the page says so (a service's: test_run_layouts)
}


@pytest.mark.parametrize("name", list(PAGES))
def test_each_page_renders_offline_without_console_errors(finished_run, dashboard, browser, name):
    page, errors, outside = browser
    page.goto(f"{dashboard}/#/{name}")
    page.wait_for_selector(PAGES[name])
    assert errors == [] and outside == []


def test_overview_shows_the_iteration_and_its_held_out_pass_at_k(finished_run, dashboard, browser):
    page, _, _ = browser
    page.goto(f"{dashboard}/#/overview")
    row = page.locator("#iterations tbody tr").first
    row.wait_for()
    header = page.locator("#iterations thead").inner_text()
    assert "held-out pass@1" in header and "held-out pass@2" in header and "rollout s" in header
    assert page.locator("#chart-eval svg circle").count() >= 2


def test_a_session_row_opens_its_calls_and_tokens(finished_run, dashboard, browser):
    page, errors, _ = browser
    page.goto(f"{dashboard}/#/sessions?task_id=fix-typo")
    page.wait_for_selector("#sessions tbody tr")
    assert page.locator("#sessions tbody tr").count() == 2
    page.locator("#sessions tbody tr").first.click()
    page.wait_for_selector("details.call")
    assert page.url.split("#")[1].startswith("/session/fix-typo-")
    assert page.locator("details.call").count() >= 2
    first = page.locator("details.call").first
    assert "greeting.txt says" in first.locator("pre.request-sent").inner_text()
    assert '"role": "user"' in first.locator("pre.request-engine").inner_text()
    assert "Fixing it." in first.locator("pre.answer").inner_text()
    sampled = first.locator(".tokens .tk.m1")
    assert sampled.count() > 5 and first.locator(".tokens .tk.m0").count() > 50
    assert "logprob" in sampled.first.get_attribute("title")
    assert page.locator("#merged-0 .tk.m1").count() > 5  # the merged sequence it became
    assert errors == []


def test_sessions_page_sorts_and_pages_on_the_server(finished_run, dashboard, browser):
    page, _, _ = browser
    page.goto(f"{dashboard}/#/sessions?limit=2&sort=reward&desc=1")
    page.wait_for_selector("#sessions tbody tr")
    assert page.locator("#sessions tbody tr").count() == 2
    assert page.locator("#page-info").inner_text().startswith("1–2 of 6")
    page.locator("#next").click()
    expect(page.locator("#page-info")).to_have_text(re.compile("^3–4 of 6"))  # the page's CSP forbids eval
    status, body = get(f"{dashboard}/api/sessions?sort=reward&desc=1")
    rewards = [row["reward"] for row in json.loads(body)["rows"]]
    assert status == 200 and rewards == sorted(rewards, reverse=True)


def test_a_prompt_carrying_script_renders_as_text(finished_run, dashboard, browser):
    page, errors, _ = browser
    page.goto(f"{dashboard}/#/sessions")
    page.wait_for_selector("#sessions tbody tr")
    page.fill("#search", "<script>window.__pwned")
    page.press("#search", "Enter")
    expect(page.locator("#page-info")).to_have_text(re.compile("^1–2 of 2 "))
    page.locator("#sessions tbody tr").first.click()
    page.wait_for_selector("details.call pre.request-sent")
    assert HOSTILE.replace('"', '\\"') in page.locator("details.call pre.request-sent").first.inner_text()
    assert page.evaluate("window.__pwned") is None
    assert page.evaluate("document.scripts.length") == 1  # app.js only
    assert page.locator("main img").count() == 0
    assert errors == []


def test_discarded_lists_the_held_out_and_flat_sessions(finished_run, dashboard):
    status, body = get(f"{dashboard}/api/discarded")
    rows = json.loads(body)["rows"]
    assert status == 200
    assert {r["session_id"] for r in rows if r["reason"] == "held-out"} == {
        r["session_id"] for r in rows if r["task_id"] == HELD_OUT
    }
    assert len([r for r in rows if r["reason"] == "held-out"]) == 2
    assert {r["reason"] for r in rows} <= {"held-out", "flat group", "training skipped", "not merged"}


def test_engines_mark_the_pushes_of_each_training_step_and_of_the_iteration(
    finished_run, run_dir, dashboard, browser
):
    page, errors, _ = browser
    steps = [
        json.loads(line) for line in (run_dir / "iter-0" / "train" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [line for line in steps if "train_runtime" not in line]
    assert steps, "the loop's iteration trained no step: nothing was pushed"
    page.goto(f"{dashboard}/#/engines")
    page.wait_for_selector("svg.timeline rect.call")
    assert page.locator("svg.timeline line.push-step").count() == len(steps)
    assert page.locator("svg.timeline line.push-iteration").count() == 1
    found_by = page.locator("#pushes tbody tr").evaluate_all("rows => rows.map(r => r.dataset.source)")
    assert found_by.count("training step") == len(steps) and found_by.count("iteration end") == 1
    assert errors == []


def test_discarded_shows_the_staleness_masking_of_each_trained_iteration(finished_run, dashboard, browser):
    page, _, _ = browser
    page.goto(f"{dashboard}/#/discarded")
    page.wait_for_selector("#staleness tbody tr")
    assert page.locator("#staleness tbody tr").first.locator("td").first.inner_text() == "iter-0"
    assert "no --max-staleness" in page.locator("main").inner_text()


def test_an_unknown_session_is_404(finished_run, dashboard):
    assert get(f"{dashboard}/api/session/no-such-session")[0] == 404


def test_only_get_is_answered(finished_run, dashboard):
    request = urllib.request.Request(f"{dashboard}/api/overview", method="POST", data=b"{}")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405


def test_with_a_token_every_route_wants_it(finished_run, run_dir, tmp_path, browser):
    port = free_port()
    process = start_dashboard(run_dir, port, tmp_path / "dashboard.log", POLAR_DASHBOARD_TOKEN="s3cret")
    url = f"http://127.0.0.1:{port}"
    try:
        assert get(f"{url}/")[0] == 401
        assert get(f"{url}/api/sessions")[0] == 401
        assert get(f"{url}/api/stream", {"Authorization": "Bearer wrong"})[0] == 401
        assert get(f"{url}/api/overview", {"Authorization": "Bearer s3cret"})[0] == 200
        page, _, _ = browser
        page.context.route(f"{url}/**", lambda r: r.continue_())
        page.goto(f"{url}/?token=s3cret#/sessions")  # then the cookie carries it, the event stream included
        page.wait_for_selector("#sessions tbody tr")
        page.wait_for_selector("#live.on")
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_non_loopback_host_without_a_token_is_refused_in_one_line(run_dir):
    done = subprocess.run(
        [str(BIN / "polar-mitm"), "dashboard", str(run_dir), "--host", "0.0.0.0"],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "POLAR_DASHBOARD_TOKEN" in done.stderr
