"""Pretrained image-text checkpoints (model.name_or_path an AutoModelForImageTextToText with its own processor),
on tiny ones written by tests/image_text_checkpoints.py: an Idefics3 (SmolVLM's architecture and template) and
a LLaVA. Their processor decides what each picture becomes in the tokens; LoRA/QLoRA adapt the language model
only, the projector trains whole; 2-process DDP (killed with SIGKILL and resumed) and FSDP2 equal one process;
final/ loads in a fresh process with plain transformers and peft and takes the prompt training used."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoProcessor

import launching
from conftest import ROOT, picture_records, run_cli, train_inprocess
from image_text_checkpoints import gemma3_checkpoint, idefics3_checkpoint, llava_checkpoint
from launching import TWO_RANKS, assert_same_run, kill_and_resume, launch
from training.config import load_recipe
from training.core.batch import IGNORE
from training.data import build_datasets, load_tokenizer
from training.model.build import build_model, count_parameters
from training.model.vision import image_text_parts, resolve_image_text
from training.planning.activations import activation_bytes, tower_activation_bytes
from training.planning.inventory import inventory
from training.planning.memory import estimate

SHAPES = ROOT / "data/shapes"


def write_recipe(path, out, checkpoint, **extra):
    """launching.write_recipe's run on 64 picture questions (8 held out), the model being `checkpoint`."""
    recipe = launching.write_recipe(path, out, **extra)
    raw = yaml.safe_load(recipe.read_text())
    raw["model"] = {"name_or_path": str(checkpoint), **extra.get("model", {})}
    raw["data"] = {
        "train": str(SHAPES / "train.jsonl"),
        "format": "chat",
        "max_length": 64,
        "max_examples": 64,
        "eval_fraction": 0.125,
    }
    recipe.write_text(yaml.safe_dump(raw))
    return recipe


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("image-text")


@pytest.fixture(scope="module")
def idefics3(work):
    return idefics3_checkpoint(work / "idefics3")


@pytest.fixture(scope="module")
def llava(work):
    return llava_checkpoint(work / "llava")


@pytest.fixture(scope="module")
def lora_recipe(work, idefics3):
    # no adapter dropout: its random masks differ between one process and two
    lora = {"type": "lora", "lora": {"r": 8, "dropout": 0.0}}
    return write_recipe(work / "lora.yaml", work / "unused", idefics3, method=lora)


@pytest.fixture(scope="module")
def lora_single(work, lora_recipe):
    out = work / "lora-single"
    assert train_inprocess(lora_recipe, f"output_dir={out}") == 0
    return out


def built(recipe_path, *overrides):
    """(the recipe as a run resolves it, the model training builds from it, on CPU)."""
    recipe = resolve_image_text(load_recipe(recipe_path, list(overrides)))
    return recipe, build_model(recipe, load_tokenizer(recipe.model, recipe.data.images), torch.device("cpu"))


def tokenized(recipe_path, *overrides):
    recipe = resolve_image_text(load_recipe(recipe_path, list(overrides)))
    recipe.data.max_examples, recipe.data.eval_fraction, recipe.data.cache = 1, 0.0, False
    tokenizer = load_tokenizer(recipe.model, recipe.data.images)
    train, _ = build_datasets(recipe, tokenizer)
    return train[0], tokenizer


def tokenized_all(recipe_path, *overrides):
    """(every training row, the tokenizer) of the recipe's data, uncached."""
    recipe = resolve_image_text(load_recipe(recipe_path, list(overrides)))
    recipe.data.eval_fraction, recipe.data.cache = 0.0, False
    tokenizer = load_tokenizer(recipe.model, recipe.data.images)
    train, _ = build_datasets(recipe, tokenizer)
    return list(train), tokenizer


