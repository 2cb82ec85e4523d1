"""The app as a user's script sees it: `python -m app` on 127.0.0.1, driven with gradio_client.

Create a recipe from the form, start a tiny run, watch metrics arrive, restart the app and find the
run again, stop it (checkpoint saved), chat with the result; bad recipes and paths outside the
workspace are refused with a message naming the key or path; so is code a recipe names outside the
workspace and the operator's allow-list, and none of it is imported.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from gradio_client import Client

import forked
from app.recipe_form import form_fields
from app.runs import LOG
from conftest import ROOT, TINY_ARCH, TOKENIZER
from launching import free_port
from training.run.rundir import CHECKPOINT_MARKER, RunDir

PY_BACKEND = "python (one process, no accelerate)"
# the tiny models' tokenizer, copied into each workspace (the app refuses paths outside it)
WS_TOKENIZER = "tokenizer"


def tiny_recipe(output_dir: str = "runs/tiny", **train) -> dict:
    return {
        "output_dir": output_dir,
        "seed": 0,
        "model": {"tokenizer": WS_TOKENIZER, "from_scratch": dict(TINY_ARCH)},
        "data": {
            "train": "data/tiny_stories.txt",
            "format": "text",
            "max_length": 32,
            "max_examples": 200,
            "eval_fraction": 0.05,
        },
        "train": {"lr": 3e-3, "batch_size": 4, "max_steps": 20, "warmup_steps": 0, **train},
        "eval": {"at_start": False, "every_steps": 5, "max_batches": 2},
    }


def make_workspace(root: Path) -> Path:
    (root / "data").mkdir(parents=True)
    shutil.copy(ROOT / "data/tiny_stories.txt", root / "data/tiny_stories.txt")
    shutil.copytree(TOKENIZER, root / WS_TOKENIZER)
    (root / "recipes").mkdir()
    (root / "recipes/tiny.yaml").write_text(yaml.safe_dump(tiny_recipe(), sort_keys=False))
    return root


class AppServer:
    """`python -m app --workspace WS --port P` in a subprocess; restartable (the runs it started go on)."""

    def __init__(self, workspace: Path, extra_args: tuple[str, ...] = (), env: dict | None = None):
        self.workspace, self.extra_args, self.env = workspace, extra_args, env
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 180) -> AppServer:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/"
        self.log = open(self.workspace / f"app-{port}.log", "w")  # noqa: SIM115 (closed by stop())
        argv = [
            sys.executable,
            "-m",
            "app",
            "--workspace",
            str(self.workspace),
            "--port",
            str(port),
            *self.extra_args,
        ]
        # forked: the fork server has imported training (about 8 s of the app's 13 s of imports)
        if self.env is None:
            self.proc = forked.start(argv, env=dict(os.environ), cwd=ROOT, log=Path(self.log.name))
        else:  # an environment read when an interpreter starts (PYTHONPATH)
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
            )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"app exited with {self.proc.returncode}: {(self.workspace / self.log.name).read_text()[-3000:]}"
                )
            try:
                urllib.request.urlopen(self.url + "config", timeout=5)
                return self
            except OSError as e:
                if getattr(e, "code", None) == 401:
                    return self  # up, and asking for a password
                time.sleep(0.5)
        raise RuntimeError("app did not come up in time")

    def client(self, **kw) -> Client:
        return Client(self.url, verbose=False, **kw)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def stop_training(self) -> None:
        """Teardown: no training process may outlive the tests."""
        registry = self.workspace / "runs/.app-runs.json"
        if registry.is_file():
            for rec in json.loads(registry.read_text()):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(rec["pid"], signal.SIGKILL)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = AppServer(make_workspace(tmp_path_factory.mktemp("workspace"))).start()
    yield srv
    srv.stop()
    srv.stop_training()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def endpoints(client) -> dict:
    return client.view_api(return_format="dict", print_info=False)["named_endpoints"]


def form_of(client, text: str) -> dict:
    """The form the app shows for a recipe's text: {field label: value}."""
    labels = [r["label"] for r in endpoints(client)["/yaml_to_form"]["returns"]]
    return dict(zip(labels, client.predict(text, api_name="/yaml_to_form")))


YAML_BOX = "Recipe YAML (editable)"
LABEL = {f.key: f.label for f in form_fields()}  # the form's label of each recipe key


