"""Qwen2.5-VL: a tiny one built from its own config class (training.tools.image_text_support, as the support
matrix builds it), its processor saved whole (processor_config.json: Qwen2VLImageProcessor and its video
processor). AutoProcessor loads it (torchvision is in the stack); where transformers finds no torchvision it
cannot, and the trainer builds it from its parts with the PIL image processor and says once that videos are not
available (a fresh interpreter that hides torchvision). Dynamic resolution: each picture becomes grid_t * grid_h * grid_w / merge_size**2 image tokens,
no cut lands inside one, and its batch carries the grid and each token's modality (the model's multimodal
rotary positions). LoRA under 2-process FSDP2 equals one process. (LoRA and full fine-tuning of Qwen2.5-VL and
Qwen3-VL with final/ reloaded at equal logits: tests/unit/model/test_image_text_families.py.)"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import pytest
import yaml
from PIL import Image
from transformers.utils import is_torchvision_available

import launching
from conftest import ROOT, train_inprocess
from launching import TWO_RANKS, assert_same_run, launch
from training.config import load_recipe
from training.core.errors import RecipeError
from training.data import build_datasets, load_tokenizer
from training.data.images import ImageBatcher
from training.data.loader import Collator
from training.model.vision import resolve_image_text
from training.run.processors import image_text_processor
from training.tools.image_text_support import checkpoint

MERGE = 2
# (width, height) of each picture: 32 x 32 pixels is 4 x 4 patches of 8, 2 x 2 tokens once merged
SIZES = [(32, 32), (48, 48), (64, 32)]
STEPS = 3


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen-vl")


@pytest.fixture(scope="module")
def qwen(work):
    """The tiny Qwen2.5-VL, its image processor taking pictures of 32 x 32 up to 64 x 64 pixels at their
    own resolution (the tiny matrix's fixes every picture at 32 x 32)."""
    path, _ = checkpoint("qwen2_5_vl", work / "qwen2_5_vl")
    saved = path / "processor_config.json"  # transformers 5 saves the parts' settings in one file
    config = json.loads(saved.read_text())
    image = config["image_processor"]
    assert image["image_processor_type"] == "Qwen2VLImageProcessor" and image["merge_size"] == MERGE
    image["size"] = {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}  # pixels, as Qwen's are counted
    saved.write_text(json.dumps(config))
    return path


# the second chat's text before its picture: its picture starts after the other chats end
LEAD = "Look at the picture below for a while, and then tell me, in one word and nothing more, which colour it has."


def records(work, sizes) -> object:
    """One chat per picture size: a square of that size and a question about its colour (the second's
    after LEAD)."""
    rows = []
    for i, size in enumerate(sizes):
        picture = work / f"picture-{size[0]}x{size[1]}.png"
        Image.new("RGB", size, (0, 160, 0)).save(picture)
        lead = [{"type": "text", "text": LEAD}] if i == 1 else []
        question = [*lead, {"type": "image", "image": str(picture)}, {"type": "text", "text": f"Colour {i}?"}]
        rows.append(
            {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "green"}]}
        )
    path = work / "sizes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_recipe(work, qwen, name: str, **extra):
    raw = {
        "output_dir": str(work / name),
        "seed": 0,
        "model": {"name_or_path": str(qwen)},
        "method": {"type": "lora", "lora": {"r": 8, "dropout": 0.0}},  # no dropout: its masks differ per rank
        "data": {
            "train": str(ROOT / "data/shapes/train.jsonl"),
            "format": "chat",
            "max_length": 64,
            "max_examples": 32,
            "eval_fraction": 0.125,
        },
        "train": {
            "lr": 3e-3,
            "batch_size": 4,
            "max_steps": STEPS,
            "warmup_steps": 1,
        },  # as launching.write_recipe
        "eval": {"at_start": False},
        **extra,
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def tokenized(recipe_path, *overrides):
    """(every training row, the recipe as the run resolves it) of the recipe's data, uncached."""
    recipe = resolve_image_text(load_recipe(recipe_path, list(overrides)))
    recipe.data.eval_fraction, recipe.data.cache = 0.0, False
    train, _ = build_datasets(recipe, load_tokenizer(recipe.model, recipe.data.images))
    return list(train), recipe


# the trainer where torchvision is not installed: a fresh interpreter in which transformers finds no torchvision
# (sys.modules[name] = None makes importlib's find_spec answer None, as for a package that is absent)
WITHOUT_TORCHVISION = """
import json, logging, sys
sys.modules["torchvision"] = None
from transformers import AutoProcessor
from training.run.processors import image_text_processor
try:
    AutoProcessor.from_pretrained(sys.argv[1])
    said = "loaded"
except ImportError as e:
    said = str(e)
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
processor = image_text_processor(sys.argv[1])
assert image_text_processor(sys.argv[1]) is processor
print(json.dumps({"auto": said, "class": type(processor).__name__, "video": repr(processor.video_processor),
    "image": type(processor.image_processor).__name__, "size": dict(processor.image_processor.size),
    "template": processor.chat_template}))
"""


def test_the_processor_is_built_from_its_parts_without_torchvision_and_says_so_once(qwen):
    run = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCHVISION, str(qwen)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert "Qwen2VLVideoProcessor requires the Torchvision library" in got["auto"], got["auto"]
    assert got["class"] == "Qwen2_5_VLProcessor" and got["video"] == "None"
    assert got["image"] == "Qwen2VLImageProcessorPil"
    assert got["size"] == {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}
    assert got["template"] == (qwen / "chat_template.jinja").read_text()
    assert run.stderr.count("videos are not available without torchvision") == 1, run.stderr[-3000:]


def test_with_torchvision_autoprocessor_loads_it_whole_video_part_included(qwen):
    """torchvision is in the stack (`make install`): the checkpoint loads as transformers loads it anywhere."""
    assert is_torchvision_available()
    processor = image_text_processor(str(qwen))
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert type(processor.video_processor).__name__ == "Qwen2VLVideoProcessor"
    assert processor.image_processor.size == {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}


def test_each_picture_becomes_its_grid_over_the_merge_and_no_cut_lands_inside_one(work, qwen, caplog):
    recipe_path = write_recipe(work, qwen, "sizes")
    data = f"data.train={records(work, SIZES)}"
    rows, recipe = tokenized(recipe_path, data, "data.max_length=200")
    processor = image_text_processor(str(qwen))
    pad = processor.image_token_id
    batch = Collator(processor.tokenizer.pad_token_id, ImageBatcher(recipe.data.images))(rows)
    grids = batch["image_grid_thw"].tolist()
    assert grids == [[1, h // 8, w // 8] for w, h in SIZES]  # each picture at its own resolution
    counts = [row["input_ids"].count(pad) for row in rows]
    assert counts == [t * h * w // MERGE**2 for t, h, w in grids] == [4, 9, 8]
    assert batch["mm_token_type_ids"].tolist() == (batch["input_ids"] == pad).long().tolist()
    cut = rows[1]["input_ids"].index(pad) + 3  # the 48 x 48 picture's chat cut after 3 of its 9 tokens
    assert max(len(rows[0]["input_ids"]), len(rows[2]["input_ids"])) <= cut, "the other chats fit"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="training.data.pipeline"):
        kept, _ = tokenized(recipe_path, data, f"data.max_length={cut}", "data.too_long=truncate")
    assert [row["input_ids"] for row in kept] == [rows[0]["input_ids"], rows[2]["input_ids"]]
    assert f"1 dropped as max_length={cut} cut into an image" in caplog.text, caplog.text


def test_a_processor_that_cannot_be_built_from_its_parts_is_refused_with_the_reason(work, qwen):
    """Without its image processor's settings the processor does not load, whole or from its parts: the refusal
    names the checkpoint and why."""
    broken = work / "no-image-processor"
    shutil.copytree(qwen, broken)
    saved = json.loads((broken / "processor_config.json").read_text())
    del saved["image_processor"]
    (broken / "processor_config.json").write_text(json.dumps(saved))
    with pytest.raises(RecipeError) as e:
        image_text_processor(str(broken))
    said = str(e.value)
    assert said.startswith(
        f"model.name_or_path: cannot load the processor of the image-text model '{broken}' ("
    )
    assert said.endswith(")") and "torchvision" not in said, said  # torchvision is installed: not the reason


@pytest.mark.slow
def test_lora_under_fsdp2_on_two_processes_equals_one_process(work, qwen):
    recipe = write_recipe(work, qwen, "lora-single")
    single, fsdp = work / "lora-single", work / "lora-fsdp"
    assert train_inprocess(recipe) == 0
    losses = launching.rows(single, "loss")
    assert sorted(losses) == list(range(1, STEPS + 1))
    proc = launch("fsdp.yaml", recipe, f"output_dir={fsdp}", *TWO_RANKS)
    assert "2 process(es), FSDP" in proc.stderr
    assert_same_run(fsdp, single, steps=range(1, STEPS + 1))
    assert (fsdp / "final/chat_template.jinja").is_file()
    saved = image_text_processor(
        str(fsdp / "final")
    )  # its image processor's settings saved beside the adapter
    assert saved.image_processor.size == {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}
