"""Recipe validation, overrides, and the exit-code-2 contract for bad recipes and data."""

import json
import logging
import re

import pytest
import yaml

from conftest import ROOT, run_cli, train_inprocess
from training.config import apply_overrides, load_recipe, resolve_precision
from training.core.errors import RecipeError
from training.core.machine import auto_precision

SHIPPED = sorted((ROOT / "training/recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_recipes_validate(path):
    recipe = load_recipe(path)
    assert recipe.output_dir.startswith("runs/")


def test_recipes_cover_every_use_case():
    names = {p.stem for p in SHIPPED}
    assert {"demo", "pretrain_tiny", "full", "lora", "qlora"} <= names


def write(tmp_path, raw, name="r.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(raw) if not isinstance(raw, str) else raw)
    return p


BASE = {
    "output_dir": "runs/x",
    "model": {"name_or_path": "some/model"},
    "data": {"train": "data/alpaca_tiny.jsonl", "format": "instruction"},
}


def test_overrides_parse_yaml_values_and_nest():
    raw = apply_overrides(
        BASE, ["train.lr=1e-4", "train.max_steps=7", "method.type=lora", "data.eval=[a.jsonl, b.jsonl]"]
    )
    assert raw["train"] == {"lr": 1e-4, "max_steps": 7}
    assert raw["method"]["type"] == "lora"
    assert raw["data"]["eval"] == ["a.jsonl", "b.jsonl"]
    assert BASE.get("train") is None  # the input is not mutated


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.lrate=1", "train.lrate: unknown key"),
        ("train.lr=fast", "train.lr: Input should be a valid number"),
        ("train.batch_size=-2", "train.batch_size: Input should be greater than 0"),
        ("precision=fp8", "precision: Input should be 'auto', 'no', 'fp16' or 'bf16'"),
        ("train.epochs=2", None),  # fine alone
    ],
)
def test_bad_values_name_the_key(tmp_path, override, expected):
    path = write(tmp_path, BASE)
    if expected is None:
        assert load_recipe(path, [override]).train.epochs == 2
        return
    with pytest.raises(RecipeError) as e:
        load_recipe(path, [override])
    assert str(path) in str(e.value)
    assert expected in str(e.value)


def test_checkpoint_async_is_the_async_save_setting(tmp_path):
    """`checkpoint.async: true` (the issue's and DCP's word; a Python keyword) sets async_save, and the
    resolved recipe is written with the field's own name."""
    path = write(tmp_path, BASE)
    recipe = load_recipe(path, ["checkpoint.async=true", "checkpoint.staging_dir=/scratch"])
    assert recipe.checkpoint.async_save and recipe.checkpoint.staging_dir == "/scratch"
    assert load_recipe(path).checkpoint.async_save is False  # off unless asked
    with pytest.raises(RecipeError, match="give async or async_save, not both"):
        load_recipe(path, ["checkpoint.async=true", "checkpoint.async_save=false"])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.max_steps=5", "train.epochs=1"], "either train.max_steps or train.epochs"),
        (
            ["train.warmup_steps=5", "train.warmup_ratio=0.1"],
            "either train.warmup_steps or train.warmup_ratio",
        ),
        (["model.from_scratch={hidden_size: 64}"], "exactly one of model.name_or_path"),
        (
            [
                "model.name_or_path=null",
                "model.from_scratch={hidden_size: 64, num_attention_heads: 4}",
                "model.tokenizer=t",
                "method.type=lora",
            ],
            "needs a pretrained model",
        ),
        (["model.attn_implementation=flash_attention_2"], "needs half precision"),
        (
            [
                "model.from_scratch={hidden_size: 65, num_attention_heads: 4}",
                "model.name_or_path=null",
                "model.tokenizer=t",
            ],
            "divisible",
        ),
    ],
)
def test_incompatible_options_are_refused_with_a_reason(tmp_path, overrides, expected):
    with pytest.raises(RecipeError, match=expected):  # as training takes it: precision: auto resolved
        resolve_precision(load_recipe(write(tmp_path, BASE), overrides), *auto_precision())


SCRATCH = ["model.name_or_path=null", "model.tokenizer=t"]


