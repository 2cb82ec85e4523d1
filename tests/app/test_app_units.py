"""The app's pieces without a server: the schema-generated form, workspace path checks, run states."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import gradio as gr
import pytest
import yaml

from app.charts import LOSS_KEYS, loss_points, reward_points, run_figure
from app.jobs import JobQueue, evaluate_argv, export_argv
from app.recipe_check import RecipeRefused, checked_recipe, launch_command
from app.recipe_form import (
    YamlError,
    applies,
    dict_to_values,
    edit_yaml,
    field_errors,
    form_fields,
    grouped,
    parse_yaml,
    to_yaml,
    values_to_dict,
)
from app.run_views import RunView, RunViews, eval_markdown, progress_markdown, tracker_markdown
from app.runs import (
    LOG,
    PYTHON_BACKEND,
    LaunchRefused,
    RunRecord,
    RunRegistry,
    backend_label,
    default_processes,
    launch_argv,
    proc_start_time,
)
from app.ui import build_app
from app.workspace import BUNDLED_MODELS, PathRefused, Workspace, check_name, recipe_refusals
from conftest import ROOT
from training.config import Recipe, code_fields, parse_recipe, path_fields
from training.run.rundir import CHECKPOINT_MARKER, CHECKPOINT_STATE, MODEL_CONFIG, RunDir

RECIPES = sorted((ROOT / "training/recipes").glob("*.yaml"))


def by_key():
    return {f.key: f for f in form_fields()}


def test_form_is_generated_from_the_schema_with_widget_kinds_by_type():
    f = by_key()
    # every leaf of the schema is a field; Literal -> dropdown, bool -> checkbox, numbers, text
    assert f["train.scheduler"].kind == "dropdown" and f["train.scheduler"].choices == [
        "cosine",
        "linear",
        "constant",
    ]
    assert f["method.quantization.bits"].choices == [4, 8]
    assert f["model.gradient_checkpointing"].kind == "checkbox"
    assert f["train.lr"].kind == "float" and f["train.batch_size"].kind == "int"
    assert f["train.max_steps"].kind == "int" and f["train.max_steps"].optional
    assert f["data.train"].kind == "list" and f["data.train"].required
    assert f["model.from_scratch"].kind == "section"
    assert f["model.from_scratch.hidden_size"].section == "model.from_scratch"

    # a new schema key would appear by itself: the field count follows the schema
    def leaves(model):

        from app.recipe_form import _is_model, _unwrap

        n = 0
        for info in model.model_fields.values():
            t, optional = _unwrap(info.annotation)
            n += (leaves(t) + optional) if _is_model(t) else 1
        return n

    assert len(form_fields()) == leaves(Recipe)


def test_fields_are_grouped_as_a_user_thinks():
    groups = {g: [f.key for f in fs] for g, fs in grouped(form_fields()).items()}
    assert list(groups)[:6] == [
        "Model",
        "Data",
        "Method",
        "Optimisation",
        "Precision & memory",
        "Eval & checkpoints",
    ]
    assert (
        "precision" in groups["Precision & memory"]
        and "model.attn_implementation" in groups["Precision & memory"]
    )
    assert "model.from_scratch.hidden_size" in groups["Model"]
    assert "train.lr" in groups["Optimisation"] and "checkpoint.keep_last" in groups["Eval & checkpoints"]


def test_the_form_shows_what_applies_to_the_method_and_the_sections_switched_on():
    fields = {f.key: f for f in form_fields()}

    def shown(recipe: str) -> set[str]:
        raw = parse_yaml((ROOT / "training/recipes" / recipe).read_text())
        return {k for k, f in fields.items() if applies(f, raw)}

    lora, qlora, scratch = shown("lora.yaml"), shown("qlora.yaml"), shown("pretrain_tiny.yaml")
    assert "method.lora.r" in lora and "method.quantization.bits" not in lora and "method.qat" not in lora
    assert "method.quantization.bits" in qlora and "method.lora.r" in qlora
    assert "method.lora.r" not in scratch and "method.qat" in scratch and "method.qat.scheme" not in scratch
    assert "model.from_scratch.hidden_size" in scratch and "model.from_scratch.hidden_size" not in lora
    for switch in ("model.from_scratch", "model.vision"):  # always offered
        assert switch in lora and switch in scratch
    for switch in ("preference", "rl", "distill"):  # the "Objective" choice stands for these
        assert switch not in lora and switch not in shown("grpo.yaml")
    assert not any(k.startswith(("rl.", "preference.", "distill.", "model.vision.")) for k in lora)
    assert "rl.rewards" in shown("grpo.yaml") and len(lora) < 0.6 * len(fields)  # 80 of 150 (2026-11-28)


def test_every_field_has_words_beside_its_key_and_a_line_of_help():
    fields = form_fields()
    assert [f.key for f in fields if not f.description] == []  # help from the schema, for every field
    labels = {f.key: f.label for f in fields}
    assert labels["train.lr"] == "Learning rate · train.lr"
    assert labels["train.max_steps"] == "Max steps · train.max_steps"
    assert labels["model.from_scratch"] == "New model from scratch · model.from_scratch"  # a section's switch
    assert all(label.endswith(" · " + key) for key, label in labels.items())
    assert len(set(labels.values())) == len(labels)
    assert labels["data.max_length"] == "Max length (tokens) · data.max_length"  # units where there are some
    assert labels["rl.tool_timeout_s"] == "Tool timeout (s) · rl.tool_timeout_s"
    assert labels["train.batch_size"] == "Batch size (sequences per process) · train.batch_size"
    for f in fields:  # a name that says its unit gets it in the label (or already says it in words)
        if f.kind in ("int", "float") and f.key.endswith(("_s", "max_length", "max_new_tokens", "_chars")):
            assert f.unit, f.key


def test_each_tab_shows_its_common_fields_first_and_folds_the_rest():
    from app.recipe_form import COMMON

    fields = by_key()
    assert set(fields) >= COMMON  # no stale key in the hand-written list
    for group, fs in grouped(form_fields()).items():
        common = [f.common for f in fs]
        assert common == sorted(common, reverse=True), group  # common ones first
        assert 0 < sum(common) < len(fs), group  # every tab has both, so none is all fold or no fold
    assert fields["train.lr"].common and not fields["train.max_grad_norm"].common
    assert fields["distill.teacher"].group == "Method" and fields["report_to"].group == "Eval & checkpoints"


def test_the_objective_choice_switches_one_section_on_and_the_others_off():
    from app.recipe_form import objective_of, with_objective

    fields = form_fields()
    recipes = {r: parse_yaml((ROOT / "training/recipes" / r).read_text()) for r in ("lora.yaml", "dpo.yaml")}
    recipes["grpo.yaml"] = parse_yaml((ROOT / "training/recipes/grpo.yaml").read_text())
    recipes["distill_tiny.yaml"] = parse_yaml((ROOT / "training/recipes/distill_tiny.yaml").read_text())
    assert {r: objective_of(raw) for r, raw in recipes.items()} == {
        "lora.yaml": "supervised",
        "dpo.yaml": "preference",
        "grpo.yaml": "online RL",
        "distill_tiny.yaml": "distillation",
    }
    text = (ROOT / "training/recipes/dpo.yaml").read_text()
    values = dict_to_values(fields, recipes["dpo.yaml"])
    as_rl = values_to_dict(fields, with_objective(fields, values, "online RL"))
    assert "preference" not in as_rl and as_rl["rl"] is not None and objective_of(as_rl) == "online RL"
    supervised = edit_yaml(text, fields, with_objective(fields, values, "supervised"))
    assert "preference:" not in supervised and objective_of(parse_yaml(supervised)) == "supervised"
    assert supervised.splitlines()[0] == text.splitlines()[0]  # the rest of the user's YAML as it was


def test_find_a_setting_by_its_words_or_its_key():
    from app.configure_tab import form_updates
    from app.form_state import search_markdown

    f = by_key()
    assert f["train.lr"].matches("learning rate") and f["train.lr"].matches("TRAIN.LR")
    assert f["train.lr"].matches("rate learning") and not f["train.lr"].matches("lora")
    assert f["data.max_length"].matches("tokens")  # the unit is in the label too
    raw = parse_yaml((ROOT / "training/recipes/full.yaml").read_text())
    md = search_markdown(form_fields(), raw, "lora rank")
    assert (
        md.startswith("No setting this recipe uses matches “lora rank”.")
        and "1 more that this recipe does not use" in md
        and "method.lora.r" in md
    )
    md = search_markdown(form_fields(), raw, "learning rate")
    assert md.startswith("1 setting(s) match: `train.lr` (Optimisation)")
    assert search_markdown(form_fields(), raw, "") == "" and "No setting" in search_markdown([], raw, "zzz")
    # the updates the form gets: [status, tab errors..., folds..., fields...]
    groups = grouped(form_fields())
    n = len(groups)
    order = [x for fs in groups.values() for x in fs]
    out = form_updates(groups, raw, {}, "max grad norm")
    shown = [x.key for x, u in zip(order, out[1 + 2 * n :]) if u["visible"]]
    assert shown == ["train.max_grad_norm"]
    folds = out[1 + n : 1 + 2 * n]
    opt = list(groups).index("Optimisation")
    assert folds[opt] == {"__type__": "update", "visible": True, "open": True}  # the hit is in the fold
    assert [u["visible"] for i, u in enumerate(folds) if i != opt] == [False] * (n - 1)
    plain = form_updates(groups, raw, {"train.max_grad_norm": ["must be > 0"]}, "")
    assert plain[1 + n + opt]["open"] is True  # an error inside a fold opens it
    assert "open" not in form_updates(groups, raw, {}, "")[1 + n + opt]  # never closed by the form
    # the background data check's answer leaves what is shown alone (a search typed meanwhile), but for an error
    late = form_updates(groups, None, {"train.max_grad_norm": ["must be > 0"]}, seen=None, keep_shown=True)
    assert late[1 + n + opt] == {"__type__": "update", "open": True, "visible": True}
    assert [u for i, u in enumerate(late[1 + n : 1 + 2 * n]) if i != opt] == [{"__type__": "update"}] * (
        n - 1
    )
    assert [x.key for x, u in zip(order, late[1 + 2 * n :]) if "visible" in u] == ["train.max_grad_norm"]
    # the page is told a visibility only where it changes (gradio redraws a field each time it is told one)
    seen = form_updates(groups, raw, {}, "")[-1]
    again = form_updates(groups, raw, {}, "", seen=seen)
    assert not any("visible" in u for u in again[1 + n : -1]) and again[-1] == seen
    lora = {**raw, "method": {"type": "lora"}}
    switched = form_updates(groups, lora, {}, "", seen=seen)
    told = {x.key: u["visible"] for x, u in zip(order, switched[1 + 2 * n : -1]) if "visible" in u}
    assert told.pop("method.qat") is False  # full fine-tuning's QAT goes, the LoRA settings come
    assert told and all(v and k.startswith("method.lora.") for k, v in told.items())


def test_an_edit_tells_its_status_and_the_fields_only_their_news():
    from app.configure_tab import form_news, form_updates, told

    groups = grouped(form_fields())
    n = len(groups)
    order = [x for fs in groups.values() for x in fs]
    raw = parse_yaml((ROOT / "training/recipes/full.yaml").read_text())
    seen = form_updates(groups, raw, {}, "")[-1]
    # nothing shown changes: the status and the tabs' errors, and no news (gr.skip: the form is not redrawn)
    quiet = form_news(groups, raw, {}, "", seen)
    assert quiet[0] == "✔ recipe is valid" and quiet[1 : 1 + n] == [""] * n
    assert quiet[-1] == {"__type__": "update"}
    # an error on a field: the status says it, the news tell the field (the red frame) and what is now seen
    errors = {"train.lr": ["Input should be greater than 0"]}
    news = form_news(groups, raw, errors, "", seen)
    assert news[0].startswith("✘ 1 problem(s)") and "train.lr" in news[0]
    out = told(news[-1])
    assert len(out) == n + len(order) + 1
    helped = {x.key: u for x, u in zip(order, out[n:-1]) if "info" in u}
    assert list(helped) == ["train.lr"] and helped["train.lr"]["elem_classes"] == ["field-error"]
    assert out[-1] != seen and form_news(groups, raw, errors, "", out[-1])[-1] == {"__type__": "update"}
    assert form_news(groups, raw, errors, "", seen)[-1]["n"] != news[-1]["n"]  # each news fires the change


def test_one_fields_edit_sets_its_key_alone_and_leaves_a_broken_yaml_as_typed():
    from app.configure_tab import fields_to_yaml

    text = (ROOT / "training/recipes/grpo.yaml").read_text()
    f = by_key()
    out = fields_to_yaml([f["train.lr"]])(text, 1e-3)
    assert [line for line in out.splitlines() if line not in text.splitlines()] == ["  lr: 0.001"]
    assert (
        fields_to_yaml([f["train.warmup_steps"]])(text, 0) == text
    )  # the default, not set in the YAML: not written
    broken = "train:\n  lr: [1\n"
    assert (
        fields_to_yaml([f["train.lr"]])(broken, 0.5) == broken
    )  # one value is no recipe: the text is the user's
    assert "lr: 0.5" in edit_yaml(
        broken, form_fields(), dict_to_values(form_fields(), {"train": {"lr": 0.5}})
    )


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_yaml_to_form_to_yaml_keeps_the_recipe(recipe):
    fields = form_fields()
    raw = yaml.safe_load(recipe.read_text())
    back = values_to_dict(fields, dict_to_values(fields, raw))
    assert field_errors(back, fields) == {}
    assert Recipe.model_validate(back) == Recipe.model_validate(raw)
    assert (
        "quantization" not in back.get("method", {}) or raw["method"]["type"] == "qlora"
    )  # defaults are left out
    text = to_yaml(back)
    assert list(parse_yaml(text))[0] == "output_dir"  # schema order, like the hand-written recipes


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_an_untouched_form_leaves_the_users_yaml_byte_for_byte(recipe):
    text = recipe.read_text()
    fields = form_fields()
    assert edit_yaml(text, fields, dict_to_values(fields, parse_yaml(text))) == text


def test_a_form_edit_changes_only_its_key_and_keeps_comments_order_and_quotes():
    text = (ROOT / "training/recipes/grpo.yaml").read_text()
    fields = form_fields()
    keys = [f.key for f in fields]
    values = dict_to_values(fields, parse_yaml(text))
    values[keys.index("train.lr")] = 1e-3  # a key the YAML sets
    values[keys.index("train.warmup_steps")] = 7  # a key it does not
    values[keys.index("model.tiled_mlp")] = "true"  # a switch-or-count box
    values[keys.index("precision")] = "no"  # YAML 1.1 would read a bare no as false
    out = edit_yaml(text, fields, values)
    changed = [line for line in out.splitlines() if line not in text.splitlines()]
    # set in place; new keys at the end of their section (precision: the top level)
    assert changed == ["  tiled_mlp: true", "  lr: 0.001", "  warmup_steps: 7", 'precision: "no"']
    assert [line for line in text.splitlines() if line not in out.splitlines()] == ["  lr: 5.0e-4"]
    assert "  pass_reward: 1.0       # the exact answer, alone" in out  # comments where they were
    raw = parse_yaml(out)
    assert raw["precision"] == "no" and raw["model"]["tiled_mlp"] is True and raw["train"]["lr"] == 1e-3
    values[keys.index("rl")] = False  # a section switched off goes, with its comment-bearing keys
    assert "rl" not in parse_yaml(edit_yaml(out, fields, values))
    values[keys.index("model.tiled_mlp")] = "4"
    assert parse_yaml(edit_yaml(out, fields, values))["model"]["tiled_mlp"] == 4


def test_a_cleared_field_removes_its_key_from_the_yaml():
    """lora.yaml sets epochs: max steps typed and epochs cleared leave max_steps alone (`epochs:` null was
    written, and kept the refusal of both until another edit)."""
    text = (ROOT / "training/recipes/lora.yaml").read_text()
    fields = form_fields()
    keys = [f.key for f in fields]
    values = dict_to_values(fields, parse_yaml(text))
    values[keys.index("train.max_steps")] = "20"
    both = edit_yaml(text, fields, values)
    assert "set either train.max_steps or train.epochs" in str(field_errors(parse_yaml(both), fields))
    values[keys.index("train.epochs")] = ""
    out = edit_yaml(both, fields, values)
    assert parse_yaml(out)["train"] == {"lr": 5e-4, "warmup_ratio": 0.05, "batch_size": 8, "max_steps": 20}
    assert field_errors(parse_yaml(out), fields) == {}
    # a key the YAML sets to null goes too when its field is cleared
    nulled = both.replace("epochs: 1", "epochs:")
    assert "epochs" not in parse_yaml(edit_yaml(nulled, fields, values))["train"]


def test_a_form_edit_keeps_the_shape_of_a_list_and_switching_method_drops_the_others_settings():
    text = (ROOT / "training/recipes/lora.yaml").read_text()
    fields = form_fields()
    keys = [f.key for f in fields]
    values = dict_to_values(fields, parse_yaml(text))
    values[keys.index("data.train")] = "data/dates/other.jsonl"  # typed over `train: data/dates/train.jsonl`
    out = edit_yaml(text, fields, values)
    assert "  train: data/dates/other.jsonl\n" in out  # a scalar still, not a block list
    flow = out.replace("train: data/dates/other.jsonl", "train: [a.jsonl, b.jsonl]")
    values[keys.index("data.train")] = "a.jsonl, c.jsonl"
    assert "  train: [a.jsonl, c.jsonl]\n" in edit_yaml(flow, fields, values)  # a flow list stays one
    values[keys.index("data.train")] = "data/dates/other.jsonl"
    values[keys.index("method.type")] = "full"
    full = edit_yaml(out, fields, values)
    assert parse_yaml(full)["method"] == {"type": "full"}  # LoRA's block goes with LoRA
    values[keys.index("train.lr")] = "0.001"  # the next edit: LoRA's hidden widgets do not bring it back
    assert parse_yaml(edit_yaml(full, fields, values))["method"] == {"type": "full"}
    # the method unchanged, a user's YAML keeps what it holds
    kept = full.replace("type: full", "type: full\n  lora: {r: 8}")
    assert parse_yaml(edit_yaml(kept, fields, values))["method"] == {"type": "full", "lora": {"r": 8}}


def test_the_status_names_each_key_once():
    from app.form_state import status_markdown
    from app.recipe_form import errors_plain

    errors = {"data.train": ["data.train: /etc/passwd is outside the workspace /ws"], "train": ["set one"]}
    assert status_markdown(errors) == (
        "✘ 2 problem(s):\n- **data.train**: /etc/passwd is outside the workspace /ws\n- **train**: set one"
    )
    assert errors_plain(errors) == "data.train: /etc/passwd is outside the workspace /ws; train: set one"


def test_a_form_edit_on_text_that_is_not_a_mapping_writes_the_forms_recipe():
    fields = form_fields()
    raw = parse_yaml((ROOT / "training/recipes/lora.yaml").read_text())
    out = edit_yaml("- not\n- a mapping\n", fields, dict_to_values(fields, raw))
    assert parse_yaml(out)["output_dir"] == "runs/lora"


def test_form_values_become_typed_recipe_values():
    fields = form_fields()
    raw = yaml.safe_load((ROOT / "training/recipes/qlora.yaml").read_text())
    values = dict_to_values(fields, raw)
    keys = [f.key for f in fields]
    values[keys.index("method.quantization.bits")] = "8"  # a dropdown sends text
    values[keys.index("train.max_steps")] = "40"  # an optional number is a text box
    values[keys.index("eval.max_batches")] = ""  # empty = not set
    values[keys.index("data.eval")] = "data/dates/test.jsonl, data/dates/train.jsonl"
    values[keys.index("method.lora.target_modules")] = "q_proj, v_proj"
    out = values_to_dict(fields, values)
    assert out["method"]["quantization"]["bits"] == 8
    assert out["train"]["max_steps"] == 40
    assert "max_batches" not in out.get("eval", {})
    assert out["data"]["eval"] == ["data/dates/test.jsonl", "data/dates/train.jsonl"]
    assert out["method"]["lora"]["target_modules"] == ["q_proj", "v_proj"]
    # switching an optional section off drops it
    values[keys.index("model.from_scratch")] = False
    assert "from_scratch" not in values_to_dict(fields, values)["model"]


def test_validation_errors_are_mapped_to_form_keys():
    fields = form_fields()
    raw = yaml.safe_load((ROOT / "training/recipes/pretrain_tiny.yaml").read_text())
    raw["train"]["lr"] = -1
    raw["train"]["lrr"] = 1
    raw["model"]["from_scratch"]["hidden_size"] = 130  # not divisible by 4 heads: a section-level check
    raw["method"] = {"lora": {"target_modules": 5}}
    errors = field_errors(raw, fields)
    assert errors["train.lr"] == ["Input should be greater than 0"]
    assert any("unknown key `train.lrr`" in m for m in errors["train"])
    assert any("divisible" in m for m in errors["model.from_scratch"])
    assert "method.lora.target_modules" in errors  # union error locations fold into the field


def test_malformed_yaml_is_reported_with_its_line():
    with pytest.raises(YamlError, match="line 3, column 2"):
        parse_yaml("train:\n  lr: [1\nx: 2\n")
    with pytest.raises(YamlError, match="mapping"):
        parse_yaml("- a\n- b\n")


def test_paths_must_stay_inside_the_workspace(tmp_path):
    ws = Workspace(tmp_path)
    assert ws.inside("data/x.txt", "data.train") == tmp_path.resolve() / "data/x.txt"
    for bad in ("/etc/passwd", "../outside", "data/../../outside", "~/x"):
        with pytest.raises(PathRefused, match="outside the workspace"):
            ws.inside(bad, "data.train")
    (tmp_path / "link").symlink_to("/etc")
    with pytest.raises(PathRefused, match="outside the workspace"):
        ws.inside("link/passwd", "data.train")
    with pytest.raises(PathRefused, match="outside the workspace"):
        ws.inside("recipes/x", "output_dir", under="runs")
    raw = {
        "output_dir": "/tmp/elsewhere",
        "model": {"name_or_path": "bundled:smollm2-135m-instruct"},
        "data": {"train": ["data/ok.jsonl", "/etc/passwd"]},
        "resume": "auto",
    }
    problems = recipe_refusals(ws, raw)
    assert list(problems) == ["output_dir", "data.train"]
    assert problems["data.train"][0].startswith("data.train: /etc/passwd is outside the workspace")
    for bad in ("../x", "a/b", "", ".hidden"):
        with pytest.raises(PathRefused):
            check_name(bad, "save as")


# Two launchable recipes that between them set every path field of the schema, each inside the workspace.
PATHS_SET = [
    {
        "output_dir": "runs/a",
        "resume": "runs/old",
        "model": {"name_or_path": "models/base", "tokenizer": "models/tok"},
        "data": {
            "train": ["data/t.jsonl"],
            "eval": ["data/e.jsonl"],
            "cache_dir": "cache",
            "chat_template": "data/t.jinja",
        },
        "method": {"type": "lora", "lora": {"init_from": "runs/old"}},
    },
    {
        "output_dir": "runs/b",
        "model": {"from_scratch": {}, "train_tokenizer": {"files": ["data/t.txt"]}},
        "data": {"train": ["data/t.txt"], "format": "text"},
    },
    {
        "output_dir": "runs/c",
        "model": {"name_or_path": "models/base"},
        "data": {"train": ["data/t.jsonl"]},
        "distill": {"teacher": "models/teacher"},
    },
    {
        "output_dir": "runs/d",
        "model": {"name_or_path": "models/base"},
        "data": {"train": [{"path": ["data/t.jsonl"]}]},
        "train": {"max_steps": 2},
    },
    {
        "output_dir": "runs/e",
        "model": {"name_or_path": "models/base"},
        "data": {"train": ["data/p.jsonl"], "format": "prompts"},
        "method": {"type": "lora"},
        "rl": {"rewards": [{"function": "reward_model", "args": {"path": "models/rm"}}]},
    },
]


def _lookup(raw: dict, key: str):
    """The value at a `path_fields` key; `name[]` is the list's first item."""
    for part in key.split("."):
        raw = raw.get(part.removesuffix("[]")) if isinstance(raw, dict) else None
        if part.endswith("[]"):
            raw = raw[0] if isinstance(raw, list) and raw else None
    return raw


