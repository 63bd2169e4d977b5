"""The report in a real headless Chromium (Debian's package, scripts/setup-browser.sh; driven by Playwright): the
page loads offline with no console error, the curves and the token viewer render, hover and colour modes work, and
each session's token box opens on its first sampled turn (the real harnesses' recorded sessions in sample_flows/,
whose system prompts fill many screens, and the demo's)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from polar_mitm.reconstruct.merge import merge
from polar_mitm.report import write_report
from tests.loop.evaluated_loop import evaluated_loop_run

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HARNESS_RECORDS = Path(__file__).resolve().parents[2] / "sample_flows" / "harness"
# Per token box: where its first sampled token lies in the box's visible area (px from its inner top edge).
FIRST_SAMPLED = """() => Array.from(document.querySelectorAll("#viewer .traj .tokens")).map(box => {
  const first = box.querySelector(".tk.m1");
  const inner = box.getBoundingClientRect().top + box.clientTop;
  const rect = first ? first.getBoundingClientRect() : null;
  return {session: box.closest(".traj").dataset.session, sampled: first !== null,
          top: rect && rect.top - inner, bottom: rect && rect.bottom - inner,
          visible: box.clientHeight, scrolled: box.scrollTop};
})"""


@pytest.fixture(scope="module")
def browser_context():
    """(a new page of an offline browser context, console errors, requests that tried to leave the file)."""
    assert CHROMIUM, "no chromium on PATH: run scripts/setup-browser.sh (scripts/test.sh does)"
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    outside: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(offline=True, viewport={"width": 1280, "height": 900})

        def route(request_route):  # only the file itself (and data: URLs) may load
            url = request_route.request.url
            if url.startswith(("file:", "data:")):
                request_route.continue_()
            else:
                outside.append(url)
                request_route.abort()

        context.route("**/*", route)

        def new_page():
            page = context.new_page()
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            return page

        yield new_page, errors, outside
        browser.close()


@pytest.fixture(scope="module")
def demo_report(demo_run, tmp_path_factory) -> Path:
    run_dir, _ = demo_run
    return write_report(run_dir, tmp_path_factory.mktemp("report") / "report.html")


@pytest.fixture(scope="module")
def page_session(browser_context, demo_report):
    """(page, console errors, requests that tried to leave the file) for the demo run's report."""
    new_page, errors, outside = browser_context
    page = new_page()
    page.goto(demo_report.as_uri(), wait_until="load")
    return page, errors, outside


@pytest.fixture(scope="module")
def harness_report(tmp_path_factory, tiny_model_dir) -> Path:
    """The report of the real harness CLIs' recorded sessions (sample_flows/harness), merged: 13 sessions whose
    first prompts run to 500–17,000 tokens (decoded with the tiny model's tokenizer, which recorded them)."""
    root = tmp_path_factory.mktemp("harness-report")
    merge([str(HARNESS_RECORDS)], str(root / "merged"))
    return write_report(root / "merged", root / "report.html", tokenizer=str(tiny_model_dir), sessions=13)


def non_blank_fraction(png: bytes) -> float:
    """Share of pixels that are not (near) white."""
    from PIL import Image

    histogram = Image.open(io.BytesIO(png)).convert("L").histogram()  # pixels per grey level 0-255
    return sum(histogram[:240]) / sum(histogram)


def test_page_loads_offline_without_console_errors(page_session):
    page, errors, outside = page_session
    assert page.title().startswith("polar-mitm report")
    assert errors == [] and outside == []


def test_curves_render(page_session):
    page, _, _ = page_session
    for name in ("reward", "loss", "clip", "staleness"):
        chart = page.locator(f"#chart-{name} svg")
        assert chart.count() == 1
        box = chart.bounding_box()
        assert box is not None and box["width"] > 300 and box["height"] > 150
        assert page.locator(f"#chart-{name} svg path").count() > 5
        assert non_blank_fraction(chart.screenshot()) > 0.02, name


def test_token_viewer_renders_and_hover_shows_id_and_logprob(page_session):
    page, errors, _ = page_session
    tokens = page.locator("#viewer .tk")
    assert tokens.count() > 500 and page.locator("#viewer .turn").count() >= 12
    sampled = page.locator("#viewer .tk.m1").first
    sampled.scroll_into_view_if_needed()
    sampled.hover()
    tip = page.locator("#tip")
    assert tip.is_visible()
    text = tip.inner_text()
    assert f"token id {sampled.get_attribute('data-id')}" in text and "logprob -" in text
    mask_colour = sampled.evaluate("el => getComputedStyle(el).backgroundColor")
    page.get_by_role("button", name="logprob").click()
    assert page.locator("#viewer").get_attribute("class") == "mode-logprob"
    assert sampled.evaluate("el => getComputedStyle(el).backgroundColor") != mask_colour
    assert non_blank_fraction(page.locator("#viewer .traj").first.screenshot()) > 0.05
    assert errors == []


def first_sampled_positions(new_page, report: Path) -> list[dict]:
    """A freshly opened page's token boxes: where each one's first sampled token is, as the page opened."""
    page = new_page()
    page.goto(report.as_uri(), wait_until="load")
    boxes = page.evaluate(FIRST_SAMPLED)
    page.close()
    return boxes


def test_each_token_box_opens_on_its_first_sampled_turn(browser_context, harness_report, demo_report):
    new_page, errors, outside = browser_context
    harness = first_sampled_positions(new_page, harness_report)
    demo = first_sampled_positions(new_page, demo_report)
    assert len(harness) == 13 and len(demo) == 6
    for box in harness + demo:
        assert box["sampled"], box
        assert 0 <= box["top"] and box["bottom"] <= box["visible"], box  # in view, no scrolling needed
    # The harnesses' system prompts: opened at its top, no box would show its first sampled token (it lies more
    # than a box's height down).
    assert all(box["top"] + box["scrolled"] > box["visible"] for box in harness), harness
    assert errors == [] and outside == []


def test_full_page_screenshot_is_not_blank(page_session, tmp_path):
    page, _, _ = page_session
    png = page.screenshot(full_page=True, path=str(tmp_path / "report.png"))
    assert non_blank_fraction(png) > 0.02  # a blank page is 0; this one is mostly text on white (~5%)


def test_live_report_of_an_evaluated_loop_draws_the_held_out_curve(browser_context, tmp_path_factory):
    """The page the loop itself left in RUN/report.html (rewritten after each iteration) for the shared evaluated
    loop: the held-out pass@1 curve is drawn beside the training reward, and each iteration row shows it."""
    new_page, errors, outside = browser_context
    run_dir = evaluated_loop_run(tmp_path_factory)
    iterations = json.loads((run_dir / "loop.json").read_text())
    page = new_page()
    page.goto((run_dir / "report.html").as_uri(), wait_until="load")
    chart = page.locator("#chart-reward svg")
    assert chart.count() == 1 and "held-out pass@1" in page.locator("#chart-reward figcaption").inner_text()
    legend = chart.locator("text", has_text="held-out pass@1")
    assert legend.count() == 1 and legend.is_visible()
    assert non_blank_fraction(chart.screenshot()) > 0.02
    cells = page.locator("#iterations td.held-out")
    assert cells.count() == len(iterations)
    for cell, it in zip(cells.all(), iterations, strict=True):
        assert f"pass@1 {it['eval']['pass_at']['pass@1']:.2f}" in cell.inner_text()
    assert errors == [] and outside == []
