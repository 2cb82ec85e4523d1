"""Will an image-text model train here? The support matrix's image-text checks on one type built tiny
(training.model.tiny, training.model.tiny_processor: its config class's defaults or a checkpoint's
config.json), as `python -m training.support PATH` prints them for one model and
benchmarks.image_text_models writes them for every type (docs/models.md).

Saved as a checkpoint (model and processor), each type then runs through training.train on two chat
records of one picture each (squares of a colour, drawn here):
  lora    method.lora (the adapters on the language model, the projector whole), 3 steps: finite losses,
          the adapters moved
  full    full fine-tuning, 3 steps: finite losses, the weights moved
  reload  both runs' final/ load in plain transformers (AutoModelForImageTextToText and AutoProcessor, with
          peft for the adapter; a processor with a video part, without torchvision, as the trainer loads it:
          training.run.processors) and give the logits the trained model gave on a training prompt
A refusal the trainer gives (exit 2 with its reason) is `no (refused): <reason>`.

At the tools layer: the checks run the trainer itself (training.train, in this process).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from accelerate.state import AcceleratorState, GradientState, PartialState
from peft import PeftModel
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, PreTrainedConfig

import training.loop.fit as fit
from training.config.architectures import type_refusal
from training.data.images import makes_token_types
from training.model.adapter_reload import keys_renamed_on_reload
from training.model.tiny import tiny_image_text_config
from training.model.tiny_processor import Unbuildable, image_part, tiny_processor, token_ids
from training.planning.support import Row, failure
from training.run.processors import image_text_processor, save_processor
from training.train import main as train_main

CHECKS = ("lora", "full", "reload")
COLOURS = (("green", (0, 160, 0)), ("blue", (0, 0, 200)))  # the pictures of the two records
QUESTION = "What colour is the shape?"
MAX_LENGTH = 200  # data.max_length of the runs: a picture's tokens, the question and the answer
# Types whose pictures alone take more (each with why)
LONGER_ROWS = {
    "got_ocr2": 320,  # 256 tokens per picture, its processor's constant (the released model's 16 x 16 grid)
}


def checkpoint(model_type: str, path: Path, config: PreTrainedConfig | None = None) -> tuple[Path, object]:
    """The tiny model (random weights, seeded; from the type's defaults or a checkpoint's `config`) and its
    processor, saved as a checkpoint in `path`; (path, the processor)."""
    cfg = tiny_image_text_config(model_type, config)
    proc = tiny_processor(model_type, cfg)
    token_ids(cfg, proc)
    torch.manual_seed(0)
    try:
        model = AutoModelForImageTextToText.from_config(cfg)
    except Exception as e:  # noqa: BLE001
        said = [line.strip() for line in str(e).splitlines() if line.strip()]  # timm's first line is blank
        why = said[0][:120] if said else ""
        raise Unbuildable(f"does not build tiny ({type(e).__name__}: {why})") from None
    model.float().save_pretrained(path)
    _, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    if info["missing_keys"]:  # transformers' own round trip, before the trainer sees it
        missing = sorted(info["missing_keys"])
        raise Unbuildable(
            f"does not load its own save_pretrained ({len(missing)} weights missing: {missing[0]})"
        )
    save_processor(proc, path)  # one without its video part (Qwen2-VL's kin): its parts, as the Hub has them
    return path, proc


def records(work: Path) -> Path:
    """Two chat records of one picture each (a square of a colour, drawn here, named by absolute path) and a
    question about its colour; work/train.jsonl."""
    rows = []
    for i, (name, rgb) in enumerate(COLOURS):
        picture = work / f"picture-{i}.png"
        Image.new("RGB", (48, 48), rgb).save(picture)
        question = [{"type": "image", "image": str(picture)}, {"type": "text", "text": QUESTION}]
        rows.append(
            {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": name}]}
        )
    path = work / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def recipe(work: Path, ckpt: Path, method: str, max_length: int = MAX_LENGTH) -> Path:
    raw = {
        "output_dir": str(work / method),
        "seed": 0,
        "model": {"name_or_path": str(ckpt)},
        "method": {"type": method, **({"lora": {"r": 4}} if method == "lora" else {})},
        "data": {"train": str(work / "train.jsonl"), "format": "chat", "max_length": max_length},
        "train": {"lr": 1e-2, "batch_size": 2, "max_steps": 3, "warmup_steps": 0},
        "eval": {"at_start": False},
    }
    path = work / f"{method}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def prompt_inputs(proc, data: Path) -> dict:
    """The first training record's prompt (its user message, with its picture) as the processor makes it,
    with the tokens' modalities where its model takes them (mm_token_type_ids: Cosmos3-Edge's processor lists
    them among its model inputs, and its model refuses pictures without them, but returns them only when
    asked, as the trainer's batches have them: training.data.images.ImageBatcher)."""
    user = json.loads(data.read_text().splitlines()[0])["messages"][0]
    text = proc.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    asked = {"return_mm_token_type_ids": True} if makes_token_types(proc) else {}
    with Image.open(user["content"][0]["image"]) as im:
        try:
            return dict(proc(text=[text], images=[im.convert("RGB")], return_tensors="pt", **asked))
        except ValueError:  # Florence-2's processor writes the image's tokens itself, before the text
            text = text.replace(image_part(proc), "")
            return dict(proc(text=[text], images=[im.convert("RGB")], return_tensors="pt", **asked))