def test_the_schema_marks_every_path_field():
    keys = {key for key, _ in path_fields()}
    assert keys == {
        "output_dir",
        "resume",
        "model.name_or_path",
        "model.tokenizer",
        "model.train_tokenizer.files",
        "data.train",
        "data.train[].path",
        "data.eval",
        "data.cache_dir",
        "data.chat_template",
        "method.lora.init_from",
        "distill.teacher",
        "rl.rewards[].args.path",
    }


def test_the_schema_marks_every_code_field():
    assert {key for key, _ in code_fields()} == {"rl.rewards[].function", "rl.tools", "rl.environment"}


@pytest.mark.parametrize("key", [key for key, _ in path_fields()])
def test_every_path_field_is_confined_to_the_workspace(tmp_path, key):
    """Walks the schema: each path field, set outside the workspace, is refused with the key named."""
    (tmp_path / "ws").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "ws/link").symlink_to(tmp_path / "outside")
    ws = Workspace(tmp_path / "ws")
    base = next((r for r in PATHS_SET if _lookup(r, key) is not None), None)
    assert base is not None, f"add {key} to PATHS_SET: every path field needs a case"
    raw, run_dir = checked_recipe(ws, yaml.safe_dump(base))  # launchable as it is
    assert run_dir.is_relative_to(ws.runs)
    for bad in (str(tmp_path / "outside/x"), "../outside/x", "link/x"):
        recipe = yaml.safe_load(yaml.safe_dump(base))
        *parents, leaf = key.split(".")
        section = _lookup(recipe, ".".join(parents)) if parents else recipe
        section[leaf] = [bad] if isinstance(section[leaf], list) else bad
        named = re.escape(key.replace("[]", "[0]"))
        with pytest.raises(RecipeRefused, match=f"refused: {named}: {bad} is outside the workspace"):
            checked_recipe(ws, yaml.safe_dump(recipe))


