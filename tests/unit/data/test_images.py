"""Images in chat records (model.vision): both record shapes give the same examples; image and prompt
positions carry no loss and the answer does; a batch carries its images' pixels; the cache keys on the
images' contents; bad image inputs are named with file and line (exit 2 from the CLI, no traceback)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from conftest import ROOT, SMOLLM2_TOKENIZER, TINY_ARCH, TOKENIZER, picture_records, run_cli
from training.config import parse_recipe
from training.core.batch import IGNORE
from training.core.errors import DataError, RecipeError
from training.data import build_datasets, load_tokenizer, train_loader

SHAPES = ROOT / "data/shapes"
VISION = {"image_size": 32, "patch_size": 8, "hidden_size": 32, "intermediate_size": 64}
VISION.update(num_hidden_layers=1, num_attention_heads=2)


def recipe_for(tmp_path, train, fmt="chat", vision=True, **data):
    raw = {
        "output_dir": str(tmp_path / "run"),
        "model": {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH)}
        | ({"vision": dict(VISION)} if vision else {}),
        "data": {"train": str(train), "format": fmt, "max_length": 64, "cache": False, **data},
    }
    return parse_recipe(raw)


def built(recipe):
    tok = load_tokenizer(recipe.model)
    train, _ = build_datasets(recipe, tok)
    return train, tok


def test_the_content_part_and_the_placeholder_shapes_give_the_same_examples(tmp_path):
    """data/shapes/llava.jsonl holds the first 16 pictures and questions of train.jsonl in the LLaVA shape."""
    parts, tok = built(recipe_for(tmp_path, SHAPES / "train.jsonl", max_examples=16))
    placeholders, _ = built(recipe_for(tmp_path, SHAPES / "llava.jsonl", fmt="sharegpt"))
    assert len(parts) == len(placeholders) == 16
    records = [json.loads(x) for x in (SHAPES / "train.jsonl").read_text().splitlines()[:16]]
    for a, b, rec in zip(parts, placeholders, records):
        assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"]
        named = rec["messages"][0]["content"][0]["image"]
        assert a["images"] == b["images"] == [str((SHAPES / named).resolve())]  # relative to the data file


def test_image_and_prompt_positions_carry_no_loss_and_the_answer_does(tmp_path):
    train, tok = built(recipe_for(tmp_path, SHAPES / "train.jsonl", max_examples=4))
    image_id = tok.convert_tokens_to_ids("<image>")
    first = json.loads((SHAPES / "train.jsonl").read_text().splitlines()[0])
    answer = first["messages"][1]["content"]
    row = train[0]
    at = [i for i, t in enumerate(row["input_ids"]) if t == image_id]
    assert len(at) == 16 and at == list(range(at[0], at[0] + 16))  # (32 / 8)^2 tokens, in one run
    assert all(row["labels"][i] == IGNORE for i in at)
    labelled = [t for t in row["labels"] if t != IGNORE]
    assert tok.decode(labelled).strip().startswith(answer)
    assert first["messages"][0]["content"][1]["text"] not in tok.decode(labelled)  # the question has no loss
    assert all(lab == IGNORE for lab in row["labels"][: at[-1] + 1])  # nothing before the image either


def test_a_batch_carries_the_pixels_of_its_images(tmp_path):
    recipe = recipe_for(tmp_path, SHAPES / "train.jsonl", max_examples=8)
    train, tok = built(recipe)
    batch = next(iter(train_loader(recipe, train, tok, 0, 1, "cpu", padding_free=False)))
    rows = recipe.train.batch_size
    assert batch["input_ids"].shape[0] == rows
    assert tuple(batch["pixel_values"].shape) == (rows, 3, 32, 32)
    assert -1.0 <= batch["pixel_values"].min() < batch["pixel_values"].max() <= 1.0  # SigLIP's normalisation


def test_the_cache_keys_on_the_contents_of_the_images(tmp_path):
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    lines = (SHAPES / "train.jsonl").read_text().splitlines()[:4]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    for line in lines:
        name = json.loads(line)["messages"][0]["content"][0]["image"]
        shutil.copy(SHAPES / name, data / name)
    cache = tmp_path / "cache"
    recipe = recipe_for(tmp_path, data / "train.jsonl", cache=True, cache_dir=str(cache))
    built(recipe)
    entries = {p.name for p in cache.iterdir() if p.is_dir() and p.name != "units"}
    built(recipe)  # the same files: a hit, no new entry
    assert {p.name for p in cache.iterdir() if p.is_dir() and p.name != "units"} == entries
    shutil.copy(SHAPES / "images/0100.png", data / json.loads(lines[0])["messages"][0]["content"][0]["image"])
    built(recipe)  # same records, one picture changed: a new entry
    assert len({p.name for p in cache.iterdir() if p.is_dir() and p.name != "units"} - entries) == 1


GOOD = {
    "messages": [
        {"role": "user", "content": [{"type": "image", "image": "IMG"}, {"type": "text", "text": "Q?"}]},
        {"role": "assistant", "content": "red"},
    ]
}


def bad_cases(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png at all")
    part = lambda name: json.loads(json.dumps(GOOD).replace("IMG", name))  # noqa: E731
    return {
        "missing": ("chat", part("nowhere.png"), "image nowhere.png does not exist"),
        "unreadable": ("chat", part("broken.png"), "image broken.png cannot be read as an image"),
        "too_many_placeholders": (
            "sharegpt",
            {
                "images": [str(SHAPES / "images/0000.png")],
                "conversations": [
                    {"from": "human", "value": "<image><image>Q?"},
                    {"from": "gpt", "value": "red"},
                ],
            },
            "conversations[0] has 2 <image> placeholder(s) but the record's 'images' lists 1 file(s) in all",
        ),
        "unplaced_image": (
            "sharegpt",
            {
                "images": [str(SHAPES / "images/0000.png")],
                "conversations": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "red"}],
            },
            "the record's 'images' lists 1 file(s) but its messages place 0",
        ),
        "bad_part": (
            "chat",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]},
                    {"role": "assistant", "content": "x"},
                ]
            },
            "messages[0].content[0] must be",
        ),
    }


@pytest.mark.parametrize(
    "case", ["missing", "unreadable", "too_many_placeholders", "unplaced_image", "bad_part"]
)
def test_bad_image_inputs_are_named_with_file_and_line(case, tmp_path):
    fmt, record, phrase = bad_cases(tmp_path)[case]
    good = (
        GOOD
        if fmt == "chat"
        else {
            "images": [str(SHAPES / "images/0000.png")],
            "conversations": [{"from": "human", "value": "<image>Q?"}, {"from": "gpt", "value": "red"}],
        }
    )
    path = tmp_path / "train.jsonl"
    first = json.loads(json.dumps(good).replace("IMG", str(SHAPES / "images/0000.png")))
    path.write_text(json.dumps(first) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError) as e:
        built(recipe_for(tmp_path, path, fmt=fmt))
    assert f"{path} line 2: {phrase}" in str(e.value)


def test_an_image_in_a_text_only_run_is_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(json.loads(json.dumps(GOOD).replace("IMG", "x.png"))) + "\n")
    with pytest.raises(DataError) as e:
        built(recipe_for(tmp_path, path, vision=False))
    assert (
        f"{path} line 1: the record carries images, but the model takes text only: train an image-text checkpoint"
        in str(e.value)
    )


def test_the_cli_exits_2_naming_the_missing_image(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(json.loads(json.dumps(GOOD).replace("IMG", "gone.png"))) + "\n")
    recipe = recipe_for(tmp_path, path)
    file = tmp_path / "r.yaml"
    file.write_text(yaml.safe_dump(recipe.model_dump(mode="json", exclude_none=True)))
    proc = run_cli("training.train", file)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{path} line 1: image gone.png does not exist (looked for {tmp_path / 'gone.png'})" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "extra, phrase",
    [
        ({"data": {"packing": True}}, "data.packing with model.vision"),
        ({"data": {"format": "instruction"}}, "model.vision trains on chat or sharegpt records"),
        (
            {
                "model": {"from_scratch": None, "tokenizer": None, "name_or_path": SMOLLM2_TOKENIZER},
                "method": {"type": "lora"},
            },
            "model.vision with method.type=lora: the composed model's vision encoder",
        ),
        (
            {"model": {"vision": {**VISION, "image_size": 30}}},
            "image_size=30 must be a multiple of patch_size=8",
        ),
    ],
)
def test_recipes_that_cannot_train_an_image_text_model_are_refused(extra, phrase, tmp_path):
    raw = {
        "output_dir": str(tmp_path / "run"),
        "model": {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH), "vision": dict(VISION)},
        "data": {"train": "x.jsonl"},
    }
    for section, keys in extra.items():
        raw[section] = {**raw.get(section, {}), **keys}
    with pytest.raises(RecipeError) as e:
        parse_recipe(raw)
    assert phrase in str(e.value)


def test_a_processor_that_takes_the_image_token_only_in_its_rendered_form(monkeypatch):
    """HunYuan-VL's processor refuses its image token alone ("must be formatted as <start><token><end>"): the
    expander asks with the rendered form and keeps only what stands for the token (the start and end are in
    the tokenized example already)."""
    from PIL import Image

    from training.config import ImageTokens, ModelSection
    from training.data import images

    tok = load_tokenizer(ModelSection(name_or_path=TOKENIZER))
    start, pad, end = (tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|endoftext|>", "<|im_end|>"))

    class Strict:
        tokenizer, reply = tok, [start, pad, pad, pad, end]

        def __call__(self, text, images, add_special_tokens, return_tensors=None):
            if text != ["<|im_start|><|endoftext|><|im_end|>"]:
                raise ValueError("placeholders must be formatted as <start><token><end>")
            return {"input_ids": [self.reply]}

    monkeypatch.setattr(images, "processor_of", lambda spec: Strict())
    spec = ImageTokens(
        token="<image>",
        processor="ckpt",
        rendered="<|im_start|><|endoftext|><|im_end|>",
        model_token="<|endoftext|>",
    )
    expander = images.ImageExpander(spec, tok)
    assert expander.ask(Image.new("RGB", (8, 8))) == [pad, pad, pad]
    Strict.reply = [start, pad, pad]  # no end: not the rendered text's tokens around the picture's
    with pytest.raises(ValueError, match="do not begin and end as its text"):
        images.ImageExpander(spec, tok).ask(Image.new("RGB", (8, 8)))


def test_truncation_that_would_cut_a_picture_drops_its_example(tmp_path):
    """A chat whose picture comes in its second turn, cut by max_length among its 16 image tokens, is dropped
    (its first answer would otherwise train beside half a picture); a chat that fits stays whole."""
    data = picture_records(tmp_path / "chats.jsonl")
    whole, tok = built(recipe_for(tmp_path, data, max_length=200))
    image_id = tok.convert_tokens_to_ids("<image>")
    cut = whole[1]["input_ids"].index(image_id) + 8
    assert len(whole[0]["input_ids"]) <= cut
    kept, _ = built(recipe_for(tmp_path, data, max_length=cut))
    assert [row["input_ids"] for row in kept] == [whole[0]["input_ids"]]
    assert kept[0]["input_ids"].count(image_id) == 16


def test_a_batch_has_the_pixels_the_processors_own_call_makes(tmp_path):
    """Aya Vision's processor crops each picture into tiles when it is called (its class's crop_to_patches),
    which its image processor alone does not: the batch's pixels are the call's, the tiles whose tokens the
    picture was counted with (the image processor's alone left the model 8 features for 40 tokens)."""
    from PIL import Image
    from transformers import AutoProcessor

    from training.config import ImageTokens
    from training.data.images import ImageBatcher
    from training.tools.image_text_support import checkpoint

    ckpt, proc = checkpoint("aya_vision", tmp_path / "aya_vision")
    picture = tmp_path / "picture.png"
    Image.new("RGB", (48, 32), (0, 0, 200)).save(picture)
    spec = ImageTokens(token="<image>", processor=str(ckpt), model_token=proc.image_token)
    got = ImageBatcher(spec)([str(picture)])["pixel_values"]
    loaded = AutoProcessor.from_pretrained(
        ckpt
    )  # as the trainer loads it (torchvision's backend where installed)
    with Image.open(picture) as im:
        want = loaded(text=[proc.image_token], images=[im.convert("RGB")], return_tensors="pt")[
            "pixel_values"
        ]
    assert got.shape[0] > 1 and got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got, want)