def test_each_picture_becomes_what_the_checkpoints_processor_makes_of_it_and_carries_no_loss(
    work, idefics3, llava
):
    for checkpoint, image_tokens, around in (
        (idefics3, 4, ["<fake_token_around_image>", "<global-img>"]),
        (llava, 16, []),
    ):
        recipe = write_recipe(work / f"{checkpoint.name}.yaml", work / "unused", checkpoint)
        row, tok = tokenized(recipe)
        ids, labels = row["input_ids"], row["labels"]
        image_id = tok.convert_tokens_to_ids("<image>")
        assert ids.count(image_id) == image_tokens, checkpoint.name
        for marker in around:  # Idefics3 writes the picture between its markers
            assert tok.convert_tokens_to_ids(marker) in ids
        first, last = ids.index(image_id), len(ids) - ids[::-1].index(image_id)
        assert all(lab == IGNORE for lab in labels[: last + 1]), "the prompt and the picture carry no loss"
        answer = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE])
        assert answer.strip().startswith("green"), answer  # the record's answer, and only the answer
        assert first > 0


def test_truncation_never_cuts_inside_a_gemma3_picture(work, caplog):
    """Gemma 3's processor calls its start-of-image token image_token: a picture is that token, its soft
    tokens and its end-of-image token. A row whose cut lands among the soft tokens goes (too_long: truncate,
    said as cut into an image) or is dropped as too long (too_long: drop); no row keeps part of a picture."""
    checkpoint = gemma3_checkpoint(work / "gemma3")
    recipe = write_recipe(work / "gemma3.yaml", work / "unused", checkpoint)
    data = f"data.train={picture_records(work / 'pictures.jsonl')}"
    whole, tok = tokenized_all(recipe, data, "data.max_length=200")
    soft, boi = (tok.convert_tokens_to_ids(t) for t in ("<image_soft_token>", "<start_of_image>"))
    assert [row["input_ids"].count(soft) for row in whole] == [4, 4]  # every picture, whole
    cut = whole[1]["input_ids"].index(soft) + 2  # the second chat cut after 2 of its 4 soft tokens
    assert len(whole[0]["input_ids"]) <= cut, "the first chat fits"
    for too_long, said in (
        ("truncate", f"1 dropped as max_length={cut} cut into an image"),
        ("drop", "1 dropped as longer"),
    ):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="training.data.pipeline"):
            rows, _ = tokenized_all(recipe, data, f"data.max_length={cut}", f"data.too_long={too_long}")
        assert [row["input_ids"] for row in rows] == [whole[0]["input_ids"]], too_long
        assert said in caplog.text, caplog.text
        assert rows[0]["input_ids"].count(boi) == 1 and rows[0]["input_ids"].count(soft) == 4


def test_lora_adapts_the_language_model_only_and_trains_the_projector_whole(lora_single):
    losses = launching.rows(lora_single, "loss")
    assert losses[launching.STEPS]["loss"] < losses[1]["loss"]
    config = json.loads((lora_single / "final/adapter_config.json").read_text())
    assert config["modules_to_save"] == ["model.connector"]
    assert config["target_modules"] and all(
        t.startswith("model.text_model.") for t in config["target_modules"]
    )
    for name in (
        "processor_config.json",
        "tokenizer.json",
        "chat_template.jinja",
        "adapter_model.safetensors",
    ):
        assert (lora_single / "final" / name).is_file(), name


def test_full_training_freezes_the_tower_by_default_and_trains_it_when_asked(work, llava):
    recipe = write_recipe(work / "full.yaml", work / "unused", llava)
    frozen, trained = work / "full-frozen", work / "full-tower"
    assert train_inprocess(recipe, f"output_dir={frozen}") == 0
    assert train_inprocess(recipe, f"output_dir={trained}", "model.vision.tower=trained") == 0
    start = load_file(llava / "model.safetensors")
    for run, tower_moves in ((frozen, False), (trained, True)):
        end = load_file(run / "final/model.safetensors")
        tower = [k for k in start if "vision_tower" in k and ".encoder." in k]
        projector = [k for k in start if "multi_modal_projector" in k]
        assert tower and projector
        assert any(not torch.equal(start[k], end[k]) for k in projector), run.name
        assert any(not torch.equal(start[k], end[k]) for k in tower) == tower_moves, run.name