def test_chat_sources_list_finals_exports_complete_checkpoints_newest_first_and_models(tmp_path):
    ws = Workspace(tmp_path)
    run = RunDir(ws.runs / "r")
    run.final.mkdir(parents=True)
    for step in (2, 10, 5):
        run.checkpoint(step).mkdir(parents=True)
        if step != 5:  # step 5 is incomplete: not listed
            (run.checkpoint(step) / CHECKPOINT_MARKER).touch()
            (run.checkpoint(step) / CHECKPOINT_STATE).write_text("{}")
    (tmp_path / "models/m").mkdir(parents=True)
    (tmp_path / "models/m" / MODEL_CONFIG).write_text("{}")
    (tmp_path / "models/empty").mkdir()
    run.merged.mkdir()  # the Export tab's merge and GGUF: offered as soon as they exist
    (run.merged / MODEL_CONFIG).write_text("{}")
    run.gguf.parent.mkdir()
    run.gguf.write_bytes(b"GGUF")
    assert ws.chat_sources(ws.run_dirs()) == [
        ws.rel(run.final),
        "runs/r/merged",
        "runs/r/gguf/model.gguf",
        ws.rel(run.checkpoint(10)),
        ws.rel(run.checkpoint(2)),
        "models/m",
        *BUNDLED_MODELS,
    ]


def test_launch_argv_is_a_list_naming_the_backend(tmp_path):
    ws = Workspace(tmp_path)
    assert launch_argv(ws, "runs/a/recipe.yaml", PYTHON_BACKEND, 1) == [
        sys.executable,
        "-m",
        "training.train",
        "runs/a/recipe.yaml",
    ]
    argv = launch_argv(ws, "runs/a/recipe.yaml", "ddp", 2)
    assert argv[argv.index("--config_file") + 1].endswith("accelerate_configs/ddp.yaml")
    assert argv[argv.index("--num_processes") + 1] == "2"
    assert argv[-3:] == ["-m", "training.train", "runs/a/recipe.yaml"] and "launch" in " ".join(argv[:3])
    with pytest.raises(LaunchRefused, match="backend"):
        launch_argv(ws, "r.yaml", "nope", 1)
    with pytest.raises(LaunchRefused, match="one process"):
        launch_argv(ws, "r.yaml", PYTHON_BACKEND, 2)


