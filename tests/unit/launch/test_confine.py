"""The app's rule for code a recipe names (training.launch.confine): a reward function's file must resolve
inside the workspace, a module must be found there or be on the operator's allow-list; the check imports
nothing. The trainer started by the app (the rule in its environment) refuses such a recipe with exit 2
before importing anything; the command line imports what its user names and says which file it imports."""

from __future__ import annotations

import logging
import sys

import pytest
import yaml

from conftest import ROOT, run_cli
from training.config import RewardSpec
from training.core.errors import RecipeError
from training.launch.confine import ALLOW_MODULES_ENV, WORKSPACE_ENV, Confinement, Outside, module_files
from training.rl.rewards import load_function

MARKER_CODE = "import pathlib\npathlib.Path({marker!r}).write_text('imported')\n\ndef f(completions, **kw):\n    return [0.0] * len(completions)\n"


def code_file(path, marker):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(MARKER_CODE.format(marker=str(marker)))
    return path


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A workspace with its own reward file and package, and beside it an outside directory on sys.path
    holding a module and a package; every file writes a marker when it is imported."""
    ws, out, marks = tmp_path / "ws", tmp_path / "outside", tmp_path / "marks"
    marks.mkdir()
    code_file(ws / "rewards/mine.py", marks / "ws-file")
    code_file(ws / "wspkg/__init__.py", marks / "wspkg-init")
    code_file(ws / "wspkg/scores.py", marks / "wspkg-scores")
    code_file(out / "evil.py", marks / "evil")
    code_file(out / "lab_rewards/__init__.py", marks / "lab-init")
    code_file(out / "lab_rewards/math.py", marks / "lab-math")
    code_file(out / "lab_rewardsx.py", marks / "lab-x")
    (ws / "link.py").symlink_to(out / "evil.py")
    (ws / "linkdir").symlink_to(out)
    monkeypatch.syspath_prepend(str(out))
    return ws, out, marks


def refusals(rule: Confinement, *functions: str) -> dict[str, list[str]]:
    raw = {"rl": {"rewards": [{"function": f} for f in functions]}}
    return rule.problems(raw)


def test_files_and_modules_inside_the_workspace_are_allowed_and_nothing_is_imported(places):
    ws, _, marks = places
    rule = Confinement(ws)
    assert (
        refusals(rule, "rewards/mine.py:f", f"{ws}/rewards/mine.py:f", "wspkg.scores:f", "exact_match") == {}
    )
    assert rule.code("rewards/../rewards/mine.py:f", "k") == (ws / "rewards/mine.py").resolve()
    assert not any(marks.iterdir()), "checking a reference must import nothing"


@pytest.mark.parametrize(
    "function, why",
    [
        ("{out}/evil.py:f", "the file {out}/evil.py is outside the workspace"),
        ("../outside/evil.py:f", "the file ../outside/evil.py is outside the workspace"),
        ("link.py:f", "the file link.py is outside the workspace"),
        ("linkdir/evil.py:f", "the file linkdir/evil.py is outside the workspace"),
        ("evil:f", "importing evil runs {out}/evil.py, outside the workspace"),
        ("lab_rewards.math:f", "importing lab_rewards.math runs {out}/lab_rewards/__init__.py, outside"),
        ("antigravity:geohash", "importing antigravity runs"),
        ("os:system", "importing os runs"),
        ("sys:exit", "sys is built into Python"),
        ("nosuchmodule_xyz:f", "no module nosuchmodule_xyz is found"),
    ],
)
def test_code_outside_the_workspace_is_refused_with_the_key_and_nothing_is_imported(places, function, why):
    ws, out, marks = places
    function, why = function.format(out=out), why.format(out=out)
    problems = refusals(Confinement(ws), "exact_match", function)
    assert list(problems) == ["rl.rewards[1].function"]
    (message,) = problems["rl.rewards[1].function"]
    assert message.startswith(f"rl.rewards[1].function: {function}: ") and why in message
    assert not any(marks.iterdir()), "checking a reference must import nothing"


def test_the_allow_list_admits_a_module_and_its_submodules_only(places):
    ws, _, marks = places
    rule = Confinement(ws, ("lab_rewards",))
    assert refusals(rule, "lab_rewards:f", "lab_rewards.math:f") == {}
    assert "not on the app's allow-list (python -m app --allow-module PREFIX; now: lab_rewards)" in str(
        refusals(rule, "lab_rewardsx:f")
    )
    assert "outside the workspace" in str(refusals(rule, "evil:f"))
    assert not any(marks.iterdir())
    with pytest.raises(ValueError, match="--allow-module 'bad name'"):
        Confinement(ws, ("bad name",))


def test_a_verifiers_environment_is_code_of_the_workspace_or_of_the_allow_list(places):
    """rl.environment: verifiers:path/to/env.py must be a file of the workspace; verifiers:ID, an installed
    environment (in the verifiers Python, which this check cannot look into), must be on the allow-list."""
    ws, out, marks = places
    (ws / "envs").mkdir()
    (ws / "envs/echo.py").write_text("raise SystemExit('imported')\n")

    def problems(rule, value):
        return rule.problems({"rl": {"environment": value}}).get("rl.environment", [])

    rule = Confinement(ws, ("word_echo",))
    assert problems(rule, "verifiers:envs/echo.py") == []
    assert problems(rule, "verifiers:word-echo") == []  # its module, word_echo, is on the list
    (outside,) = problems(rule, f"verifiers:{out}/evil.py")
    assert f"the file {out}/evil.py is outside the workspace" in outside
    (unlisted,) = problems(Confinement(ws), "verifiers:word-echo")
    assert "an installed verifiers environment runs code from outside the workspace" in unlisted
    assert "--allow-module word_echo)" in unlisted
    Confinement(ws, ("word_echo",))  # a name the allow-list takes
    assert not any(marks.iterdir())


def test_module_files_lists_every_file_the_import_runs(places):
    ws, out, _ = places
    assert module_files("lab_rewards.math", sys.path) == [
        out / "lab_rewards/__init__.py",
        out / "lab_rewards/math.py",
    ]
    with pytest.raises(Outside, match="lab_rewardsx is a module, not a package"):
        module_files("lab_rewardsx.sub", sys.path)


def test_a_reward_model_path_and_remote_code_stay_in_the_workspace(places):
    ws, out, _ = places
    (ws / "models/rm").mkdir(parents=True)
    rule = Confinement(ws)
    rm = {"function": "reward_model", "args": {"path": str(out)}}
    problems = rule.problems({"rl": {"rewards": [rm]}})
    assert problems["rl.rewards[0].args.path"] == [
        f"rl.rewards[0].args.path: {out} is outside the workspace {ws} (only paths inside it are accepted)"
    ]
    assert rule.problems({"model": {"name_or_path": "models/rm", "trust_remote_code": True}}) == {}
    hub = rule.problems({"model": {"name_or_path": "org/model", "trust_remote_code": True}})
    assert "model.trust_remote_code: true runs the Python files of model.name_or_path (org/model)" in str(hub)


def test_the_trainer_launched_by_the_app_refuses_outside_code_with_exit_2_before_importing(places):
    ws, out, marks = places
    recipe = ws / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "output_dir": str(ws / "runs/r"),
                "model": {"name_or_path": str(ws / "models/base")},
                "data": {"train": str(ws / "data/p.jsonl"), "format": "prompts"},
                "method": {"type": "lora"},
                "rl": {
                    "rewards": [
                        {"function": f"{out}/evil.py:f"},
                        {"function": "lab_rewards:f", "name": "lab"},
                    ]
                },
            }
        )
    )
    env = {WORKSPACE_ENV: str(ws), ALLOW_MODULES_ENV: "", "PYTHONPATH": f"{ROOT}:{out}"}
    r = run_cli("training.train", recipe, env=env, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "names what the app that launched this run does not allow" in r.stderr
    assert f"rl.rewards[0].function: {out}/evil.py:f: the file" in r.stderr
    assert "rl.rewards[1].function: lab_rewards:f: importing lab_rewards runs" in r.stderr
    assert "Traceback" not in r.stderr and not any(marks.iterdir())
    assert not (ws / "runs").exists()


def test_the_command_line_imports_what_its_user_names_and_says_which_file(places, caplog):
    ws, _, marks = places
    with caplog.at_level(logging.INFO, logger="training.rl.code_refs"):
        fn = load_function(RewardSpec(function=f"{ws}/rewards/mine.py:f"), "rl.rewards[0].function")
    assert fn(completions=["a", "b"]) == [0.0, 0.0] and (marks / "ws-file").is_file()
    assert (
        f"rl.rewards[0].function: importing your code: the file {ws.resolve()}/rewards/mine.py (function f)"
        in caplog.text
    )
    with caplog.at_level(logging.INFO, logger="training.rl.code_refs"):
        load_function(RewardSpec(function="lab_rewards.math:f"), "rl.rewards[1].function")
    assert (
        "rl.rewards[1].function: importing your code: the module lab_rewards.math (function f)" in caplog.text
    )
    with pytest.raises(RecipeError, match=r"rl.rewards\[0\].function: reward file nope.py does not exist"):
        load_function(RewardSpec(function="nope.py:f"), "rl.rewards[0].function")
