"""End to end in a real browser: headless Debian Chromium driven by Playwright clicks through
Configure -> Run -> Chat and saves screenshots (to a temporary directory; to refresh the README's
pictures run `LLM_FORGE_SCREENSHOTS=docs/screenshots .venv/bin/pytest tests/app/test_app_browser.py`).

Skips with the reason when /usr/bin/chromium (Debian package `chromium`) or the Python package
`playwright` is missing. `playwright install` is not needed: the system Chromium is used.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

import pytest
from test_app_api import LABEL, AppServer, make_workspace

from app.runs import LOG
from training.run.rundir import CHECKPOINT_MARKER, RunDir

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)"
)
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="needs the Python package playwright (pip install playwright)"
)

SHOTS = Path(os.environ.get("LLM_FORGE_SCREENSHOTS", tempfile.mkdtemp(prefix="llm-forge-shots-")))
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    srv = AppServer(make_workspace(tmp_path_factory.mktemp("browser-ws"))).start()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        pg.set_default_timeout(60_000)
        pg.goto(srv.url, wait_until="load")
        pg.get_by_text("Recipe YAML (editable)").first.wait_for()
        pg.server = srv
        yield pg
        browser.close()
    srv.stop()
    srv.stop_training()


# visible text of 12+ characters laid out in a box narrower than 40 px: one letter (or two) a line
SQUEEZED = """[...document.querySelectorAll('p, span, label, td, th')]
  .filter(e => e.offsetParent !== null && e.children.length === 0 && e.innerText.trim().length >= 12
               && e.getBoundingClientRect().width > 0 && e.getBoundingClientRect().width < 40)
  .map(e => e.innerText.trim().slice(0, 40))"""


def field_label(pg, key: str):
    """The label element of a recipe key's form field (words and the key; it also holds the help text)."""
    return pg.locator("label", has=pg.get_by_text(LABEL[key], exact=True))


def field(pg, key: str):
    """The input of a recipe key's form field."""
    return field_label(pg, key).locator("input, textarea").first


def choose(pg, key: str, value: str) -> None:
    """Pick `value` in a recipe key's dropdown, as a user does."""
    box = pg.get_by_label(LABEL[key], exact=True).first  # a dropdown's input carries its label
    box.click()
    pg.get_by_role("option", name=value, exact=True).click()


def type_into(locator, text: str) -> None:
    """Type like a user (key events fire the form's input event; Playwright's fill() does not here)."""
    locator.click()
    locator.press("Control+A")
    locator.press_sequentially(text, delay=20)
    locator.blur()


def yaml_text(pg) -> str:
    return pg.locator(".cm-content").first.inner_text()