def test_backend_picker_offers_mesh_files_with_the_process_count_they_need(tmp_path, monkeypatch):
    import shutil

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    ws = Workspace(tmp_path)
    shutil.copytree(ROOT / "accelerate_configs", tmp_path / "accelerate_configs")
    backends = ws.backends()
    assert {
        n: default_processes(b)
        for n, b in backends.items()
        if n in ("single", "ddp", "tp", "fsdp_tp", "hsdp")
    } == {
        "single": 1,
        "ddp": 2,
        "tp": 2,
        "fsdp_tp": 4,
        "hsdp": 4,
    }
    assert backend_label("fsdp_tp", backends["fsdp_tp"]) == "fsdp_tp (mesh dp_shard=2 x tp=2: 4 processes)"
    assert backend_label("ddp", backends["ddp"]) == "ddp" and default_processes(None) == 1
    # the command shown is the command accelerate accepts, from the workspace root, with the mesh's count
    recipe = yaml.safe_dump({"output_dir": "runs/tp", "model": {"name_or_path": "m"}, "data": {"train": "d"}})
    shown = launch_command(ws, recipe, "tp", 2)
    assert shown.splitlines()[0] == f"cd {tmp_path}"
    assert (
        "launch --config_file accelerate_configs/tp.yaml --num_processes 2 -m training.train runs/tp/recipe.yaml"
        in shown
    )
    argv = launch_argv(ws, "runs/tp/recipe.yaml", "tp", 2)
    monkeypatch.chdir(tmp_path)  # where the app runs it
    args, _, _ = _validate_launch_command(
        launch_command_parser().parse_args(argv[argv.index("--config_file") :])
    )
    assert args.num_processes == 2 and args.parallelism_config_tp_size == 2 and args.use_parallelism_config
    with pytest.raises(LaunchRefused, match="on exactly 4 processes; set Processes to 4"):
        launch_argv(ws, "r.yaml", "fsdp_tp", 2)
    assert launch_command(ws, recipe, "hsdp", 2).startswith("# cannot launch: number of processes: hsdp runs")
    (tmp_path / "accelerate_configs/bad.yaml").write_text("parallelism_config: {tp_size: 2}\n")
    with pytest.raises(LaunchRefused, match="spell it parallelism_config_tp_size"):
        launch_argv(ws, "r.yaml", "bad", 2)
    # the page builds with the labelled choices; picking a mesh file proposes its process count
    demo = build_app(ws)
    (picker,) = [
        b for b in demo.blocks.values() if isinstance(b, gr.Dropdown) and b.label.startswith("Backend")
    ]
    assert ("tp (mesh tp=2: 2 processes)", "tp") in picker.choices and picker.value == PYTHON_BACKEND


def _fake_run(ws: Workspace, name: str, pid: int, status: dict | None, rows=(), returncode=None) -> RunRecord:
    run = RunDir(ws.runs / name)
    run.root.mkdir(parents=True)
    if status is not None:
        run.status.write_text(json.dumps(status))
    run.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run.root / LOG).write_text("line 1\nline 2\ntrain:  10%|#| 1/10\rtrain:  20%|##| 2/10\n")
    return RunRecord(
        name=name,
        run_dir=f"runs/{name}",
        pid=pid,
        start_time=proc_start_time(pid),
        argv=["x"],
        backend=PYTHON_BACKEND,
        num_processes=1,
        started=time.time(),
        returncode=returncode,
    )


def test_run_states_come_from_the_process_and_the_run_directory(tmp_path):
    ws = Workspace(tmp_path)
    mgr = RunRegistry(ws)
    views = RunViews(mgr)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        rows = [
            {"step": s, "total_steps": 10, "loss": 5.0 - s * 0.1, "elapsed_s": 2.0 * s, "mfu": 0.01 * s}
            for s in (1, 2)
        ] + [{"step": 2, "eval_loss": 4.5}]
        records = [
            _fake_run(ws, "live", sleeper.pid, {"state": "running", "step": 2, "total_steps": 10}, rows),
            _fake_run(ws, "done", dead.pid, {"state": "finished", "step": 10, "total_steps": 10}),
            _fake_run(ws, "halted", dead.pid, {"state": "stopped", "step": 4, "total_steps": 10}),
            _fake_run(ws, "crashed", dead.pid, {"state": "running", "step": 3, "total_steps": 10}),
            _fake_run(
                ws, "lost", dead.pid, {"state": "failed", "step": 4, "reason": "lost a peer in step 5: ..."}
            ),
            _fake_run(ws, "bad", dead.pid, None, returncode=2),
            # exited 2 under the app, then resumed from the command line: the directory is newer
            _fake_run(ws, "redone", dead.pid, {"state": "finished", "time": time.time() + 1}, returncode=2),
        ]
        records[-1].ended = time.time()
        mgr._save(records)
        names = ("live", "done", "halted", "crashed", "lost", "bad", "redone")
        states = {name: views.view(name).state for name in names}
        assert states == {
            "live": "running",
            "done": "finished",
            "halted": "stopped",
            "crashed": "failed",
            "lost": "failed",
            "bad": "failed",
            "redone": "finished",
        }
        live = views.view("live")
        assert (live.step, live.total_steps, live.loss, live.eval_loss) == (2, 10, 4.8, 4.5)
        assert live.remaining_s == pytest.approx(2.0 * 8)  # 2 s per step, 8 steps to go
        assert live.mfu == 0.02  # the last training row's
        assert "exit code 2" in views.view("bad").message
        assert views.view("lost").message == "lost a peer in step 5: ..."  # the run's own reason
        assert mgr.active().name == "live"
        with pytest.raises(LaunchRefused, match="'live' .* still running"):
            mgr.start("x: 1", ws.runs / "other", PYTHON_BACKEND, 1)
        tail = views.log_tail("live")  # a tqdm bar redrawn with \r shows its last state only
        assert tail.splitlines()[-2:] == ["line 2", "train:  20%|##| 2/10"] and "10%" not in tail
        assert [row[:2] for row in views.table()][:2] == [["redone", "finished"], ["bad", "failed"]]
        # a recycled pid (same number, different process start time) is not the run
        recs = mgr.records()
        recs[0].start_time = "1"
        mgr._save(recs)
        assert views.view("live").state == "failed" and mgr.active() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_remaining_time_is_the_trainers_own_after_a_resume_and_with_sparse_rows():
    """status.json carries the trainer's clock (written every step): the view shows its step even when the
    last metrics row is older (log_every > 1), its elapsed time over every attempt, and its estimate counted
    down since it was written, not a guess from rows that assume one row a step and no resume."""
    from app.run_views import run_clock

    rows = [{"step": 5, "total_steps": 20, "loss": 1.0, "elapsed_s": 30.0}]  # resumed at 4, logged every 5
    status = {"state": "running", "step": 7, "total_steps": 20, "time": time.time() - 2.0}
    status |= {"elapsed_s": 130.0, "remaining_s": 182.0}  # the bar: 13 s a step, 13 steps to go
    elapsed, remaining = run_clock(status, rows, "running", 7, 20, True)
    assert 131.9 < elapsed < 133 and 179 < remaining <= 180.1  # counted on since written
    old = run_clock({"state": "running"}, rows, "running", 7, 20, True)  # a trainer that does not say
    assert old == (30.0, pytest.approx(130.0))  # 30 s over "3 steps" (7 - 5 + 1): the old guess
    assert run_clock(status | {"state": "stopped"}, rows, "stopped", 7, 20, True) == (130.0, None)
    text = progress_markdown(RunView(name="r", state="running", step=7, total_steps=20, rows=rows))
    assert "step **7 / 20** (35%) `" + "█" * 8 + "░" * 16 + "`" in text


def test_progress_shows_tokens_per_s_and_mfu_when_known():
    running = dict(name="r", state="running", step=2, total_steps=10, rows=[{"step": 2}])
    text = progress_markdown(RunView(**running, tokens_per_s=1234.0, mfu=0.123))
    assert "1234 tokens/s" in text and "MFU 12.3%" in text
    assert "MFU" not in progress_markdown(RunView(**running, tokens_per_s=1234.0))  # an unlisted GPU


def test_the_run_chart_draws_train_and_eval_with_whole_steps_and_rewards_below_for_rl_runs():
    assert run_figure([]) is None
    rows = [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3)] + [{"step": 3, "eval_loss": 4.5}]
    fig = run_figure(rows)
    (ax,) = fig.axes  # a supervised run: the loss panel only
    assert [line.get_label() for line in ax.get_lines()] == ["train", "eval"]
    assert [line.get_linestyle() for line in ax.get_lines()] == ["-", "--"]
    fig.canvas.draw()  # tick positions are chosen at draw time
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)  # three steps: no step 1.5 on the axis
    rl = run_figure([{"step": 1, "loss": 0.1, "reward": -0.3}, {"step": 2, "loss": 0.1, "eval_reward": 0.5}])
    assert [a.get_ylabel() for a in rl.axes] == ["loss", "reward"]
    assert [line.get_label() for line in rl.axes[1].get_lines()] == ["reward", "eval reward"]
    # the optimizer's figures of metrics.jsonl: a panel each, below the loss, unnamed by a legend of one series
    rows = [{"step": s, "loss": 5.0 - s, "grad_norm": 1.5 / s, "lr": 1e-3 * s} for s in (1, 2, 3)]
    fig = run_figure([{"step": 0, "eval_loss": 6.0}, *rows])
    assert [a.get_ylabel() for a in fig.axes] == ["loss", "grad norm", "learning rate"]
    assert [list(line.get_ydata()) for line in fig.axes[2].get_lines()] == [[1e-3, 2e-3, 3e-3]]
    assert fig.axes[0].get_legend() is not None and fig.axes[1].get_legend() is None