def test_qlora_quantizes_the_language_model_only(work, idefics3):
    _, model = built(write_recipe(work / "qlora.yaml", work / "unused", idefics3, method={"type": "qlora"}))
    quantized = [n for n, m in model.named_modules() if type(m).__name__ == "Linear4bit"]
    assert quantized and all(".text_model." in n for n in quantized), quantized[:3]
    trainable = {
        n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad and "lora_" in n
    }
    assert trainable and all(".text_model." in n for n in trainable)


def test_sizes_for_a_checkpoint_that_has_its_own_encoder_are_refused(work, idefics3):
    recipe = write_recipe(work / "sizes.yaml", work / "unused", idefics3, model={"vision": {"patch_size": 8}})
    proc = run_cli("training.train", recipe, f"output_dir={work / 'sizes'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        f"model.vision.patch_size: {idefics3} is already an image-text model with its own vision encoder"
        in (proc.stderr)
    )
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_ddp_two_processes_equal_one_process_through_kill_and_resume(work, lora_recipe, lora_single):
    out = work / "lora-ddp"
    proc = kill_and_resume("ddp.yaml", lora_recipe, out, *TWO_RANKS)
    assert "2 process(es), MULTI_CPU" in proc.stderr
    assert_same_run(out, lora_single)


@pytest.mark.slow
def test_fsdp2_two_processes_equal_one_process(work, lora_recipe, lora_single):
    out = work / "lora-fsdp"
    proc = launch("fsdp.yaml", lora_recipe, f"output_dir={out}", *TWO_RANKS)
    assert "2 process(es), FSDP" in proc.stderr
    assert_same_run(out, lora_single)


FRESH = """
import json, sys
import torch
from PIL import Image
from peft import PeftModel
from transformers import AutoModelForImageTextToText, AutoProcessor
base, final, image, question = sys.argv[1:]
processor = AutoProcessor.from_pretrained(final)
model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), final).eval()
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
inputs = processor(text=[prompt], images=[Image.open(image).convert("RGB")], return_tensors="pt")
with torch.no_grad():
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
print(json.dumps({"prompt_ids": inputs["input_ids"][0].tolist(), "new": out[0, inputs["input_ids"].shape[1]:].tolist()}))
"""


def test_final_loads_in_plain_transformers_and_peft_with_the_prompt_training_used(idefics3, lora_single):
    record = json.loads((SHAPES / "train.jsonl").read_text().splitlines()[0])
    user = record["messages"][0]["content"]
    image, question = SHAPES / user[0]["image"], user[1]["text"]
    proc = subprocess.run(
        [sys.executable, "-c", FRESH, str(idefics3), str(lora_single / "final"), str(image), question],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got["new"]) == 3
    row, _ = tokenized(lora_single / "config.yaml")
    assert row["input_ids"][: len(got["prompt_ids"])] == got["prompt_ids"]