def form_call(client, values_by_label: dict, base_yaml: str):
    """Fill the form like a user: start from `base_yaml` loaded into the form, change some fields."""
    api = endpoints(client)
    labels = [p["label"] for p in api["/form_to_yaml"]["parameters"]]
    loaded = client.predict(base_yaml, api_name="/yaml_to_form")
    ret_labels = [r["label"] for r in api["/yaml_to_form"]["returns"]]
    field_values = {
        lab: (v["value"] if isinstance(v, dict) else v) for lab, v in zip(ret_labels, loaded) if lab in labels
    }
    field_values[YAML_BOX] = base_yaml  # the text the form's changes are applied to
    values_by_label = {LABEL.get(k, k): v for k, v in values_by_label.items()}
    assert set(field_values) == set(labels)
    field_values.update(values_by_label)
    text = client.predict(*[field_values[lab] for lab in labels], api_name="/form_to_yaml")  # the YAML, alone
    # then what the form shows of it: the page's event that follows sends these updates (find_setting's, for
    # no search: the changes from what the page shows, no values)
    shown = client.predict(text, "", api_name="/find_setting")
    returns = [r["label"] for r in api["/find_setting"]["returns"]]
    return {YAML_BOX: text, **dict(zip(returns, shown))}


def wait_for(fn, timeout: float, every: float = 1.0, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_api_names_the_endpoints_a_script_needs(client):
    names = set(endpoints(client))
    assert {
        "/form_to_yaml",
        "/yaml_to_form",
        "/find_setting",
        "/load_recipe",
        "/save_recipe",
        "/launch_command",
        "/start_run",
        "/stop_run",
        "/run_status",
        "/load_model",
        "/unload_models",
        "/chat",
        "/server_models",
        "/memory_plan",
        "/evaluate",
        "/export_merge",
        "/job_status",
    } <= names


def test_recipe_from_the_form_is_saved_and_loaded(client, server):
    base = (server.workspace / "recipes/tiny.yaml").read_text()
    out = form_call(
        client, {"train.max_steps": "40", "train.lr": 0.001, "output_dir": "runs/from-form"}, base
    )
    recipe = yaml.safe_load(out["Recipe YAML (editable)"])
    assert recipe["train"]["max_steps"] == 40 and recipe["train"]["lr"] == 0.001
    assert (
        recipe["output_dir"] == "runs/from-form"
        and recipe["model"]["from_scratch"]["hidden_size"] == TINY_ARCH["hidden_size"]
    )
    assert out["Validation"].startswith("✔")
    msg, pick = client.predict("from-form", out["Recipe YAML (editable)"], api_name="/save_recipe")
    assert "recipes/from-form.yaml" in msg and (server.workspace / "recipes/from-form.yaml").is_file()
    loaded = client.predict("recipes/from-form.yaml", api_name="/load_recipe")
    text = loaded[0]  # the YAML, the form and, in the same update, the launch command of the recipe loaded
    assert loaded[-1].endswith(f"{sys.executable} -m training.train runs/from-form/recipe.yaml")
    assert yaml.safe_load(text) == recipe
    cmd = client.predict(text, PY_BACKEND, 1, api_name="/launch_command")
    assert cmd.splitlines() == [
        f"cd {server.workspace.resolve()}",
        f"{sys.executable} -m training.train runs/from-form/recipe.yaml",
    ]
    cmd = client.predict(text, "ddp", 2, api_name="/launch_command")
    assert (
        "launch --config_file" in cmd
        and "--num_processes 2 -m training.train runs/from-form/recipe.yaml" in cmd
    )


def test_memory_plan_for_the_chosen_setup(client, server):
    """The planner loads the recipe's tokenizer (`tokenizer`, a path in the workspace) in the app's own process,
    which was started in the repository: it reads it from the workspace, as the run does."""
    text = (server.workspace / "recipes/tiny.yaml").read_text()
    plan = client.predict(text, 2, 40, api_name="/memory_plan")
    assert "| backend |" in plan and "| ddp | 2 |" in plan and "Recommended" in plan
    assert "Fix the recipe first" in client.predict("output_dir: runs/x\n", 1, 80, api_name="/memory_plan")


def test_form_errors_are_shown_next_to_the_fields(client, server):
    base = (server.workspace / "recipes/tiny.yaml").read_text()
    out = form_call(client, {"train.lr": -1, "model.from_scratch.hidden_size": 66}, base)
    assert "train.lr" in out["Validation"] and "greater than 0" in out["Validation"]
    lr = out[LABEL["train.lr"]]
    assert (
        lr["info"].startswith("⚠")
        and "greater than 0" in lr["info"]
        and lr["elem_classes"] == ["field-error"]
    )
    # only what changes is sent (the page keeps the rest): no error came or went on batch_size
    assert out[LABEL["train.batch_size"]] == {"__type__": "update"}
    # what does not apply is folded away: this recipe trains a new model in full, so no LoRA settings (hidden
    # when the recipe was loaded, and not shown by this edit); switching to LoRA shows them
    assert "visible" not in out[LABEL["method.lora.r"]]
    as_lora = form_call(client, {"method.type": "lora"}, base)
    assert as_lora[LABEL["method.lora.r"]]["visible"] is True
    assert (
        "divisible" in out[LABEL["model.from_scratch"]]["info"]
    )  # a section's own check shows on its switch
    # YAML -> form: an unknown key is listed on the form tab of its section; syntax errors name the line
    raw = yaml.safe_load(base)
    raw["model"]["colour"] = "blue"
    back = form_of(client, yaml.safe_dump(raw))
    assert "unknown key `model.colour`" in back["Model errors"] and "model.colour" in back["Validation"]
    assert back["Data errors"] == ""
    status = client.predict("train:\n  lr: [1\nx: 2\n", api_name="/yaml_to_form")[0]
    assert "not valid YAML at line 3" in status


def test_malformed_recipe_is_refused_with_the_key(client, server):
    bad = tiny_recipe()
    bad["train"]["lr"] = -1
    bad["train"]["warmup"] = 3
    with pytest.raises(
        Exception, match=r"(?s)malformed recipe, not started.*train\.lr.*greater than 0.*train\.warmup"
    ):
        client.predict(yaml.safe_dump(bad), PY_BACKEND, 1, api_name="/start_run")
    with pytest.raises(Exception, match="not valid YAML at line"):
        client.predict("output_dir: runs/x\ntrain: {lr: [\n", PY_BACKEND, 1, api_name="/start_run")
    assert not (server.workspace / "runs/tiny").exists()
    # Save answers a refusal in the file status (and a toast), in plain text, not as an error of the event
    msg, _ = client.predict("bad", yaml.safe_dump(bad), api_name="/save_recipe")
    assert msg.startswith("✘ not saved: the recipe has problems: train.lr: Input should be greater than 0; ")
    msg, _ = client.predict("../escape", "x: 1", api_name="/save_recipe")
    assert msg.startswith("✘ not saved: save as: '../escape' is not a valid name")
    assert (
        not (server.workspace / "recipes/bad.yaml").exists()
        and not (server.workspace / "escape.yaml").exists()
    )


@pytest.mark.parametrize(
    "key,value",
    [
        ("output_dir", "/tmp/llm-forge-escape"),
        ("output_dir", "data/not-a-run"),
        ("data.train", "/etc/passwd"),
        ("data.train", "../../etc/hosts"),
        ("model.tokenizer", "/usr/share"),
    ],
)
def test_recipe_paths_outside_the_workspace_are_refused(client, server, key, value):
    recipe = tiny_recipe()
    section, _, leaf = key.rpartition(".")
    (recipe[section] if section else recipe)[leaf] = value
    with pytest.raises(Exception, match=f"{key}: {value} is outside the workspace"):
        client.predict(yaml.safe_dump(recipe), PY_BACKEND, 1, api_name="/start_run")
    assert not Path("/tmp/llm-forge-escape").exists()


def test_an_adapter_to_continue_from_outside_the_workspace_is_refused(client):
    recipe = tiny_recipe()
    recipe["model"] = {"name_or_path": WS_TOKENIZER}
    recipe["method"] = {"type": "lora", "lora": {"init_from": "/tmp"}}
    with pytest.raises(Exception, match="method.lora.init_from: /tmp is outside the workspace"):
        client.predict(yaml.safe_dump(recipe), PY_BACKEND, 1, api_name="/start_run")


@pytest.mark.parametrize(
    "endpoint,args",
    [
        ("/load_model", ("/etc",)),
        ("/load_model", ("runs/../../",)),
        ("/load_recipe", ("../../../etc/passwd",)),
    ],
)
def test_ui_paths_outside_the_workspace_are_refused(client, endpoint, args):
    with pytest.raises(Exception, match="outside the workspace|not a valid name"):
        client.predict(*args, api_name=endpoint)


def test_run_start_metrics_reattach_stop_and_chat(server, tmp_path):
    c = server.client()
    text = yaml.safe_dump(tiny_recipe(max_steps=100_000))  # long enough to be stopped halfway
    msg, _ = c.predict(text, PY_BACKEND, 1, api_name="/start_run")
    assert "started **tiny**" in msg and "-m training.train runs/tiny/recipe.yaml" in msg
    status = wait_for(
        lambda: (s := c.predict("tiny", api_name="/run_status"))["metrics_rows"] >= 3 and s,
        240,
        what="metrics",
    )
    assert status["state"] == "running" and status["total_steps"] == 100_000 and status["loss"] > 0
    assert status["remaining_s"] > 0 and status["active"] == "tiny"

    # an app restart (and so any page reload) re-attaches to the run still going
    server.stop()
    server.start()
    c = server.client()
    again = c.predict("tiny", api_name="/run_status")
    assert again["state"] == "running" and again["step"] >= status["step"]
    with pytest.raises(Exception, match="'tiny' .* still running and holds the device"):  # one run at a time
        c.predict(yaml.safe_dump(tiny_recipe("runs/second")), PY_BACKEND, 1, api_name="/start_run")

    assert "SIGTERM" in c.predict("tiny", api_name="/stop_run")
    compared = c.predict(["tiny", "no-such-run"], api_name="/compare_runs")  # the Run tab's Compare runs
    assert compared["headers"][:5] == ["run", "state", "step", "loss", "eval loss"]
    assert [row[0] for row in compared["rows"]] == ["tiny"] and compared["rows"][0][3] > 0
    stopped = wait_for(
        lambda: (s := c.predict("tiny", api_name="/run_status"))["state"] == "stopped" and s, 120, what="stop"
    )
    run = RunDir(server.workspace / "runs/tiny")
    ckpt = run.checkpoint(stopped["step"]).relative_to(server.workspace)
    assert (run.checkpoint(stopped["step"]) / CHECKPOINT_MARKER).is_file() and str(ckpt) in stopped["message"]
    assert "stopped at step" in (run.root / LOG).read_text()
    assert stopped["active"] is None

    # chat with the stopped run's checkpoint, streaming through the chat endpoint
    loaded = c.predict(str(ckpt), api_name="/load_model")
    assert "loaded" in loaded and "M parameters" in loaded
    _, hist_a, hist_b = c.predict(
        "Once upon a time", [], [], "You tell stories.", 0, 0.9, 8, api_name="/chat"
    )
    assert [m["role"] for m in hist_a] == ["user", "assistant"] and hist_b == []
    reply = hist_a[1]["content"]
    reply = reply if isinstance(reply, str) else "".join(p.get("text", "") for p in reply)
    assert reply.strip()
    # a second turn (the history goes back in), streamed: the message first, then the reply as it grows
    job = c.submit("Once upon a time", hist_a, [], "You tell stories.", 0, 0.9, 8, api_name="/chat")
    _, hist_a2, _ = job.result()
    assert len(hist_a2) == 4
    texts = [
        "".join(p.get("text", "") for p in out[1][-1]["content"]) for out in job.outputs() if len(out[1]) == 4
    ]
    assert texts[0] == "" and texts[-1].strip() and len(texts) >= 2
    assert "unloaded A" in c.predict(api_name="/unload_models")
    with pytest.raises(Exception, match="no model loaded"):
        c.predict("hello", [], [], "", 0, 0.9, 8, api_name="/chat")
    with pytest.raises(Exception, match=r"no server answers at http://127.0.0.1:1/v1 \(.*\); start one"):
        c.predict("127.0.0.1:1", "", api_name="/server_models")
    # user errors (the run refused above, the chat without a model or server) are one line each in the app's log
    app_log = (server.workspace / server.log.name).read_text()
    assert "refused: no model loaded: pick one and press Load A" in app_log
    assert "refused: no server answers at http://127.0.0.1:1/v1" in app_log
    assert "refused: not started: " in app_log and "Traceback" not in app_log, app_log[-3000:]


def test_a_failing_run_stays_listed_as_failed(server):
    c = server.client()
    recipe = tiny_recipe("runs/broken")
    recipe["data"]["train"] = "data/missing.txt"  # inside the workspace, but not there: the trainer exits 2
    c.predict(yaml.safe_dump(recipe), PY_BACKEND, 1, api_name="/start_run")
    failed = wait_for(
        lambda: (s := c.predict("broken", api_name="/run_status"))["state"] != "running" and s,
        180,
        what="exit",
    )
    assert failed["state"] == "failed" and "exit code 2" in failed["message"]
    assert "missing.txt" in (server.workspace / "runs/broken" / LOG).read_text()
    assert failed["active"] is None  # a failed run does not hold the device


def test_password_from_the_environment(tmp_path):
    srv = AppServer(make_workspace(tmp_path / "ws"))
    os.environ["LLM_FORGE_AUTH"] = "alice:s3cret"
    try:
        srv.start()
    finally:
        del os.environ["LLM_FORGE_AUTH"]
    try:
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(srv.url + "config", timeout=10)
        c = srv.client(auth=("alice", "s3cret"))
        assert "/start_run" in endpoints(c)
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- code a recipe names

MARKER_CODE = """\
import pathlib
pathlib.Path({marker!r}).write_text("imported")


def f(completions, **kw):
    return [float(len(c) % 3) for c in completions]
"""


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """An app whose operator allows the module lab_rewards (outside the workspace, on PYTHONPATH); beside it
    lie other code outside the workspace, each file writing a marker when it is imported."""
    root = tmp_path_factory.mktemp("guarded")
    ws, out, marks = make_workspace(root / "ws"), root / "outside", root / "marks"
    for d in (out / "lab_rewards", ws / "rewards", marks):
        d.mkdir(parents=True)
    for path, name in [
        (ws / "rewards/mine.py", "ws-file"),
        (out / "evil.py", "evil"),
        (out / "denied_rewards.py", "denied"),
        (out / "lab_rewards/__init__.py", "lab-init"),
        (out / "lab_rewards/scores.py", "lab-scores"),
    ]:
        path.write_text(MARKER_CODE.format(marker=str(marks / name)))
    (ws / "rewards/link.py").symlink_to(out / "evil.py")
    shutil.copy(ROOT / "data/rl/train.jsonl", ws / "data/prompts.jsonl")
    pythonpath = os.pathsep.join(p for p in (str(out), os.environ.get("PYTHONPATH", "")) if p)
    srv = AppServer(ws, ("--allow-module", "lab_rewards"), env={"PYTHONPATH": pythonpath}).start()
    yield srv, out, marks
    srv.stop()
    srv.stop_training()


def rl_recipe(name: str, *functions: str, **reward) -> dict:
    return {
        "output_dir": f"runs/{name}",
        "seed": 0,
        "model": {"tokenizer": WS_TOKENIZER, "from_scratch": dict(TINY_ARCH)},
        "data": {"train": "data/prompts.jsonl", "format": "prompts", "max_length": 128, "max_examples": 8},
        "rl": {
            "num_generations": 2,
            "max_new_tokens": 4,
            "rewards": [{"function": f, "name": f"r{i}"} for i, f in enumerate(functions)]
            + [reward] * bool(reward),
        },
        "train": {"lr": 1e-3, "batch_size": 2, "max_steps": 1, "warmup_steps": 0},
        "eval": {"at_start": False},
    }


@pytest.mark.parametrize(
    "function, why",
    [
        ("{out}/evil.py:f", "the file {out}/evil.py is outside the workspace"),
        ("../outside/evil.py:f", "the file ../outside/evil.py is outside the workspace"),
        ("rewards/link.py:f", "the file rewards/link.py is outside the workspace"),
        ("denied_rewards:f", "importing denied_rewards runs {out}/denied_rewards.py, outside the workspace"),
        ("antigravity:geohash", "antigravity is not on the app's allow-list"),
    ],
)
def test_code_outside_the_workspace_is_refused_by_the_form_and_by_start(guarded, function, why):
    srv, out, marks = guarded
    function, why = function.format(out=out), why.format(out=out)
    text = yaml.safe_dump(rl_recipe("refused", "exact_match", function))
    c = srv.client()
    key = "rl.rewards[1].function"
    with pytest.raises(Exception, match=re.escape(f"refused: {key}: {function}: ")):
        c.predict(text, PY_BACKEND, 1, api_name="/start_run")
    form = form_of(c, text)
    assert f"{key}: {function}: " in form["Validation"] and why in form["Validation"]
    assert why in str(form[LABEL["rl.rewards"]])  # the field's own error, next to it in the form
    said = c.predict("refused", text, api_name="/save_recipe")[0]  # said in the file status, not raised
    assert said.startswith("✘ not saved: the recipe has problems: ") and f"{key}: {function}: " in said
    assert not (srv.workspace / "runs/refused").exists() and not any(marks.iterdir())


@pytest.mark.parametrize(
    "key, value",
    [("rl.tools", ["python", "{out}/evil.py:f"]), ("rl.environment", "denied_rewards:Env")],
)
def test_tools_and_environments_outside_the_workspace_are_refused_as_reward_functions_are(
    guarded, key, value
):
    """Agent episodes' code (rl.tools, rl.environment) is a code reference like a reward function: the form and
    Start refuse what lies outside the workspace, and nothing of it is imported; the built-in python tool is not
    the user's code."""
    srv, out, marks = guarded
    value = [v.format(out=out) for v in value] if isinstance(value, list) else value
    recipe = rl_recipe("refused-agent", "exact_match")
    recipe["rl"][key.split(".")[1]] = value
    shown = value[-1] if isinstance(value, list) else value
    text = yaml.safe_dump(recipe)
    c = srv.client()
    with pytest.raises(Exception, match=re.escape(f"refused: {key}: {shown}: ")):
        c.predict(text, PY_BACKEND, 1, api_name="/start_run")
    form = form_of(c, text)
    assert f"- **{key}**: {shown}: " in form["Validation"] and "python:" not in form["Validation"]
    assert not (srv.workspace / "runs/refused-agent").exists() and not any(marks.iterdir())


def test_a_reward_model_outside_the_workspace_is_refused_and_not_read(guarded):
    srv, out, marks = guarded
    reward = {"function": "reward_model", "args": {"path": str(out)}}
    text = yaml.safe_dump(rl_recipe("rm", "exact_match", **reward))
    c = srv.client()
    with pytest.raises(
        Exception, match=re.escape(f"refused: rl.rewards[1].args.path: {out} is outside the workspace")
    ):
        c.predict(text, PY_BACKEND, 1, api_name="/start_run")
    plan = c.predict(text, 1, 80, api_name="/memory_plan")
    assert "Fix the recipe first" in plan and f"rl.rewards[1].args.path: {out} is outside" in plan


def test_code_in_the_workspace_and_an_allowed_module_run(guarded):
    srv, out, marks = guarded
    c = srv.client()
    text = yaml.safe_dump(rl_recipe("allowed", "rewards/mine.py:f", "lab_rewards.scores:f"))
    msg, _ = c.predict(text, PY_BACKEND, 1, api_name="/start_run")
    assert "started **allowed**" in msg
    done = wait_for(
        lambda: (s := c.predict("allowed", api_name="/run_status"))["state"] != "running" and s,
        300,
        what="the run",
    )
    log = (srv.workspace / "runs/allowed" / LOG).read_text()
    assert done["state"] == "finished", log[-3000:]
    assert sorted(p.name for p in marks.iterdir()) == ["lab-init", "lab-scores", "ws-file"]
    assert f"importing your code: the file {srv.workspace.resolve()}/rewards/mine.py (function f)" in log
    assert "importing your code: the module lab_rewards.scores (function f)" in log


def test_the_data_preview_shows_the_trainers_tokens_and_refuses_data_outside(server):
    client = server.client()  # the server may have been restarted by an earlier test (a new port)
    chat = server.workspace / "data/chat.jsonl"
    record = {
        "messages": [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ]
    }
    chat.write_text(json.dumps(record) + "\n")
    recipe = {
        "output_dir": "runs/preview",
        "model": {"name_or_path": WS_TOKENIZER},
        "data": {"train": "data/chat.jsonl", "max_length": 8},
    }
    summary, records, plot = client.predict(yaml.safe_dump(recipe), api_name="/data_preview")
    assert "**1 records** read" in summary and "**1 (100.0%)** are longer than max_length=8" in summary
    assert "training drops them" in records  # 8 tokens keep none of the answer
    recipe["data"]["max_length"] = 64
    summary, records, plot = client.predict(yaml.safe_dump(recipe), api_name="/data_preview")
    assert "<mark>Paris.&lt;|im_end|&gt;" in records and "Capital of France?" in records
    assert "<mark>" not in records.split("Paris.")[0].split("assistant")[0]  # the question carries no loss
    recipe["data"]["train"] = "/etc/passwd"
    with pytest.raises(Exception, match="refused: data.train: /etc/passwd is outside the workspace"):
        client.predict(yaml.safe_dump(recipe), api_name="/data_preview")