def test_export_and_evaluate_commands_are_argv_lists_for_the_real_clis():
    py = sys.executable
    assert export_argv("runs/a", "merge") == [py, "-m", "training.export", "runs/a", "--merge"]
    assert export_argv("runs/a", "gguf", outtype="q8_0") == [
        py, "-m", "training.export", "runs/a", "--gguf", "--outtype", "q8_0",
    ]  # fmt: skip
    assert export_argv("runs/a", "push", repo=" org/m ", private=True) == [
        py, "-m", "training.export", "runs/a", "--push-to-hub", "org/m", "--private",
    ]  # fmt: skip
    assert export_argv("runs/a", "push", repo="org/m")[-1] == "org/m"
    with pytest.raises(LaunchRefused, match="ORG/NAME"):
        export_argv("runs/a", "push", repo=" ")
    assert evaluate_argv("runs/a", " dates_exact_match, other ", 5) == [
        py, "-m", "training.evaluate", "runs/a", "--tasks", "dates_exact_match,other", "--limit", "5",
    ]  # fmt: skip
    assert evaluate_argv("runs/a", "t")[-2:] == ["--tasks", "t"]
    assert evaluate_argv("runs/a", "t", " 7 ")[-2:] == ["--limit", "7"]  # the page's text box
    assert evaluate_argv("runs/a", "t", "")[-2:] == ["--tasks", "t"]  # empty: all
    for bad in ("0", "-3", "ten", "2.5"):
        with pytest.raises(
            LaunchRefused, match=f"evaluate: limit: '{re.escape(bad)}' is not a number of examples"
        ):
            evaluate_argv("runs/a", "t", bad)
    with pytest.raises(LaunchRefused, match="task"):
        evaluate_argv("runs/a", " , ")


def _wait_for(what: str, fn, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (value := fn()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _endpoint(demo: gr.Blocks, api_name: str):
    return next(fn.fn for fn in demo.fns.values() if fn.api_name == api_name)


def test_the_export_tab_says_the_gguf_size_before_and_what_a_job_wrote_after(
    tmp_path, smollm2_tiny_model_dir
):
    import shutil

    from transformers import AutoModelForCausalLM

    from app.export_size import gguf_estimate, parameters
    from app.jobs import Job, job_markdown

    ws = Workspace(tmp_path)
    run = RunDir(ws.runs / "demo")
    shutil.copytree(smollm2_tiny_model_dir, run.final)
    n = AutoModelForCausalLM.from_pretrained(run.final).num_parameters()
    assert sum(parameters(run.final)) == n  # from the safetensors headers, nothing loaded
    # llama.cpp's converter writes 8,227,040 bytes for this model in f16 (the browser walk exports it)
    f16, q8 = gguf_estimate(run.root, "f16"), gguf_estimate(run.root, "q8_0")
    assert f16 == "GGUF (f16): about **8.2 MB** (3.2M parameters, and the tokenizer)"
    assert q8.startswith("GGUF (q8_0): about **5.") and "3.2M parameters" in q8  # 34 bytes a block of 32
    (run.final / "adapter_config.json").write_text("{}")
    assert "base model" in gguf_estimate(run.root, "f16") and parameters(run.final) is None
    run.gguf.parent.mkdir()
    run.gguf.write_bytes(b"x" * 1_234_567)
    job = Job("20261129-000000-gguf", "runs/demo", "gguf", ["x"], 0.0, state="done", returncode=0)
    assert job_markdown(ws, job, 0).endswith(": wrote `runs/demo/gguf/model.gguf`, **1.2 MB**")
    job.state, job.returncode = "failed", 1
    assert "wrote" not in job_markdown(ws, job, 0)


def test_evaluate_from_the_page_is_a_background_job_with_its_log_in_the_run(tmp_path):
    """The Evaluate button queues `python -m training.evaluate` on the picked run and returns at once; the
    job's output and state land in <run>/jobs/ and job_status reports its exit (2: the run has no model yet)."""
    ws = Workspace(tmp_path)
    run = _made_outside(ws, "cli", {"state": "stopped", "step": 3})  # neither final/ nor a checkpoint
    demo = build_app(ws)
    command, queued = _endpoint(demo, "evaluate")("cli", "dates_exact_match", None)
    assert "-m training.evaluate runs/cli --tasks dates_exact_match" in command
    assert "**evaluate**" in queued and ("queued" in queued or "running" in queued)
    status = _endpoint(demo, "job_status")
    done = _wait_for("the job to end", lambda: (s := status("cli"))["state"] in ("done", "failed") and s)
    assert done["state"] == "failed" and done["returncode"] == 2
    assert "neither final/ nor a complete checkpoint" in done["output"]
    (log,) = (run.root / "jobs").glob("*-evaluate.log")
    assert done["log"] == ws.rel(log) and "neither final/" in log.read_text()
    with pytest.raises(gr.Error, match="no run named 'nope'"):
        _endpoint(demo, "evaluate")("nope", "dates_exact_match", None)
    with pytest.raises(gr.Error, match="ORG/NAME"):
        _endpoint(demo, "export_push")("cli", "f16", " ", False)


def test_jobs_run_one_at_a_time_in_order_and_survive_the_app(tmp_path):
    ws = Workspace(tmp_path)
    a, b = _made_outside(ws, "a", {"state": "finished"}), _made_outside(ws, "b", {"state": "finished"})
    release = tmp_path / "release"
    # waits for `release` (at most 120 s, so a failed test leaves no process behind for long)
    wait = (
        f"import os, time\nprint('fi' + 'rst', flush=True)\nend = time.time() + 120\n"
        f"while not os.path.exists({str(release)!r}) and time.time() < end: time.sleep(0.02)"
    )
    jobs = JobQueue(ws, lambda: [a.root, b.root])
    first = jobs.submit(a.root, "gguf", [sys.executable, "-c", wait])
    second = jobs.submit(b.root, "merge", [sys.executable, "-c", "print('second')"])
    third = jobs.submit(b.root, "merge", [sys.executable, "-c", "raise SystemExit(3)"])
    assert second.id != third.id  # the same action on the same run in the same second
    _wait_for(  # its output, not its command, and the state the worker writes once the process started
        "the first job to start",
        lambda: (
            "first" in jobs.log_tail(first) and {j.key: j.state for j in jobs.jobs()}[first.key] != "queued"
        ),
    )
    states = {j.key: j.state for j in jobs.jobs()}
    assert [states[j.key] for j in (first, second, third)] == ["running", "queued", "queued"]
    assert jobs.waiting_before(third) == 2 and jobs.latest(b.root).key == third.key  # newest first
    # a second app instance (a restart) sees the job running, from its files
    assert JobQueue(ws, lambda: [a.root]).jobs()[0].state == "running"
    release.touch()
    _wait_for("the queue to drain", lambda: jobs.latest(b.root).state == "failed")
    done = {j.key: j for j in jobs.jobs()}
    assert [done[j.key].state for j in (first, second, third)] == ["done", "done", "failed"]
    assert done[third.key].returncode == 3 and "second" in jobs.log_tail(done[second.key])
    assert done[first.key].finished <= done[second.key].started  # one at a time, in order
    # a job whose process ended while no app watched it: its exit code is unknown
    stale = json.loads(first.path(ws, ".json").read_text()) | {"state": "running", "pid": 2**22 + 7}
    first.path(ws, ".json").write_text(json.dumps(stale))
    assert next(j for j in jobs.jobs() if j.key == first.key).state == "ended"


def test_run_tab_lists_tracker_dirs_and_eval_results(tmp_path):
    ws = Workspace(tmp_path)
    run = RunDir(tmp_path / "runs" / "a")
    (run.root / "tensorboard" / "a").mkdir(parents=True)
    (run.root / "mlruns").mkdir()
    assert eval_markdown(run) == ""
    text = tracker_markdown(ws, run)
    assert "TensorBoard: `runs/a/tensorboard`" in text and "MLflow: `runs/a/mlruns`" in text
    assert "Weights" not in text  # only the directories that exist
    run.eval_results.write_text(
        json.dumps({"tasks": {"dates_exact_match": {"metrics": {"exact_match,none": 0.5}, "n": 4}}})
    )
    assert "dates_exact_match: exact_match 0.5000 (n=4" in eval_markdown(run)


def test_a_run_directory_held_by_a_run_started_elsewhere_is_refused(tmp_path):
    """A run started from the command line holds its output_dir (training.run.lock): the app names it
    instead of starting a second run there; once that holder is gone the directory is free."""
    ws = Workspace(tmp_path)
    mgr = RunRegistry(ws)
    held = ws.runs / "cli-run"
    code = (
        "import sys, time; from training.run.lock import RunLock\n"
        f"lock = RunLock({str(held)!r}, ['accelerate', 'launch', '-m', 'training.train', 'r.yaml'])\n"
        "lock.acquire()\n"
        "print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            LaunchRefused,
            match=rf"runs/cli-run is in use by a live run \(pid {holder.pid} on \S+, started [0-9: -]+: accelerate launch",
        ):
            mgr.start("x: 1", held, PYTHON_BACKEND, 1)
    finally:
        holder.kill()
        holder.wait()
    from training.run.lock import is_held

    assert not is_held(held)


def test_rl_runs_plot_their_rewards_and_show_the_latest_samples():
    from app.samples import samples_markdown

    rows = [{"step": 1, "loss": 0.1, "reward": -0.3}, {"step": 2, "eval_reward": 0.5, "eval_pass_rate": 0.25}]
    assert reward_points(rows) == [
        {"step": 1, "value": -0.3, "series": "reward"},
        {"step": 2, "value": 0.5, "series": "eval reward"},
    ]
    assert loss_points(rows) == [{"step": 1, "value": 0.1, "series": "train"}]
    assert reward_points([{"step": 1, "loss": 0.5}]) == []  # supervised runs: no reward panel
    md = samples_markdown(
        [{"step": 7, "prompt": "What is 2 + 2?", "completion": "4 | four", "reward": 1.5, "advantage": 0.25}]
    )
    assert "Samples of step 7" in md and "| What is 2 + 2? | 4 \\| four | 1.500 | +0.250 |" in md
    assert samples_markdown([]) == ""


def test_agent_episodes_show_as_conversations_with_tool_calls_and_results_as_sections():
    from app.chat_messages import TOOL_CALL, TOOL_RESULT
    from app.samples import episode_messages

    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "12 * 34"}}}
    sample = {
        "step": 3,
        "row": 5,
        "prompt": [{"role": "user", "content": "What is 12 * 34?"}],
        "completion": "408",
        "reward": 1.0,
        "advantage": 0.5,
        "messages": [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculate", "content": "408"},
            {"role": "assistant", "content": "408"},
        ],
    }
    shown = episode_messages(
        [sample, {**sample, "messages": None}]
    )  # a single-reply sample is not an episode
    titles = [(m["role"], (m.get("metadata") or {}).get("title")) for m in shown]
    assert titles == [
        ("user", "Episode 1 (step 3, row 5)"),
        ("assistant", TOOL_CALL + "calculate"),
        ("user", TOOL_RESULT + "calculate"),
        ("assistant", None),
        ("assistant", "Scored"),
    ]
    assert shown[0]["content"] == "What is 12 * 34?" and '"expression": "12 * 34"' in shown[1]["content"]
    assert shown[2]["content"] == "408" and shown[4]["content"] == "reward 1.000, advantage +0.500"
    assert episode_messages([{**sample, "messages": None}]) == []