def train(recipe_path: Path, inputs: dict) -> tuple[int, str, torch.Tensor | None]:
    """training.train in this process: (exit code, its stderr, the trained model's logits on `inputs`, taken
    as the trainer writes final/)."""
    seen: list[torch.Tensor] = []
    export = fit.export_final

    def export_and_look(run):
        model = run.executor.whole_model()
        with torch.no_grad():
            seen.append(model.eval()(**inputs).logits.float())
        return export(run)

    fit.export_final, err = export_and_look, io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = train_main([str(recipe_path)])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        fit.export_final = export
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        PartialState._reset_state()
    return code, err.getvalue(), (seen[0] if seen else None)


def refusal(stderr: str) -> str:
    """The trainer's own `error: ...` line, else the last line of its output."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    said = next((line for line in reversed(lines) if line.startswith("error: ")), lines[-1] if lines else "")
    return said.removeprefix("error: ")[:200]


def losses(run: Path) -> list[float]:
    metrics = run / "metrics.jsonl"
    rows = map(json.loads, metrics.read_text().splitlines()) if metrics.is_file() else []
    return [r["loss"] for r in rows if "loss" in r]


def trained(
    work: Path, ckpt: Path, method: str, inputs: dict, max_length: int = MAX_LENGTH
) -> tuple[str, torch.Tensor | None]:
    """(the lora/full cell, the trained model's logits on the prompt) of one run of the trainer."""
    code, stderr, logits = train(recipe(work, ckpt, method, max_length), inputs)
    said = refusal(stderr).replace(repr(str(ckpt)), "CHECKPOINT").replace(str(ckpt), "CHECKPOINT")
    said = said.replace(str(work), "WORK")  # the run's own files (its data) named without the temporary path
    if code == 2:
        return f"no (refused): {said}", None
    if code != 0:
        return f"no: exit {code}: {said}", None
    got = losses(work / method)
    if len(got) != 3 or not all(map(math.isfinite, got)):
        return f"no: losses {got}", logits
    final = work / method / "final"
    if method == "lora":
        adapter = load_file(final / "adapter_model.safetensors")
        moved = [k for k, v in adapter.items() if "lora_B" in k and v.abs().sum() > 0]  # B starts at zero
        return ("yes" if moved else "no: no adapter moved"), logits
    start, end = load_file(ckpt / "model.safetensors"), load_file(final / "model.safetensors")
    if set(start) != set(end):
        return f"no: final/ names other weights ({sorted(set(start) ^ set(end))[0]})", logits
    moved = [k for k in start if not torch.equal(start[k], end[k])]
    return ("yes" if moved else "no: no weight moved"), logits


def reloaded(ckpt: Path, final: Path, inputs: dict, logits: torch.Tensor) -> str:
    """'' when final/ loads in plain transformers (and peft) with the same prompt and logits, else why not."""
    again = image_text_processor(str(final))
    prompt = prompt_inputs(again, final.parents[1] / "train.jsonl")
    if not torch.equal(prompt["input_ids"], inputs["input_ids"]):
        return "final/'s processor writes another prompt"
    if (final / "adapter_config.json").is_file():
        model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(ckpt), final)
    else:
        model = AutoModelForImageTextToText.from_pretrained(final)
    with torch.no_grad():
        out = model.float().eval()(**inputs).logits.float()
    if not torch.allclose(out, logits, atol=1e-4):
        lost = keys_renamed_on_reload(model, final)  # [] for a full model
        why = (
            f" (peft renames {len(lost)} adapter keys on load: transformers' key conversion)" if lost else ""
        )
        return f"logits differ by {float((out - logits).abs().max()):.2g}{why}"
    return ""