def wait_text(pg, locator, pattern: str, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    text = ""
    while time.time() < deadline:
        is_input = locator.evaluate("e => e.tagName === 'TEXTAREA' || e.tagName === 'INPUT'")
        text = locator.input_value() if is_input else locator.inner_text()
        if re.search(pattern, text):
            return text
        time.sleep(0.5)
    raise AssertionError(f"{pattern!r} did not appear within {timeout}s; last text: {text[-500:]!r}")


def test_configure_run_chat_in_chromium(page):
    pg = page
    t0 = time.time()
    lap = lambda what: print(f"{time.time() - t0:6.1f}s {what}", flush=True)  # noqa: E731
    SHOTS.mkdir(parents=True, exist_ok=True)

    # ---- Configure: the workspace's recipe is loaded into the form; editing a field rewrites the YAML
    pg.get_by_role("button", name="Load", exact=True).click()
    wait_text(
        pg, pg.locator("body"), r"loaded recipes/tiny\.yaml"
    )  # the YAML and the form are filled in one update
    # the Method tab holds what applies: this recipe trains a new model in full, so no LoRA, 4-bit or RL fields
    pg.get_by_role("tab", name="Method").click()
    pg.get_by_text(LABEL["method.type"], exact=True).wait_for(state="visible")
    assert not pg.get_by_text(LABEL["method.lora.r"], exact=True).is_visible()
    print("page height on the Method tab:", pg.evaluate("document.body.scrollHeight"), flush=True)
    assert pg.evaluate("document.body.scrollHeight") < 3000  # 5,348 px for the Method tab alone before
    # the sections follow the method: LoRA shows its settings, QLoRA its 4-bit ones too, full neither
    for method, shown, hidden in (
        ("lora", ["method.lora.r"], ["method.quantization.bits"]),
        ("qlora", ["method.lora.r", "method.quantization.bits"], []),
        ("full", [], ["method.lora.r", "method.quantization.bits"]),
    ):
        choose(pg, "method.type", method)
        for key in shown:
            pg.get_by_text(LABEL[key], exact=True).wait_for(state="visible", timeout=15_000)
        for key in hidden:
            pg.get_by_text(LABEL[key], exact=True).wait_for(state="hidden", timeout=15_000)
    # a path outside the workspace: the field says so before Start
    pg.get_by_role("tab", name="Data").click()
    train = field(pg, "data.train")
    type_into(train, "/etc/passwd")
    wait_text(pg, field_label(pg, "data.train"), r"outside the workspace")
    type_into(train, "data/tiny_stories.txt")
    wait_text(pg, pg.locator("body"), r"recipe is valid")
    pg.get_by_role("tab", name="Optimisation").click()
    steps = field(pg, "train.max_steps")
    type_into(steps, "100000")
    wait_text(pg, pg.locator(".cm-content").first, r"max_steps: 100000")
    # a bad value: the error shows next to the field and in the status, the YAML still follows the form
    lr = field(pg, "train.lr")
    type_into(lr, "-1")
    wait_text(pg, field_label(pg, "train.lr"), r"greater than 0")
    assert "train.lr" in wait_text(pg, pg.get_by_text("problem(s)").first.locator(".."), r"train\.lr")
    pg.evaluate("window.scrollTo(0, 0)")
    pg.screenshot(path=str(SHOTS / "configure-error.png"))
    type_into(lr, "0.003")
    wait_text(pg, pg.locator("body"), r"recipe is valid")
    assert "lr: 0.003" in yaml_text(pg)
    assert "greater than 0" not in field_label(pg, "train.lr").inner_text()
    command = pg.locator(".cm-content").nth(1)
    assert "-m training.train runs/tiny/recipe.yaml" in wait_text(pg, command, r"training\.train")
    pg.evaluate("window.scrollTo(0, 0)")
    pg.screenshot(path=str(SHOTS / "configure.png"))
    # the memory plan's table gets the page's width (it was squeezed into the YAML column, a letter a line)
    pg.get_by_text("Memory plan", exact=True).first.click()
    pg.get_by_role("button", name="Estimate memory").click()
    plan = pg.locator("#memory-plan")
    wait_text(pg, plan, r"Recommended", timeout=120)
    width = pg.evaluate("document.documentElement.clientWidth")
    assert plan.bounding_box()["width"] > 0.8 * width
    print("page height with the plan open:", pg.evaluate("document.body.scrollHeight"), flush=True)
    assert pg.evaluate("document.body.scrollHeight") < 8000

    # a laptop's screen: every Configure tab stays bounded and no text is squeezed to a letter a line
    pg.set_viewport_size({"width": 1280, "height": 800})
    for tab in ("Model", "Data", "Method", "Optimisation", "Precision & memory", "Eval & checkpoints"):
        pg.get_by_role("tab", name=tab, exact=True).click()
        time.sleep(0.3)
        assert pg.evaluate("document.body.scrollHeight") < 8000, tab
        squeezed = pg.evaluate(SQUEEZED)
        assert squeezed == [], f"{tab}: text squeezed into a narrow column: {squeezed[:3]}"
    pg.set_viewport_size({"width": 1400, "height": 1000})

    lap("configure done")
    # ---- Run: start, watch progress and the loss curve, stop (the trainer saves a checkpoint)
    pg.get_by_role("tab", name="Run").click()
    pg.get_by_role("button", name="Start run (recipe from Configure)").click()
    progress = pg.locator("#progress")
    wait_text(pg, progress, r"running · step [1-9]", timeout=240)
    wait_text(
        pg, progress, r"step (1[1-9]|[2-9]\d|\d{3,}) /.*eval loss", timeout=240
    )  # two eval rows (every 5 steps)
    wait_text(pg, pg.get_by_label(f"Log ({LOG}, last lines)"), r"train:")
    time.sleep(3)  # a few more points on the curve
    lines = pg.locator(".vega-embed [aria-roledescription='line mark']")
    deadline = time.time() + 30
    while lines.count() < 2 and time.time() < deadline:  # the curve has a train and an eval line
        time.sleep(0.2)
    assert lines.count() >= 2
    pg.screenshot(path=str(SHOTS / "run.png"), full_page=True)
    stop = pg.get_by_role("button", name="Stop (saves a checkpoint)")
    assert stop.is_enabled()
    stop.click()
    text = wait_text(pg, progress, r"stopped at step \d+", timeout=120)
    deadline = time.time() + 10  # the next refresh takes Stop away from a run that has stopped
    while stop.is_enabled() and time.time() < deadline:
        time.sleep(0.2)
    assert not stop.is_enabled()
    step = int(re.search(r"stopped at step (\d+)", text).group(1))
    ckpt = RunDir(pg.server.workspace / "runs/tiny").checkpoint(step)
    assert (ckpt / CHECKPOINT_MARKER).is_file()

    lap("run stopped")
    # ---- Chat: the stopped run's checkpoint in A, the bundled SmolLM2 in B, one message to both
    pg.get_by_role("tab", name="Chat").click()
    for label, choice, button in (
        ("Model A", str(ckpt.relative_to(pg.server.workspace)), "Load A"),
        ("Model B (optional: compare side by side)", "bundled:smollm2-135m-instruct", "Load B"),
    ):
        pg.get_by_label(label).click()
        pg.get_by_role("option", name=choice, exact=True).click()
        pg.get_by_role("button", name=button, exact=True).click()
        wait_text(
            pg, pg.locator("body"), rf"slot {button[-1]}: loaded \*?\*?{re.escape(choice)}", timeout=180
        )
    type_into(pg.get_by_label("System prompt", exact=True), "You are a concise assistant.")
    pg.get_by_label("Message", exact=True).fill("What is the capital of France?")
    lap("models loaded")
    pg.get_by_role("button", name="Send").click()
    bots = pg.locator("[data-testid='bot']")
    deadline = time.time() + 180
    while time.time() < deadline and not (bots.count() >= 2 and "Paris" in bots.last.inner_text()):
        time.sleep(0.5)
    assert bots.count() >= 2 and bots.first.inner_text().strip()  # A (the tiny run) answered something
    assert "Paris" in bots.last.inner_text()  # B, the real SmolLM2-135M-Instruct, answers greedily with Paris
    time.sleep(1)
    pg.screenshot(path=str(SHOTS / "chat.png"), full_page=True)
    lap("chat answered")
    pg.get_by_role("button", name="Unload all").click()
    wait_text(pg, pg.locator("body"), r"A: \(empty\) · B: \(empty\)")