# ---------------------------------------------------------------------------- runs made outside the app

# A trainer as the lock sees it: holds output_dir's run.lock (as training.train does, writing its pid, host,
# start and command), and on SIGTERM writes status "stopped" and waits for a line on stdin before it exits.
FAKE_TRAINER = """
import json, signal, sys
from training.run.lock import RunLock
run_dir = sys.argv[1]
lock = RunLock(run_dir, ["accelerate", "launch", "-m", "training.train", "r.yaml"])
lock.acquire()
class Stop(Exception):
    pass
def stop(*_):
    raise Stop
signal.signal(signal.SIGTERM, stop)
try:  # "held" inside: the test's SIGTERM may land while print is still returning
    print("held", flush=True)
    sys.stdin.readline()
except Stop:
    open(run_dir + "/status.json", "w").write(json.dumps({"state": "stopped", "step": 3, "total_steps": 10}))
    print("stopping", flush=True)
    sys.stdin.readline()
"""


def _made_outside(ws: Workspace, name: str, status: dict, final: bool = False) -> RunDir:
    """A run directory as `accelerate launch -m training.train` (or `make demo`) leaves it: no registry entry."""
    run = RunDir(ws.runs / name)
    run.root.mkdir(parents=True)
    run.config.write_text("output_dir: x\n")
    run.status.write_text(json.dumps(status))
    rows = [{"step": s, "total_steps": 10, "loss": 3.0 - s * 0.1, "elapsed_s": 1.0 * s} for s in (1, 2, 3)]
    run.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if final:
        run.final.mkdir()
        (run.final / MODEL_CONFIG).write_text("{}")
    return run


def _fake_trainer(run: RunDir, **popen) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", FAKE_TRAINER, str(run.root)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        **popen,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def _on_load(demo: gr.Blocks) -> dict:
    """What the page's load events that take no input put into each component, by label (the pickers' choices)."""
    out = {}
    for fn in demo.fns.values():
        if any(event == "load" for _, event in fn.targets) and not fn.inputs:
            values = fn.fn()
            values = values if isinstance(values, tuple) else (values,)
            out |= {block.label: value for block, value in zip(fn.outputs, values)}
    return out


def test_a_run_made_outside_the_app_is_listed_in_the_table_the_pickers_and_chat(tmp_path):
    ws = Workspace(tmp_path)
    demo_run = _made_outside(ws, "demo", {"state": "finished", "step": 10, "total_steps": 10}, final=True)
    _made_outside(ws, "sweep/lr-3e-4", {"state": "stopped", "step": 3, "total_steps": 10})  # runs/GROUP/NAME
    (ws.runs / "notes").mkdir()  # not a run: nothing training writes
    (ws.runs / "notes/todo.txt").write_text("x")
    (ws.runs / ".tmp-copy" / "final").mkdir(parents=True)  # hidden: skipped
    (ws.runs / "model" / MODEL_CONFIG).parent.mkdir()
    (ws.runs / "model" / MODEL_CONFIG).write_text("{}")  # a model directory is not a run
    mgr = RunRegistry(ws)
    views = RunViews(mgr)
    assert sorted(f.name for f in mgr.runs()) == ["demo", "sweep/lr-3e-4"]
    rows = {row[0]: row for row in views.table()}
    assert rows["demo"][1:5] == ["finished", "10/10", "2.7000", "command line"]
    assert rows["sweep/lr-3e-4"][1] == "stopped" and "resume" in views.view("sweep/lr-3e-4").message
    assert mgr.active() is None

    shown = _on_load(build_app(ws))
    assert (
        set(shown["Run"]["choices"]) == set(shown["Run (runs/...)"]["choices"]) == {"demo", "sweep/lr-3e-4"}
    )
    assert ws.rel(demo_run.final) in shown["Model A"]["choices"]
    assert views.log_tail("demo").startswith("(started outside the app")
    # a long run: the table reads only the end of metrics.jsonl, and still shows its latest step
    rows = [{"step": s, "total_steps": 5000, "loss": 1.0 + 1 / s, "lr": 1e-4} for s in range(1, 5001)]
    demo_run.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    demo_run.status.write_text(json.dumps({"state": "finished", "step": 5000}))
    assert {row[0]: row for row in views.table()}["demo"][2:4] == ["5000/5000", "1.0002"]


def test_a_run_held_by_a_live_process_is_running_stops_on_stop_and_fails_when_killed(tmp_path):
    """State from the directory alone: run.lock held -> running (the device is busy, Stop signals the
    holder); status still "running" after the holder is killed -> failed."""
    ws = Workspace(tmp_path)
    mgr = RunRegistry(ws)
    views = RunViews(mgr)
    run = _made_outside(ws, "cli", {"state": "running", "step": 3, "total_steps": 10})
    trainer = _fake_trainer(run)
    try:
        assert views.view("cli").state == "running" and mgr.active().name == "cli"
        assert [row[:3] for row in views.table()] == [["cli", "running", "3/10"]]
        with pytest.raises(LaunchRefused, match=rf"'cli' \(pid {trainer.pid}\) is still running"):
            mgr.start("x: 1", ws.runs / "other", PYTHON_BACKEND, 1)
        # not a group leader (it shares pytest's group): the holder alone is signalled
        assert f"SIGTERM to pid {trainer.pid}" in mgr.stop("cli")
        assert trainer.stdout.readline().strip() == "stopping"
        assert views.view("cli").state == "stopping"
        trainer.stdin.write("\n")
        trainer.stdin.flush()
        assert trainer.wait(30) == 0
        assert views.view("cli").state == "stopped" and mgr.active() is None
        assert mgr.stop("cli") == "run 'cli' is not running"

        run.status.write_text(json.dumps({"state": "running", "step": 4, "total_steps": 10}))  # resumed ...
        trainer = _fake_trainer(run, start_new_session=True)
        assert views.view("cli").state == "running"  # a new holder: not the one Stop signalled
        trainer.kill()  # ... and killed: status.json still says running, nobody holds the lock
        trainer.wait()
        failed = views.view("cli")
        assert failed.state == "failed" and "killed" in failed.message and failed.step == 4
    finally:
        trainer.kill()
        trainer.wait()


def test_a_restarted_app_finds_the_runs_the_old_one_started(tmp_path, monkeypatch):
    """A new RunRegistry (the app after a restart) lists a run the old one started, shows it running while
    its process lives, streams its metrics, and shows it ended once it is gone."""
    ws = Workspace(tmp_path)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]  # a run still loading its model
    monkeypatch.setattr("app.runs.launch_argv", lambda *a: sleeper)
    old = RunRegistry(ws)
    rec = old.start("x: 1", ws.runs / "mine", PYTHON_BACKEND, 1)
    child = old._children[rec.pid]
    try:
        new = RunRegistry(ws)
        new_views = RunViews(new)
        assert [f.name for f in new.runs()] == ["mine"] and new_views.view("mine").state == "running"
        assert new.active().name == "mine"
        RunDir(ws.runs / "mine").metrics.write_text(json.dumps({"step": 1, "loss": 2.5}) + "\n")
        assert (new_views.view("mine").step, new_views.view("mine").loss) == (1, 2.5)
        row = new_views.table()[0]
        assert row[:2] == ["mine", "running"] and row[4] == f"{PYTHON_BACKEND} x1"
        # its own session: the group is the run's, and Stop signals it from the new app too
        assert f"SIGTERM to process group {rec.pid}" in new.stop("mine")
        assert child.wait(30) == -15
        assert new_views.view("mine").state == "failed" and new.active() is None
    finally:
        child.kill()
        child.wait()