def failed(e: Exception) -> str:
    return f"no: {failure(e, 160)}"


def built(model_type: str, work: Path, config: PreTrainedConfig | None = None) -> tuple[Path, dict]:
    """(the checkpoint, the training prompt's inputs), the records written; Unbuildable says why not."""
    try:
        ckpt, proc = checkpoint(model_type, work / "checkpoint", config)
        return ckpt, prompt_inputs(proc, records(work))
    except Unbuildable as e:
        if str(e).startswith(("does not build", "does not load")):
            raise
        raise Unbuildable(f"needs a processor we cannot build offline: {e}") from None


def check_type(
    model_type: str,
    methods: tuple[str, ...] = ("lora", "full"),
    config: PreTrainedConfig | None = None,
    said: Callable[[str, str], None] | None = None,
) -> Row:
    """Every check on one type (the runs of `methods`), built tiny from its defaults or a checkpoint's
    `config`; `said(check, cell)` is told each cell as it is found. One that raises is a 'no' with the
    exception, never a crash."""
    row, start = Row(model_type), time.perf_counter()
    if why := type_refusal(model_type):  # the trainer's own refusal, before it reads the checkpoint
        row.cells = dict.fromkeys(CHECKS, f"no (refused): {why}")
        return row
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        work = Path(d)
        try:
            ckpt, inputs = built(model_type, work, config)
        except Exception as e:  # noqa: BLE001
            why = f"no: {e}" if isinstance(e, Unbuildable) else failed(e)
            row.cells, row.seconds = dict.fromkeys(CHECKS, why), time.perf_counter() - start
            return row
        reload: dict[str, str] = {}  # method -> '' (equal) or why not
        for method in methods:
            try:
                longest = LONGER_ROWS.get(model_type, MAX_LENGTH)
                row.cells[method], logits = trained(work, ckpt, method, inputs, longest)
                if row.cells[method] == "yes":
                    reload[method] = reloaded(ckpt, work / method / "final", inputs, logits)
            except Exception as e:  # noqa: BLE001
                row.cells[method] = failed(e)
            if said is not None:
                said(method, row.cells[method])
        row.cells["reload"] = reload_cell(reload)
    row.seconds = time.perf_counter() - start
    return row


def reload_cell(reload: dict[str, str]) -> str:
    if not reload:
        return "no: neither run trained"
    bad = [f"{m}: {why}" for m, why in reload.items() if why]
    if bad:
        return "no: " + "; ".join(bad)
    return "yes" if len(reload) == 2 else f"yes ({next(iter(reload))} only)"
