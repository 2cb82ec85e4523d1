"""App latency: how long an edit on the Configure tab takes to show, in a real browser.

Starts `python -m app` on a small workspace, drives headless Debian Chromium with Playwright (as
tests/app/test_app_browser.py does) and, per kind of edit (a number field, a text field, an optional number
typed in a text box, a dropdown, a checkbox, a field cleared, a line typed in the YAML box), prints the
milliseconds from the edit's last key press or click to the YAML box showing the change and to the validation
status showing its verdict: the median (and the slowest) of several tries. Each try turns the recipe valid or
invalid, in turn, so that the validation status changes every time. The page is measured in the page itself
(performance.now(), checked every animation frame), so Playwright's own round trips are not counted.

    python -m benchmarks.app_latency [--tries 7]

Needs /usr/bin/chromium (apt-get install chromium) and the Python package playwright.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.common import ROOT, TOKENIZER, machine, save_result, table, tempdir, write_recipe
from training.config import Recipe  # noqa: F401  (the schema the form is made from: fail early without it)

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
RECIPE = {
    "output_dir": "runs/tiny",
    "seed": 0,
    "model": {
        "tokenizer": TOKENIZER,
        "from_scratch": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
    },
    "data": {"train": "data/tiny_stories.txt", "format": "text", "max_length": 32, "max_examples": 200},
    "train": {"lr": 3e-3, "batch_size": 4, "max_steps": 20, "warmup_steps": 0},
}
VALID = r"recipe is valid"

# The measurement, in the page: the clock starts at the first key press or click after arm(); each frame the
# YAML box and the validation status are read until both show what the edit should make them show.
ARM = """([yamlRe, validRe]) => {
  const st = {t0: null, yaml: yamlRe === null ? 0 : null, valid: null};
  window.latency = st;
  const start = () => { if (st.t0 === null) st.t0 = performance.now(); };
  document.addEventListener('keydown', start, {capture: true, once: true});
  document.addEventListener('pointerdown', start, {capture: true, once: true});
  const yre = yamlRe === null ? null : new RegExp(yamlRe), vre = new RegExp(validRe);
  const tick = () => {
    if (st.t0 !== null) {
      const ms = performance.now() - st.t0;
      if (st.yaml === null && yre.test(document.querySelector('.cm-content').innerText)) st.yaml = ms;
      if (st.valid === null && vre.test(document.querySelector('#validation').innerText)) st.valid = ms;
    }
    if (st.yaml === null || st.valid === null) requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(ws: Path) -> tuple[subprocess.Popen, str]:
    """`python -m app` on `ws`; (the process, its URL) once it answers."""
    port = free_port()
    log = open(ws / "app.log", "w")  # noqa: SIM115 (the process writes it until it ends)
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "--workspace", str(ws), "--port", str(port)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(url + "config", timeout=5)
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the app did not come up: {(ws / 'app.log').read_text()[-2000:]}")


def field(pg, key: str):
    """The input of a recipe key's form field (its label holds the key)."""
    from app.recipe_form import form_fields

    label = next(f.label for f in form_fields() if f.key == key)
    return pg.locator("label", has=pg.get_by_text(label, exact=True)).locator("input, textarea").first


def measure(pg, prepare, act, yaml_re: str | None, valid_re: str, settle: float) -> tuple[float, float]:
    """(ms to the YAML, ms to the validation) of one edit: `prepare()` (not timed), a pause for the page to
    settle, then `act()`, the edit's last key press or click."""
    prepare()
    time.sleep(settle)
    pg.evaluate(ARM, [yaml_re, valid_re])
    act()
    try:
        pg.wait_for_function("window.latency.yaml !== null && window.latency.valid !== null", timeout=60_000)
    except Exception as e:
        shown = pg.evaluate(
            "[document.querySelector('.cm-content').innerText, document.querySelector('#validation').innerText]"
        )
        raise RuntimeError(
            f"the edit did not show ({yaml_re!r}, {valid_re!r}): YAML and validation {shown}"
        ) from e
    got = pg.evaluate("window.latency")
    return got["yaml"], got["valid"]


def typed(pg, key: str, text: str):
    """(prepare, act) typing `text` into a field: what it holds selected, or all of `text` but its last character
    filled in (no key event: the app is not told), then that character typed."""
    box = field(pg, key)

    def prepare():
        box.click()
        box.fill(text[:-1]) if text[:-1] else box.press("Control+A")

    return prepare, lambda: box.press(text[-1])


def cleared(pg, key: str):
    box = field(pg, key)
    return lambda: (box.click(), box.press("Control+A")), lambda: box.press("Backspace")


def chosen(pg, key: str, option: str):
    from app.recipe_form import form_fields

    label = next(f.label for f in form_fields() if f.key == key)
    box = pg.get_by_label(label, exact=True).first
    return box.click, lambda: pg.get_by_role("option", name=option, exact=True).click()


def ticked(pg, key: str):
    return lambda: None, field(pg, key).click


def yaml_line(pg, on: bool):
    """A line `foo: 1` at the YAML's end, typed as `#foo: 1` once: on, its `#` deleted (an unknown key); off,
    typed back."""
    box = pg.locator(".cm-content").first

    def prepare():
        if not pg.evaluate("!!window.yamlLine"):
            box.click()
            box.press("Control+End")
            box.press_sequentially("\n#foo: 1")
            pg.evaluate("window.yamlLine = true")
        box.press("Home")

    return prepare, (lambda: box.press("Delete")) if on else (lambda: box.press("#"))


def edits(pg):
    """Per kind of edit: (its name, the form tab it is on, [(prepare, act, YAML pattern, validation pattern) for
    the edit that breaks the recipe, then the one that mends it])."""
    bad = r"problem\(s\)"
    return [
        (
            "number (train.batch_size)",
            "Optimisation",
            [
                (*typed(pg, "train.batch_size", "0"), r"batch_size: 0\n", bad),
                (*typed(pg, "train.batch_size", "4"), r"batch_size: 4\n", VALID),
            ],
        ),
        (
            "text (output_dir)",
            "Eval & checkpoints",
            [
                (*typed(pg, "output_dir", "elsewhere/x"), r"output_dir: elsewhere/x\n", bad),
                (*typed(pg, "output_dir", "runs/tiny"), r"output_dir: runs/tiny\n", VALID),
            ],
        ),
        (
            "optional number in a text box (train.epochs), then cleared",
            "Optimisation",
            [
                (*typed(pg, "train.epochs", "1"), r"epochs: 1(\.0)?(\n|$)", bad),
                (*cleared(pg, "train.epochs"), r"^(?![\s\S]*epochs)", VALID),
            ],
        ),
        (
            "dropdown (data.train_on)",
            "Data",
            [
                (*chosen(pg, "data.train_on", "last"), r"train_on: last\n", bad),
                (*chosen(pg, "data.train_on", "all"), r"train_on: all\n", VALID),
            ],
        ),
        (
            "checkbox (data.packing)",
            "Data",
            [
                (*ticked(pg, "data.packing"), r"packing: true\n", bad),
                (*ticked(pg, "data.packing"), r"packing: false\n", VALID),
            ],
        ),
        (
            "a line typed in the YAML box",
            "Data",
            [(*yaml_line(pg, True), None, r"unknown key \S*foo"), (*yaml_line(pg, False), None, VALID)],
        ),
    ]


def run(tries: int, settle: float, only: str = "") -> list[dict]:
    from playwright.sync_api import sync_playwright

    ws = tempdir("app-latency")
    (ws / "data").mkdir()
    shutil.copy(ROOT / "data/tiny_stories.txt", ws / "data/tiny_stories.txt")
    (ws / "recipes").mkdir()
    write_recipe(RECIPE, ws / "recipes", "pretrain_tiny.yaml")
    proc, url = start_app(ws)
    results = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            pg = browser.new_page(viewport={"width": 1400, "height": 1000})
            pg.goto(url, wait_until="load")
            pg.get_by_text("Recipe YAML (editable)").first.wait_for()
            time.sleep(3)  # the page's load events
            for name, tab, pair in [e for e in edits(pg) if only in e[0]]:
                pg.get_by_role("tab", name=tab, exact=True).click()
                got = [measure(pg, *pair[i % 2], settle) for i in range(tries)]
                results.append(
                    {"edit": name, "yaml_ms": [y for y, _ in got], "valid_ms": [v for _, v in got]}
                )
                print(row(results[-1]), flush=True)
            browser.close()
    finally:
        proc.terminate()
        proc.wait(20)
    return results


def row(r: dict) -> list:
    med = lambda xs: f"{statistics.median(xs):.0f} (max {max(xs):.0f})"  # noqa: E731
    return [r["edit"], med(r["yaml_ms"]) if any(r["yaml_ms"]) else "(typed there)", med(r["valid_ms"])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tries", type=int, default=7, help="edits of each kind (median reported)")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds the page is left between edits")
    ap.add_argument("--only", default="", help="the kinds of edit whose name holds this text, e.g. checkbox")
    args = ap.parse_args(argv)
    if not Path(CHROMIUM).exists():
        print(f"needs {CHROMIUM} (apt-get install chromium)", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = run(args.tries, args.settle, args.only)
    headers = ["edit", "ms to the YAML: median (max)", "ms to the validation: median (max)"]
    print(f"\n{machine()}; load average {os.getloadavg()[0]:.2f}\n")
    print(table(headers, [row(r) for r in results]))
    save_result("app_latency", {"tries": args.tries, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