def test_chat_cli_renders_an_image_prompt_with_the_lora_run(lora_single):
    """The LoRA run's checkpoint takes an image in the chat CLI: its template's prompt, exit 0. The
    reply is not checked: measured, the tiny model answers newlines only (stdout "\\n")."""
    proc = run_cli(
        "training.chat",
        lora_single,
        "--image",
        SHAPES / "images/1500.png",
        "--prompt",
        "What shape is this?",
        "--show-prompt",
        "--max-new-tokens",
        "2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the prompt as the checkpoint's template writes an image part first (SmolVLM's "User:" without a space)
    assert "User:<image>What shape is this?" in proc.stderr


def test_the_planner_counts_what_training_builds_and_refuses_model_parallelism(lora_recipe):
    recipe, model = built(lora_recipe)
    # the parts are those of the model inside peft's wrapper (the planner finds QLoRA's unquantised ones so)
    assert image_text_parts(model) == {
        "tower": ["base_model.model.model.vision_model"],
        "projector": ["base_model.model.model.connector"],
        "language model": ["base_model.model.model.text_model"],
    }
    trainable, _ = count_parameters(model)
    assert inventory(recipe).trainable_numel == trainable  # the adapters and the connector, nothing else
    assert {p.backend: p for p in estimate(load_recipe(lora_recipe), num_gpus=2)}["ddp"].fits
    full = {p.backend: p for p in estimate(load_recipe(lora_recipe, ["method.type=full"]), num_gpus=2)}
    for split in ("tp", "pp", "sp_ulysses"):
        assert full[split].reason.startswith("an image-text model (image features scattered into whole rows)")
    # a trained tower: its parameters train and its activations are kept; a frozen one's are not
    tower = resolve_image_text(load_recipe(lora_recipe, ["method.type=full", "model.vision.tower=trained"]))
    frozen = resolve_image_text(load_recipe(lora_recipe, ["method.type=full"]))
    inv_t, inv_f = inventory(tower), inventory(frozen)
    encoder = sum(p.numel() for n, p in model.named_parameters() if "vision_model" in n)
    assert inv_t.trainable_numel - inv_f.trainable_numel == encoder > 0
    v = inv_t.vision  # 16 patches of 32 wide through 1 layer, per picture, 4 pictures per micro-batch
    assert tower_activation_bytes(tower, inv_t, "fp32", False) > 4 * 16 * v.hidden_size * 4
    assert tower_activation_bytes(frozen, inv_f, "fp32", False) == 0
    with_tower = activation_bytes(tower, inv_t, "fp32", False, "sdpa")[0]
    assert with_tower - activation_bytes(frozen, inv_f, "fp32", False, "sdpa")[0] == tower_activation_bytes(
        tower, inv_t, "fp32", False
    )


def test_merge_writes_a_plain_image_text_model_and_gguf_is_refused_before_merging(lora_single, tmp_path):
    merged = tmp_path / "merged"
    proc = run_cli("training.export", lora_single, "--merge", "--out", merged)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "load with AutoModelForImageTextToText.from_pretrained" in proc.stdout
    for name in ("model.safetensors", "processor_config.json", "tokenizer.json"):
        assert (merged / name).is_file(), name
    gguf = run_cli("training.export", lora_single, "--gguf", "--out", tmp_path / "gguf")
    assert gguf.returncode == 2, gguf.stderr[-2000:]
    assert "is an image-text model (idefics3); llama.cpp takes such a model as two files" in gguf.stderr
    assert "merging" not in gguf.stdout and not (tmp_path / "gguf").exists()


def test_a_trained_tower_freezes_what_the_model_never_reads_so_every_trained_parameter_gets_a_gradient(work):
    """LLaVA-1.5 reads the second-to-last encoder layer: the last one and the final LayerNorm get no
    gradient, which DDP would wait for; training freezes them."""
    checkpoint = llava_checkpoint(work / "llava-layer-2", feature_layer=-2, encoder_layers=2)
    _, model = built(
        write_recipe(work / "tower.yaml", work / "unused", checkpoint, model={"vision": {"tower": "trained"}})
    )
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert any(".layers.1." in n for n in frozen) and any("post_layernorm" in n for n in frozen)
    assert not any(".layers.0." in n and "vision_tower" in n for n in frozen)
    processor = AutoProcessor.from_pretrained(checkpoint)
    picture = Image.open(SHAPES / "images/0000.png").convert("RGB")
    inputs = processor(text=["<image>What colour?"], images=[picture], return_tensors="pt")
    model(**inputs, labels=inputs["input_ids"]).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