def test_from_scratch_type_and_extra_from_the_command_line(tmp_path):
    recipe = load_recipe(
        write(tmp_path, BASE),
        [
            *SCRATCH,
            "model.from_scratch={type: gpt2, hidden_size: 64}",
            "model.from_scratch.extra.layer_norm_epsilon=1.0e-6",
        ],
    )
    arch = recipe.model.from_scratch
    assert (arch.type, arch.hidden_size, arch.extra) == ("gpt2", 64, {"layer_norm_epsilon": 1e-6})
    # an MLP width given twice (the common key and GPT-2's own name for it) is refused
    with pytest.raises(
        RecipeError, match=r"model\.from_scratch\.extra: .*n_inner: set it as .*intermediate_size"
    ):
        load_recipe(
            write(tmp_path, BASE),
            [*SCRATCH, "model.from_scratch={type: gpt2, extra: {n_inner: 96}}"],
        )


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.from_scratch={type: bert}", r"model\.from_scratch\.type: .*encoder"),
        (
            "model.from_scratch={type: gpt2, rope_theta: 1.0e+6}",
            r"model\.from_scratch\.rope_theta: .*no such",
        ),
        ("model.from_scratch={type: mistral, extra: {slidingwindow: 8}}", r"did you mean sliding_window"),
    ],
)
def test_from_scratch_architecture_errors_name_the_key(tmp_path, override, expected):
    with pytest.raises(RecipeError, match=expected):
        load_recipe(write(tmp_path, BASE), [*SCRATCH, override])


@pytest.mark.parametrize(
    "in_file, override, kept, dropped",
    [
        ({"epochs": 3}, "train.max_steps=2", ("max_steps", 2), "epochs"),
        ({"max_steps": 50}, "train.epochs=0.5", ("epochs", 0.5), "max_steps"),
        ({"warmup_ratio": 0.1}, "train.warmup_steps=4", ("warmup_steps", 4), "warmup_ratio"),
        ({"warmup_steps": 10}, "train.warmup_ratio=0.2", ("warmup_ratio", 0.2), "warmup_steps"),
    ],
)
def test_a_command_line_key_replaces_the_key_it_excludes_in_the_file(
    tmp_path, caplog, in_file, override, kept, dropped
):
    path = write(tmp_path, {**BASE, "train": in_file})
    with caplog.at_level(logging.INFO, logger="training.config"):
        train = load_recipe(path, [override]).train
    assert getattr(train, kept[0]) == kept[1]
    assert getattr(train, dropped) in (None, 0)  # unset (None, or the default 0 for warm-up)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "training.config"]
    assert (
        line
        == f"{override} from the command line replaces train.{dropped}={in_file[dropped]} from the recipe file"
    )


def test_the_shipped_lora_recipe_takes_max_steps_from_the_command_line():
    recipe = load_recipe(ROOT / "training/recipes/lora.yaml", ["train.max_steps=2"])
    assert (recipe.train.max_steps, recipe.train.epochs) == (2, None)


@pytest.mark.parametrize(
    "in_file, overrides",
    [
        ({"epochs": 3, "max_steps": 5}, ["train.max_steps=2"]),  # the file itself conflicts
        ({"warmup_steps": 3, "warmup_ratio": 0.1}, ["train.warmup_ratio=0.2"]),
        ({"epochs": 3}, ["train.max_steps=2", "train.epochs=1"]),  # the command line itself conflicts
    ],
)
def test_conflicts_within_the_file_or_within_the_command_line_stay_refused(tmp_path, in_file, overrides):
    with pytest.raises(RecipeError, match="set either train"):
        load_recipe(write(tmp_path, {**BASE, "train": in_file}), overrides)


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path, "output_dir: x\nmodel:\n  name_or_path: [unclosed\n")
    with pytest.raises(RecipeError, match=r"line \d+: not valid YAML"):
        load_recipe(path)


def test_missing_recipe_file():
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe("nope.yaml")


# ------------------------------------------------------------------ the CLI: exit code 2, no traceback