def test_the_chat_tab_renders_a_runs_prompts_with_its_template_variables(tmp_path):
    """A run trained with data.chat_template_kwargs {enable_thinking: false} is chatted with the same way in
    the Chat tab: its template here refuses to render unless enable_thinking is false."""
    from app.chat_models import ChatModels
    from training.run.sources import pretrained_source

    ws = Workspace(tmp_path)
    run = ws.runs / "thinker"
    run.mkdir(parents=True)
    (run / "final").symlink_to(pretrained_source("bundled:smollm2-135m-instruct"), target_is_directory=True)
    (run / "config.yaml").write_text(
        yaml.safe_dump({"data": {"chat_template_kwargs": {"enable_thinking": False}}})
    )
    models = ChatModels(ws)
    said = models.load("A", "runs/thinker")  # its final/ (here a link to the bundled model)
    assert said.endswith("chat template variables from its recipe: enable_thinking=False")
    models.slots["A"].tokenizer.chat_template = (
        "{% if enable_thinking is not defined or enable_thinking %}{{ raise_exception('thinking on') }}{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    reply = list(models.stream("A", [{"role": "user", "content": "Hi"}], 2, 0.0, 1.0))
    assert reply  # rendered (with thinking on, the template would have raised)
    models.unload()


def test_the_chat_tab_gives_a_picture_to_an_image_text_model_and_refuses_one_for_a_text_model(
    tmp_path, tiny_model_dir
):
    """A model.vision run's final/ (a tiny composed model saved with its processor) answers with a picture;
    the picture's placeholder goes before the first user message, where training put it; a text-only model
    given a picture is refused naming its slot, and the turn is undone."""
    import torch

    from app.chat_models import ChatModels
    from app.chat_tab import chat_turn
    from conftest import ROOT, TINY_ARCH, TOKENIZER
    from training.data import load_tokenizer
    from training.data.images import image_processor
    from training.generation import with_image
    from training.model.build import build_model
    from training.model.vision import processor_for

    ws = Workspace(tmp_path)
    vision = {"image_size": 32, "patch_size": 8, "hidden_size": 32, "intermediate_size": 64}
    vision |= {"num_hidden_layers": 1, "num_attention_heads": 2}
    recipe = parse_recipe(
        {
            "output_dir": str(ws.runs / "pics"),
            "model": {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH), "vision": vision},
            "data": {"train": "x.jsonl"},
        }
    )
    tok = load_tokenizer(recipe.model)
    final = ws.runs / "pics" / "final"
    build_model(recipe, tok, torch.device("cpu")).save_pretrained(final)
    processor_for(recipe, tok, image_processor(32)).save_pretrained(final)
    (ws.runs / "text").mkdir(parents=True)
    (ws.runs / "text" / "final").symlink_to(tiny_model_dir, target_is_directory=True)
    for run in ("pics", "text"):
        (ws.runs / run / "config.yaml").write_text(yaml.safe_dump({"data": {}}))
    models = ChatModels(ws)
    assert not models.takes_pictures  # the Chat tab offers no picture to no model
    assert "image-text: give it a picture" in models.load("A", "runs/pics") and models.takes_pictures
    picture = str(ROOT / "data/shapes/images/0000.png")
    *_, (_, hist_a, _) = chat_turn(models, "What colour?", [], [], "Be brief.", 0.0, 1.0, 3, picture)
    assert hist_a[0] == {"role": "user", "content": "What colour?"} and hist_a[1]["role"] == "assistant"
    assert hist_a[1]["content"]  # generated with the picture's pixels and its 16 image tokens
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ]
    assert [m["content"] for m in with_image(msgs, models.slots["A"].processor)] == ["s", "<image>a", "b"]
    models.load("B", "runs/text")
    models.slots["A"] = None
    assert not models.takes_pictures  # a text-only model: the picture box goes
    with pytest.raises(gr.Error, match="slot B: runs/text is a text-only model; it takes no picture"):
        list(chat_turn(models, "Hi", [], [], "", 0.0, 1.0, 2, picture))
    models.unload()


def test_the_chat_tab_shows_reasoning_and_tool_calls_as_sections_and_gives_the_reply_back_whole():
    """A reply with a <think> trace and a <tool_call> shows as a collapsible Reasoning section (pending while
    it streams) and a section named after the tool with its arguments as JSON; the next turn gives the model
    that reply as one assistant message, which the bundled tools template renders back to the very text the
    model wrote."""
    import copy

    from app.chat_tab import chat_turn
    from conftest import ROOT, TOKENIZER
    from training.config import ModelSection
    from training.data.tokenizer import load_tokenizer
    from training.data.turns import parse_reply

    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "17 - 2"}}\n</tool_call>'
    reply = f"<think>\n7 + 10 = 17\n</think>\n\n{call}"

    class Replies:  # ChatModels' interface, with a fixed reply streamed in three pieces
        slots = {"A": object(), "B": None}
        seen = []

        def replies(self, slot, messages, *args):
            self.seen.append(messages)
            return (parse_reply(t) for t in ["<think>\n7 + 10", "<think>\n7 + 10 = 17\n</think>\n\n", reply])

    chats = Replies()
    shown = [copy.deepcopy(a) for _, a, _ in chat_turn(chats, "Ben has 7 books", [], [], "", 0.0, 1.0, 32)]
    assert shown[1][1] == {
        "role": "assistant",
        "content": "7 + 10",
        "metadata": {"title": "Reasoning", "status": "pending"},
    }
    final = shown[-1]
    assert [(m["role"], (m.get("metadata") or {}).get("title")) for m in final] == [
        ("user", None),
        ("assistant", "Reasoning"),
        ("assistant", "Tool call: calculate"),
    ]
    assert final[1]["content"] == "7 + 10 = 17" and final[1]["metadata"]["status"] == "done"
    assert final[2]["content"] == '```json\n{\n  "expression": "17 - 2"\n}\n```'

    list(chat_turn(chats, "And then?", final, [], "", 0.0, 1.0, 32))
    given = chats.seen[1]
    assert given[1] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "7 + 10 = 17",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "17 - 2"}}}
        ],
    }
    tok = load_tokenizer(ModelSection(tokenizer=TOKENIZER, from_scratch={"hidden_size": 64}))
    template = (ROOT / "data/tools/chatml_tools.jinja").read_text()
    rendered = tok.apply_chat_template(given, chat_template=template, tokenize=False)
    assert f"<|im_start|>assistant\n{reply}<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n" in rendered


