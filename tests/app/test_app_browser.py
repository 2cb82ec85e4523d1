"""End to end in a real browser: headless Debian Chromium driven by Playwright clicks through
Configure -> Run -> Chat and saves screenshots (to a temporary directory; to refresh the README's
pictures run `LLM_FORGE_SCREENSHOTS=docs/screenshots .venv/bin/pytest tests/app/test_app_browser.py`).

Skips with the reason when /usr/bin/chromium (Debian package `chromium`) or the Python package
`playwright` is missing. `playwright install` is not needed: the system Chromium is used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from test_app_api import LABEL, AppServer, make_workspace

from app.runs import LOG
from training.run.rundir import CHECKPOINT_MARKER, RunDir

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)",
    ),
    # latency-bound (tests/conftest.py): beside another worker's tests 80-82 s against 64 s alone, and the suite no
    # shorter for it (a fresh-clone make test 9:40 without the lock, 9:29 with it, 2-core Xeon)
    pytest.mark.alone,
]
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


def browser_workspace(root: Path, model_dir: Path) -> Path:
    """The API tests' workspace, plus what a user brings: a comment in the recipe, a data file with a record
    the trainer would refuse, and a finished run made outside the app (as `make demo` leaves one) whose final/
    is a tiny saved model, to compare with and to export."""
    ws = make_workspace(root)
    recipe = ws / "recipes/tiny.yaml"
    recipe.write_text("# a tiny model from scratch, for the browser test\n" + recipe.read_text())
    (ws / "data/notes.jsonl").write_text('{"text": "Once upon a time"}\n{"body": "no text column"}\n')
    demo = RunDir(ws / "runs/demo")
    shutil.copytree(model_dir, demo.final)
    demo.config.write_text(
        recipe.read_text().replace("runs/tiny", "runs/demo").replace("lr: 0.003", "lr: 0.01")
    )
    demo.status.write_text(json.dumps({"state": "finished", "step": 20, "total_steps": 20}))
    rows = [
        {"step": s, "total_steps": 20, "loss": 10.0 - s * 0.2, "elapsed_s": 1.0 * s} for s in range(1, 21)
    ]
    demo.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ws


@pytest.fixture(scope="module")
def page(tmp_path_factory, smollm2_tiny_model_dir):
    srv = AppServer(browser_workspace(tmp_path_factory.mktemp("browser-ws"), smollm2_tiny_model_dir)).start()
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


# what gradio marks an event's outputs with when it raised gr.Error, until dismissed
ERROR_PILLS = """[...document.querySelectorAll('.error')]
  .filter(e => e.offsetParent !== null && !e.closest('.toast-body') && e.innerText.trim() === 'Error')
  .map(e => e.parentElement.innerText.slice(0, 60))"""


# the text laid over a chart's picture (a label over its top hid the first eval point and the top tick)
OVER_CHART = """sel => {
  const box = document.querySelector(sel), img = box.querySelector('img').getBoundingClientRect();
  return [...box.querySelectorAll('*')]
    .filter(e => e.offsetParent !== null && e.children.length === 0 && e.innerText && e.innerText.trim())
    .filter(e => { const r = e.getBoundingClientRect();
                   return r.bottom > img.top && r.top < img.bottom && r.right > img.left && r.left < img.right; })
    .map(e => e.innerText.trim().slice(0, 40));
}"""


# the buttons of a chat pane laid over its first message (its toolbar did: share, copy all)
OVER_FIRST_MESSAGE = """[...document.querySelectorAll('[role=log], .bubble-wrap')].flatMap(pane => {
  const first = pane.querySelector("[data-testid='user'], [data-testid='bot']");
  if (!first) return [];
  const m = first.getBoundingClientRect();
  return [...pane.parentElement.querySelectorAll('button')]
    .filter(b => b.offsetParent !== null && !first.contains(b) && !b.closest("[data-testid='bot'], [data-testid='user']"))
    .filter(b => { const r = b.getBoundingClientRect();
                   return r.bottom > m.top && r.top < m.bottom && r.right > m.left && r.left < m.right; })
    .map(b => b.getAttribute('aria-label') || b.title || b.innerText);
})"""


# the cells of a table narrower than their longest word (broken inside it: a header or a number a letter a line)
NARROW_CELLS = """sel => [...document.querySelectorAll(sel + ' td, ' + sel + ' th')].filter(cell => {
  const words = cell.innerText.split(/\\s+/).filter(Boolean);
  if (!words.length || cell.offsetParent === null) return false;
  const probe = document.createElement('span');
  probe.style.whiteSpace = 'nowrap';
  probe.textContent = words.reduce((a, b) => (a.length >= b.length ? a : b));
  cell.appendChild(probe);
  const word = probe.getBoundingClientRect().width;
  probe.remove();
  const pad = parseFloat(getComputedStyle(cell).paddingLeft) + parseFloat(getComputedStyle(cell).paddingRight);
  return cell.clientWidth - pad + 1 < word;
}).map(cell => cell.innerText.trim().slice(0, 30))"""


# every text the chat status shows from now on, in window.statusSeen (a message that stays a moment is missed by
# polling)
WATCH_STATUS = """() => {
  const status = document.querySelector('#chat-status');
  window.statusSeen = [];
  new MutationObserver(() => window.statusSeen.push(status.innerText))
    .observe(status, {subtree: true, childList: true, characterData: true});
}"""


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


def pick(pg, label: str, option: str) -> None:
    """Pick `option` in the dropdown labelled `label` as a user who types its name does: the pickers refresh their
    choices when opened, and a click on an option landed on another row when the refresh re-drew the list under it
    (a fresh-clone make test left the Export picker on 'tiny' for 30 s of clicks on 'demo'); typed, the list is
    filtered to it and Enter takes it. Tried again until the box shows it."""
    box = pg.get_by_label(label, exact=True).first
    deadline = time.time() + 30
    while box.input_value() != option and time.time() < deadline:
        box.click()
        box.fill(option)
        pg.get_by_role("option", name=option, exact=True).wait_for()
        box.press("Enter")
        time.sleep(0.5)
    assert box.input_value() == option


def open_tab(pg, name: str) -> None:
    """Open a tab and wait until it is the selected one (no fixed pause)."""
    tab = pg.get_by_role("tab", name=name, exact=True)
    tab.click()
    sync_api.expect(tab).to_have_attribute("aria-selected", "true")


def check_radio(pg, label: str) -> None:
    """Choose the radio button `label`; again while an update the YAML's last change set going (the Objective
    follows the YAML) puts the old choice back as it is clicked."""
    box = pg.get_by_label(label, exact=True)
    deadline = time.time() + 30
    while not box.is_checked() and time.time() < deadline:
        box.click()
        time.sleep(0.3)
    assert box.is_checked()


def type_into(locator, text: str) -> None:
    """Type like a user, but in one keystroke: the text but its last character is filled in, the last one
    typed (a key event fires the form's input event, fill() does not; one event per character would only make
    the test slower)."""
    locator.click()
    try:
        locator.fill(text[:-1])
    except sync_api.Error:  # a number box takes no partial text such as "-": type it all
        locator.press("Control+A")
        locator.press_sequentially(text[:-1])
    if text:
        locator.press_sequentially(text[-1])
    else:
        locator.press("Backspace")
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


def over_chart(pg, selector: str, timeout: float = 10) -> list[str]:
    """The texts lying over the chart once it has settled: Gradio's own "processing | 0.7s" timer passes over a
    plot while its refresh is in flight (seen once in a full-suite run), and goes; a label of ours stays."""
    deadline = time.time() + timeout
    while (found := pg.evaluate(OVER_CHART, selector)) and time.time() < deadline:
        time.sleep(0.25)
    return found


def test_configure_run_chat_in_chromium(page):
    pg = page
    t0 = time.time()
    lap = lambda what: print(f"{time.time() - t0:6.1f}s {what}", flush=True)  # noqa: E731
    SHOTS.mkdir(parents=True, exist_ok=True)

    # ---- Configure: the workspace's recipe is loaded into the form; editing a field rewrites the YAML
    pg.get_by_role("button", name="Load", exact=True).click()
    wait_text(
        pg, pg.locator("#recipe-file-status"), r"loaded recipes/tiny\.yaml"
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
        if method == "lora":  # a LoRA setting of its own, which full fine-tuning takes away again
            type_into(field(pg, "method.lora.r"), "8")
            wait_text(pg, pg.locator(".cm-content").first, r"\n    r: 8(\n|$)")
    wait_text(pg, pg.locator(".cm-content").first, r"^(?![\s\S]*(lora|quantization):)")
    lap("methods switched")
    # the objective: online RL shows its settings and writes its section; supervised takes it away again
    check_radio(pg, "online RL")
    pg.get_by_text(LABEL["rl.num_generations"], exact=True).wait_for(state="visible", timeout=15_000)
    wait_text(pg, pg.locator(".cm-content").first, r"(?m)^rl:")
    check_radio(pg, "supervised")
    pg.get_by_text(LABEL["rl.num_generations"], exact=True).wait_for(state="hidden", timeout=15_000)
    assert not re.search(r"(?m)^rl:", yaml_text(pg))
    # a path outside the workspace, then a record the trainer would refuse: the field says so before Start
    pg.get_by_role("tab", name="Data").click()
    train = field(pg, "data.train")
    type_into(train, "/etc/passwd")
    wait_text(pg, field_label(pg, "data.train"), r"outside the workspace")
    assert "data.train**: data.train:" not in pg.locator("#validation").inner_html()  # the key said once
    type_into(train, "data/notes.jsonl")
    wait_text(pg, field_label(pg, "data.train"), r"notes\.jsonl line 2: ", timeout=60)  # the data check
    type_into(train, "data/tiny_stories.txt")
    wait_text(pg, pg.locator("#validation"), r"recipe is valid")
    assert re.search(r"(?m)^  train: data/tiny_stories\.txt$", yaml_text(pg))  # one path stays a scalar
    lap("data fields checked")
    # find a setting by words: only the match shows, in its tab, its "More settings" fold opened
    find = pg.get_by_label("Find a setting", exact=True)
    type_into(find, "grad norm")
    wait_text(pg, pg.locator("#find-result"), r"1 setting\(s\) match: train\.max_grad_norm \(Optimisation\)")
    pg.get_by_text(LABEL["train.max_grad_norm"], exact=True).wait_for(state="visible", timeout=15_000)
    assert not pg.get_by_text(LABEL["train.lr"], exact=True).is_visible()
    find.press("Control+A")
    find.press("Backspace")  # an empty search: the form as before
    pg.get_by_text(LABEL["train.lr"], exact=True).wait_for(state="visible", timeout=15_000)
    lap("searched")
    pg.get_by_role("tab", name="Optimisation").click()
    steps = field(pg, "train.max_steps")
    type_into(steps, "100000")
    wait_text(pg, pg.locator(".cm-content").first, r"max_steps: 100000")
    assert yaml_text(pg).startswith("# a tiny model from scratch")  # the user's comment survives the edit
    # a cleared field is sent at once (gradio's textbox tells a keypress only), and its key leaves the YAML
    epochs = field(pg, "train.epochs")
    type_into(epochs, "1")
    wait_text(pg, pg.locator("#validation"), r"set either train\.max_steps or train\.epochs, not both")
    epochs.click()
    epochs.press("Control+A")
    epochs.press("Backspace")  # no blur, no other edit after it
    wait_text(pg, pg.locator("#validation"), r"recipe is valid")
    assert "epochs" not in yaml_text(pg)
    # a bad value: the error shows next to the field and in the status, the YAML still follows the form
    lr = field(pg, "train.lr")
    type_into(lr, "-1")
    wait_text(pg, field_label(pg, "train.lr"), r"greater than 0")
    assert "train.lr" in wait_text(pg, pg.get_by_text("problem(s)").first.locator(".."), r"train\.lr")
    # Save refuses it in the file status and a toast, plain text (no `**`), and marks nothing with an error pill
    type_into(pg.get_by_label("Save as (recipes/NAME.yaml)", exact=True), "bad")
    pg.get_by_role("button", name="Save", exact=True).click()
    status = pg.locator("#recipe-file-status")
    wait_text(pg, status, r"✘ not saved: the recipe has problems: train\.lr: Input should be greater than 0")
    toast = pg.locator(".toast-body").first
    assert re.search(r"not saved: the recipe has problems: train\.lr: ", toast.inner_text())
    assert "**" not in toast.inner_text() and pg.evaluate(ERROR_PILLS) == []
    pg.evaluate("window.scrollTo(0, 0)")
    pg.screenshot(path=str(SHOTS / "configure-error.png"))
    type_into(lr, "0.003")
    wait_text(pg, pg.locator("#validation"), r"recipe is valid")
    assert "lr: 0.003" in yaml_text(pg)
    # the field's own error goes with the next update of the fields, which follows the status (app/configure_tab.py)
    wait_text(pg, field_label(pg, "train.lr"), r"^(?![\s\S]*greater than 0)")
    command = pg.locator(".cm-content").nth(1)
    assert "-m training.train runs/tiny/recipe.yaml" in wait_text(pg, command, r"training\.train")
    pg.evaluate("window.scrollTo(0, 0)")
    pg.screenshot(path=str(SHOTS / "configure.png"))
    lap("fields edited")
    # the memory plan's table gets the page's width (it was squeezed into the YAML column, a letter a line)
    pg.get_by_text("Memory plan", exact=True).first.click()
    pg.get_by_role("button", name="Estimate memory").click()
    plan = pg.locator("#memory-plan")
    wait_text(pg, plan, r"Recommended", timeout=120)
    width = pg.evaluate("document.documentElement.clientWidth")
    assert plan.bounding_box()["width"] > 0.8 * width
    print("page height with the plan open:", pg.evaluate("document.body.scrollHeight"), flush=True)
    assert pg.evaluate("document.body.scrollHeight") < 8000
    lap("planned")
    # the data preview: the records as the trainer tokenizes them, the loss tokens highlighted
    pg.get_by_text("Data preview", exact=True).first.click()
    pg.get_by_role("button", name="Preview the training data").click()
    pg.locator("#data-preview mark").first.wait_for(timeout=120_000)
    wait_text(pg, pg.locator("#data-summary"), r"max_length=32")
    # a preview of other data settings goes when they change
    pg.get_by_role("tab", name="Data").click()
    max_length = field(pg, "data.max_length")
    type_into(max_length, "33")
    wait_text(pg, pg.locator("#data-summary"), r"settings changed: preview them again")
    assert pg.locator("#data-preview mark").count() == 0
    type_into(max_length, "32")
    wait_text(pg, pg.locator(".cm-content").first, r"max_length: 32\n")

    lap("previewed")
    # a laptop's screen: every Configure tab stays bounded and no text is squeezed to a letter a line
    pg.set_viewport_size({"width": 1280, "height": 800})
    for tab in ("Model", "Data", "Method", "Optimisation", "Precision & memory", "Eval & checkpoints"):
        open_tab(pg, tab)
        assert pg.evaluate("document.body.scrollHeight") < 8000, tab
        squeezed = pg.evaluate(SQUEEZED)
        assert squeezed == [], f"{tab}: text squeezed into a narrow column: {squeezed[:3]}"
    narrow = pg.evaluate(NARROW_CELLS, "#memory-plan")  # the plan's table: every cell as wide as its words
    assert pg.locator("#memory-plan td").count() > 10 and narrow == [], (
        f"memory plan cells broken: {narrow[:5]}"
    )
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
    # a few more points on the curve (app/charts.py draws it; its lines are unit-tested)
    wait_text(pg, progress, r"step (1[4-9]|[2-9]\d|\d{3,}) /", timeout=240)
    pg.locator("#run-chart img").first.wait_for(timeout=30_000)
    assert over_chart(pg, "#run-chart") == []
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
    # ---- Compare the stopped run with the demo run on one chart, and see which recipe keys differ
    pg.get_by_text("Compare runs", exact=True).first.click()
    for name in ("tiny", "demo"):
        pg.get_by_label("Runs to compare").click()
        pg.get_by_role("option", name=name, exact=True).click()
    pg.locator("#compare-plot img").first.wait_for(timeout=30_000)
    compared = wait_text(pg, pg.locator("#compare-table"), r"demo[\s\S]*finished")
    assert over_chart(pg, "#compare-plot") == []
    assert not re.search(r"\d\.\d{5}", compared)  # losses rounded (the tiny run's showed 17 digits)
    assert "train.lr" in compared and "tiny" in compared and "stopped" in compared
    pg.screenshot(path=str(SHOTS / "compare.png"), full_page=True)
    lap("compared")

    # ---- Export the demo run to GGUF (a background job), then chat with the GGUF file
    pg.get_by_role("tab", name="Export & evaluate").click()
    pick(pg, "Run (runs/...)", "demo")
    estimate = wait_text(pg, pg.locator("#export-estimate"), r"GGUF \(f16\): about [\d.,]+ MB")
    assert pg.get_by_label("Limit (examples per task)", exact=True).input_value() == ""  # empty: all (not 0)
    pg.get_by_role("button", name="GGUF (llama.cpp / Ollama)").click()
    job = wait_text(pg, pg.locator("#job-status"), r"gguf .* (done|failed) \(exit code", timeout=240)
    assert "done (exit code 0" in job, job
    gguf = RunDir(pg.server.workspace / "runs/demo").gguf
    assert gguf.is_file()
    # after the job: the file's actual size, which the estimate before it came within 10% of
    wait_text(
        pg,
        pg.locator("#job-status"),
        rf"wrote runs/demo/gguf/model\.gguf, {gguf.stat().st_size / 1e6:,.1f} MB",
    )
    said = float(re.search(r"about ([\d.,]+) MB", estimate).group(1).replace(",", ""))
    print(f"GGUF f16 estimated {said} MB, written {gguf.stat().st_size / 1e6:.1f} MB", flush=True)
    assert abs(said * 1e6 - gguf.stat().st_size) < 0.1 * gguf.stat().st_size
    lap("exported")

    # ---- Chat: the GGUF export in A, the bundled SmolLM2 in B, one message to both
    pg.get_by_role("tab", name="Chat").click()
    picture = pg.get_by_text("Picture (image-text models", exact=False)
    assert not picture.is_visible()  # no image-text model loaded: no picture offered
    for label, choice, button in (
        ("Model A", str(gguf.relative_to(pg.server.workspace)), "Load A"),
        ("Model B (optional: compare side by side)", "bundled:smollm2-135m-instruct", "Load B"),
    ):
        pg.get_by_label(label).click()
        pg.get_by_role("option", name=choice, exact=True).click()
        pg.evaluate(WATCH_STATUS)  # every text the status shows, however briefly
        pg.get_by_role("button", name=button, exact=True).click()
        wait_text(
            pg,
            pg.locator("#chat-status"),
            rf"slot {button[-1]}: loaded \*?\*?{re.escape(choice)}",
            timeout=180,
        )
        if choice.endswith(".gguf"):  # said at once, before: dequantizing a GGUF file takes a while
            said = pg.evaluate("window.statusSeen")
            assert any(re.search(r"slot A: loading .*model\.gguf \(a GGUF file", t) for t in said), said
    type_into(pg.get_by_label("System prompt", exact=True), "You are a concise assistant.")
    pg.get_by_label("Message", exact=True).fill("What is the capital of France?")
    lap("models loaded")
    pg.get_by_role("button", name="Send").click()
    bots = pg.locator("[data-testid='bot']")
    deadline = time.time() + 180
    while time.time() < deadline and not (bots.count() >= 2 and "Paris" in bots.last.inner_text()):
        time.sleep(0.5)
    assert bots.count() >= 2  # A answered too (an untrained tiny model: its reply is blank lines)
    assert "Paris" in bots.last.inner_text()  # B, the real SmolLM2-135M-Instruct, answers greedily with Paris
    assert not picture.is_visible() and pg.evaluate(OVER_FIRST_MESSAGE) == []
    pg.screenshot(path=str(SHOTS / "chat.png"), full_page=True)
    lap("chat answered")
    pg.get_by_role("button", name="Unload all").click()
    wait_text(pg, pg.locator("#chat-status"), r"A: \(empty\) · B: \(empty\)")

    # a laptop's screen: the Run, Export and Chat tabs (with what they now show) stay bounded, nothing squeezed
    pg.set_viewport_size({"width": 1280, "height": 800})
    for tab in ("Run", "Export & evaluate", "Chat"):
        open_tab(pg, tab)
        assert pg.evaluate("document.body.scrollHeight") < 8000, tab
        squeezed = pg.evaluate(SQUEEZED)
        assert squeezed == [], f"{tab}: text squeezed into a narrow column: {squeezed[:3]}"