def bad_data_cases(tmp_path):
    good = {"instruction": "Say hi", "output": "hi"}
    (tmp_path / "malformed.jsonl").write_text(json.dumps(good) + "\n" + '{"instruction": "x", "output": \n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "nocol.jsonl").write_text(json.dumps(good) + "\n" + json.dumps({"instruction": "x"}) + "\n")
    (tmp_path / "badrole.jsonl").write_text(
        json.dumps({"messages": [{"role": "wizard", "content": "x"}]}) + "\n"
    )
    (tmp_path / "nocol.csv").write_text("prompt,answer\nhello,world\n")
    return [
        ("malformed.jsonl", "instruction", r"malformed\.jsonl line 2: not valid JSON"),
        ("empty.jsonl", "instruction", r"empty\.jsonl is empty"),
        ("blank.jsonl", "instruction", r"blank\.jsonl: no records"),
        ("nocol.jsonl", "instruction", r"nocol\.jsonl line 2: missing string field 'output'"),
        ("badrole.jsonl", "chat", r"badrole\.jsonl line 1: messages\[0\] has unknown role 'wizard'"),
        ("nocol.csv", "instruction", r"nocol\.csv line 2: missing string field 'instruction'"),
        ("missing.jsonl", "instruction", r"data\.train: data file .*missing\.jsonl does not exist"),
    ]


def test_bad_data_exits_2_with_the_file_and_line(tmp_path, make_recipe, capsys):
    for name, fmt, pattern in bad_data_cases(tmp_path):
        recipe = make_recipe(data={"train": str(tmp_path / name), "format": fmt})
        with pytest.raises(SystemExit) as e:
            train_inprocess(recipe)
        assert e.value.code == 2, name
        assert re.search(pattern, capsys.readouterr().err), name


def test_cli_bad_input_prints_one_message_and_no_traceback(tmp_path, make_recipe):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    cases = [
        (make_recipe("a.yaml"), ["train.bogus=1"], "train.bogus: unknown key"),
        (
            make_recipe("c.yaml", data={"train": str(tmp_path / "bad.jsonl")}),
            [],
            "bad.jsonl line 2: not valid JSON",
        ),
        (make_recipe("e.yaml", data={"max_length": 100000, "max_examples": 1}), [], "no usable examples"),
    ]
    for recipe, overrides, message in cases:
        proc = run_cli("training.train", recipe, *overrides)
        assert proc.returncode == 2, (message, proc.stderr[-2000:])
        assert message in proc.stderr
        assert "Traceback" not in proc.stderr


def test_held_out_batches_default_to_the_rows_a_step_draws_in_rl():
    grpo, lora = ROOT / "training/recipes/agent_grpo.yaml", ROOT / "training/recipes/lora.yaml"
    assert load_recipe(grpo).eval_batch_size == 4 * 4  # train.batch_size x rl.num_generations
    assert load_recipe(grpo, ["eval.batch_size=8"]).eval_batch_size == 8
    assert load_recipe(lora).eval_batch_size == load_recipe(lora).train.batch_size


@pytest.mark.parametrize(
    "precision, weights, chosen, want",
    [
        ("bf16", "float32", None, "bfloat16"),
        ("fp16", "float32", None, "float16"),
        ("no", "float32", None, "float32"),  # a CPU without native bf16 would emulate bfloat16 matmuls
        ("no", "bfloat16", None, "bfloat16"),  # the weights' dtype, as the rest of the model computes
        ("no", "float32", "bfloat16", "bfloat16"),  # a dtype the recipe names is kept
        ("bf16", "float32", "float32", "float32"),
    ],
)
def test_quantised_matmuls_compute_in_the_precision_of_the_run_unless_named(precision, weights, chosen, want):
    import torch

    from training.model.adapters import quantization_config

    overrides = [f'precision="{precision}"', f"model.dtype={weights}"]
    overrides += [f"method.quantization.compute_dtype={chosen}"] if chosen else []
    recipe = load_recipe(ROOT / "training/recipes/qlora.yaml", overrides)
    assert recipe.quantization_compute_dtype == want
    assert quantization_config(recipe).bnb_4bit_compute_dtype == getattr(torch, want)


def test_quantised_matmuls_follow_precision_auto_as_this_machine_resolves_it(monkeypatch):
    recipe = load_recipe(ROOT / "training/recipes/qlora.yaml")
    assert recipe.precision == "auto" and recipe.method.quantization.compute_dtype == "auto"
    for forced, want in (("no", "float32"), ("bf16", "bfloat16")):
        monkeypatch.setenv("LLM_FORGE_PRECISION_AUTO", forced)
        assert recipe.quantization_compute_dtype == want
        assert resolve_precision(recipe, *auto_precision()).quantization_compute_dtype == want