def test_the_chat_tab_answers_a_tool_call_with_a_tool_message_and_checks_the_tools_field(tmp_path):
    """Sent as a tool result, a message answers the model's pending call: shown titled after the tool, given
    to the model as a `tool` message that the bundled tools template renders as the tool's response, with
    the Tools field's definitions; a tool result with no call waiting is refused, as are malformed tool
    definitions and a template that cannot render tools."""
    from types import SimpleNamespace

    from app.chat_models import ChatModels
    from app.chat_tab import chat_turn
    from conftest import ROOT, TOKENIZER
    from training.config import ModelSection
    from training.data.tokenizer import load_tokenizer
    from training.data.turns import parse_reply

    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "17 - 2"}}\n</tool_call>'
    definitions = (
        '[{"type": "function", "function": {"name": "calculate", "description": "Arithmetic", '
        '"parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]'
    )

    class Replies:  # ChatModels' interface: a tool call first, then an answer
        slots = {"A": object(), "B": None}
        seen, given_tools = [], []

        def tools(self, slot, text):
            return ChatModels.tools(self, slot, text) if "bad" in text else [{"parsed": text}]

        def replies(self, slot, messages, sampling, image, tools):
            self.seen.append(messages)
            self.given_tools.append(tools)
            return iter([parse_reply(call if len(self.seen) == 1 else "It is 15.")])

    chats = Replies()
    *_, (_, first, _) = chat_turn(chats, "What is 17 - 2?", [], [], "", 0.0, 1.0, 32, None, definitions)
    assert chats.given_tools == [[{"parsed": definitions}]]
    *_, (_, after, _) = chat_turn(chats, "15", first, [], "", 0.0, 1.0, 32, None, definitions, True)
    assert after[2] == {"role": "user", "content": "15", "metadata": {"title": "Tool result: calculate"}}
    assert after[3] == {"role": "assistant", "content": "It is 15."}
    given = chats.seen[1]
    assert given[-1] == {"role": "tool", "name": "calculate", "content": "15"}
    tok = load_tokenizer(ModelSection(tokenizer=TOKENIZER, from_scratch={"hidden_size": 64}))
    template = (ROOT / "data/tools/chatml_tools.jinja").read_text()
    rendered = tok.apply_chat_template(
        given,
        tools=json.loads(definitions),
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<tool_response>\n15\n</tool_response>" in rendered and '"name": "calculate"' in rendered
    with pytest.raises(gr.Error, match="send as tool result: model A has no tool call waiting for a result"):
        list(chat_turn(chats, "16", after, [], "", 0.0, 1.0, 32, None, "", True))

    models = ChatModels(Workspace(tmp_path))
    models.slots["A"] = SimpleNamespace(tokenizer=tok, template_kwargs={}, source="runs/x")
    with pytest.raises(ValueError, match="field Tools is a string but not valid JSON"):
        models.tools("A", "[bad")
    assert models.tools("A", "  ") is None
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # renders no tools
    with pytest.raises(ValueError, match="Tools: the chat template of runs/x cannot render tools"):
        models.tools("A", definitions)
    tok.chat_template = template
    assert models.tools("A", definitions) == json.loads(definitions)
    chats.given_tools.clear()
    with pytest.raises(gr.Error, match="field Tools is a string but not valid JSON"):
        list(chat_turn(chats, "Hi", [], [], "", 0.0, 1.0, 32, None, "[bad"))


def test_runs_compared_side_by_side_share_one_chart_and_a_table_of_what_differs(tmp_path):
    from app.compare import compare_figure, compare_points, compare_table, compared, differing_keys

    ws = Workspace(tmp_path)
    a = _made_outside(ws, "a", {"state": "finished", "step": 3, "total_steps": 10})
    b = _made_outside(ws, "b", {"state": "stopped", "step": 3, "total_steps": 10})
    a.config.write_text(yaml.safe_dump({"output_dir": "runs/a", "train": {"lr": 1e-3, "batch_size": 4}}))
    b.config.write_text(
        yaml.safe_dump({"output_dir": "runs/b", "train": {"lr": 3e-4, "batch_size": 4}, "seed": 1})
    )
    with b.metrics.open("a") as f:
        f.write(json.dumps({"step": 3, "eval_loss": 2.5000000000000004, "reward": 0.75}) + "\n")
    mgr = RunRegistry(ws)
    views = RunViews(mgr)
    chosen = compared(views, ["a", "b", "no-such-run"])
    points = compare_points(chosen, LOSS_KEYS)
    assert {p["series"] for p in points} == {"a · train", "b · train", "b · eval"}
    assert [p["value"] for p in points if p["series"] == "a · train"] == [2.9, 2.8, 2.7]
    by_tokens = compare_points(compared(views, ["a"]), LOSS_KEYS, "tokens")  # no tokens logged: all at 0
    assert len(by_tokens) == 3 and {p["tokens"] for p in by_tokens} == {0}
    fig = compare_figure(chosen)
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["a · train", "b · train", "b · eval"]
    assert [line.get_label() for line in fig.axes[1].get_lines()] == ["b · reward"]  # rewards: a panel below
    assert len(fig.axes) == 2  # no run logged a grad norm or a learning rate
    headers, rows = compare_table(compared(views, ["a", "b"]))
    assert headers == ["run", "state", "step", "loss", "eval loss", "seed", "train.lr"]  # not batch_size
    assert rows[0] == ["a", "finished", 3, 2.7, "", "", "0.001"]
    assert rows[1] == [
        "b",
        "stopped",
        3,
        2.7,
        2.5,
        "1",
        "0.0003",
    ]  # rounded: the rows hold 2.7000000000000002
    assert differing_keys({"x": {"a": 1}, "y": {"a": 1}}) == [] and compare_figure({}) is None


def test_the_launch_command_says_what_the_trainer_would_refuse_for_the_backend_chosen(tmp_path):
    ws = Workspace(tmp_path)
    lora = (ROOT / "training/recipes/lora.yaml").read_text()
    assert "-m training.train runs/lora/recipe.yaml" in launch_command(ws, lora, "ddp", 2)
    refused = launch_command(ws, lora, "tp", 2)  # the refusal table's answer, before Start
    assert refused.startswith("# the trainer would refuse this: method.type=lora cannot be used with tensor")
    assert launch_command(ws, "output_dir: runs/x\ntrain: {lr: -1}\n", "ddp", 2).startswith(
        "cd "
    )  # the form says


def test_the_form_shows_the_data_check_under_the_field_and_start_refuses_what_it_found(tmp_path):
    from app.preview import check_data, data_key, known_data_problems
    from app.recipe_check import check

    ws = Workspace(tmp_path)
    (tmp_path / "data").mkdir()
    bad = tmp_path / "data/notes.jsonl"
    bad.write_text('{"text": "Once upon a time"}\n{"body": "no text column"}\n')
    raw = {
        "output_dir": "runs/x",
        "model": {"tokenizer": "bundled:smollm2-135m-instruct", "from_scratch": {"hidden_size": 64}},
        "data": {"train": ["data/notes.jsonl"], "format": "text"},
    }
    text = yaml.safe_dump(raw)
    assert check(ws, text).errors == {} and known_data_problems(ws, raw) == {}  # not checked yet
    both = {
        **raw,
        "train": {"max_steps": 5, "epochs": 1},
    }  # refused by the schema: training.preview refuses it
    assert check(ws, text).takes_data_check and not check(ws, yaml.safe_dump(both)).takes_data_check
    typing = {**raw, "data": {"train": ["data/no"], "format": "text"}}  # a name being typed: no check
    assert data_key(ws, typing) is None and not check_data(ws, yaml.safe_dump(typing), typing)
    assert check_data(ws, text, raw) and not check_data(ws, text, raw)  # once per data_key
    errors = check(ws, text).errors
    assert list(errors) == ["data.train"] and errors["data.train"][0].startswith("data/notes.jsonl line 2: ")
    with pytest.raises(RecipeRefused, match="refused: data/notes.jsonl line 2"):
        checked_recipe(ws, text)
    bad.write_text('{"text": "Once upon a time"}\n{"text": "fixed"}\n')  # a new size: checked again
    assert known_data_problems(ws, raw) == {} and check_data(ws, text, raw)
    assert check(ws, text).errors == {} and checked_recipe(ws, text)[0] == raw


def test_the_page_never_asks_itself_again():
    """What keeps the page at rest between edits (app.context.one_listener, app.ui.progress_on_leaves): no event of a
    component has two listeners that wait for the last value (gradio's page then asks every listener again each
    time one of them ends: the YAML box's four did, about 15 events a second, for as long as the page was open), and
    no event shows its progress on a layout (at each status change of any event the page reads every component
    inside one: the page's tabs, which Start had, are the whole page) nor at all where its progress is hidden."""
    demo = build_app(Workspace(ROOT))
    listeners = {}
    for fn in demo.fns.values():
        for block_id, event in fn.targets:
            if event != "then" and fn.trigger_mode == "always_last":
                listeners.setdefault((block_id, event), []).append(fn.name)
    assert {k: v for k, v in listeners.items() if len(v) > 1} == {}
    yaml_box = next(
        b for b in demo.blocks.values() if isinstance(b, gr.Code) and b.label.startswith("Recipe YAML")
    )
    assert len(listeners[(yaml_box._id, "change")]) == 1  # its followers are the steps after that one
    on_layouts = {
        fn.name: [type(b).__name__ for b in fn.show_progress_on if isinstance(b, gr.blocks.BlockContext)]
        for fn in demo.fns.values()
    }
    assert {name: kinds for name, kinds in on_layouts.items() if kinds} == {}
    hidden = [fn for fn in demo.fns.values() if fn.show_progress == "hidden"]
    assert hidden and all(fn.show_progress_on == [] for fn in hidden)
    # Start still opens the Run tab, without its progress
    start = next(fn for fn in demo.fns.values() if fn.name == "start_run")
    assert any(isinstance(b, gr.Tabs) for b in start.outputs)
    # the page is given what was decided (gradio writes its config as the block closes)
    assert demo.get_config_file() == demo.config


def test_a_switch_sends_the_fields_it_shows_and_writes_them_back():
    """The page sends a switch's own fields (recipe_form.written_back), not the whole form: gradio's page keeps a
    status for every input of an event it ran and reads each of them at every status change after, so a switch
    that sent the form's 175 fields slowed every later edit. The API's form_to_yaml, which takes every field, is
    on no trigger of the page. What a switch writes back is still what it shows: LoRA's settings as the widgets
    hold them when LoRA is chosen again, a section's fields when it is switched on."""
    from app.configure_tab import fields_to_yaml
    from app.recipe_form import written_back

    demo = build_app(Workspace(ROOT))
    fields = form_fields()
    fired = [fn for fn in demo.fns.values() if fn.targets]
    widest = max(fired, key=lambda fn: len(fn.inputs))
    assert len(widest.inputs) < len(fields) / 2, widest.name  # the objective's: its three sections' fields
    api = next(fn for fn in demo.fns.values() if fn.api_name == "form_to_yaml")
    assert api.targets == [] and len(api.inputs) == 1 + len(fields)
    f = by_key()
    method = written_back(fields, f["method.type"])
    assert {g.key.split(".")[1] for g in method[1:]} == {"lora", "quantization", "qat"}
    text = (ROOT / "training/recipes/lora.yaml").read_text()
    widgets = dict(zip([g.key for g in fields], dict_to_values(fields, parse_yaml(text))))
    widgets["method.lora.r"] = 8  # typed before switching to full
    full = fields_to_yaml(method)(text, "full", *(widgets[g.key] for g in method[1:]))
    assert parse_yaml(full)["method"] == {"type": "full"}
    back = fields_to_yaml(method)(full, "lora", *(widgets[g.key] for g in method[1:]))
    assert parse_yaml(back)["method"] == {"type": "lora", "lora": {"r": 8}}  # the hidden widgets' value back
    rope = written_back(fields, f["model.rope_scaling"])
    assert [g.key for g in rope][0] == "model.rope_scaling" and len(rope) > 1
    values = [True, *(({"model.rope_scaling.factor": 4.0}).get(g.key, widgets[g.key]) for g in rope[1:])]
    on = fields_to_yaml(rope)(text, *values)
    assert parse_yaml(on)["model"]["rope_scaling"]["factor"] == 4.0
    assert [line for line in text.splitlines() if line not in on.splitlines()] == []  # the rest as written
