"""The bundled image task (data/shapes) scored in a fresh process with plain transformers: greedy answers to
the held-out questions about each picture's colour or shape, compared with the right word.

    python -m benchmarks.vision_task runs/vision_shapes          # after training/recipes/vision_shapes.yaml
    python -m benchmarks.vision_task runs/vision_shapes --show 5 # and print the first 5 answers
    python -m benchmarks.vision_task --make-tiny qwen2_5_vl runs/qwen2_5_vl-tiny  # a pretrained-style start

--make-tiny saves a type's tiny model (random weights, from its own config class) with its processor, as the
support matrix builds it (training/tools/image_text_support.py): a checkpoint to fine-tune with
`model.name_or_path` (docs/vision.md, "A Qwen-VL checkpoint on the same task").

The model and processor come from the run's final/ through AutoModelForImageTextToText and AutoProcessor
alone; the prompt is the user's message with the processor's image placeholder before the question, put
through the saved chat template, as training rendered it. Prints the accuracy, and what always answering the
most frequent word would score (the task has four colours and four shapes).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT / "data/shapes/eval.jsonl"


def question_of(record: dict) -> tuple[Path, str, str]:
    """(image file, question, answer) of a data/shapes record."""
    user, assistant = record["messages"]
    image = next(p["image"] for p in user["content"] if p["type"] == "image")
    text = "".join(p["text"] for p in user["content"] if p["type"] == "text")
    return EVAL.parent / image, text, assistant["content"]


def answer(model, processor, image: Path, question: str, max_new_tokens: int = 4) -> str:
    # the user's message as its parts, the picture first, as the records hold it and training rendered it
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    prompt = processor.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    with Image.open(image) as im:
        inputs = processor(text=[prompt], images=[im.convert("RGB")], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a run directory (its final/) or a final/ directory")
    ap.add_argument("--show", type=int, default=0, help="print the first N questions and answers")
    ap.add_argument("--make-tiny", metavar="TYPE", help="save TYPE's tiny model to RUN instead (see above)")
    args = ap.parse_args(argv)
    if args.make_tiny:
        from training.tools.image_text_support import checkpoint

        path, _ = checkpoint(args.make_tiny, Path(args.run))
        print(f"{path}: a tiny {args.make_tiny} (random weights) with its processor")
        return
    final = Path(args.run) / "final" if (Path(args.run) / "final").is_dir() else Path(args.run)
    processor = AutoProcessor.from_pretrained(final)
    model = AutoModelForImageTextToText.from_pretrained(final, dtype=torch.float32).eval()
    rows = [question_of(json.loads(x)) for x in EVAL.read_text().splitlines()]
    right, by_kind = 0, collections.defaultdict(lambda: [0, 0])
    for i, (image, question, truth) in enumerate(rows):
        said = answer(model, processor, image, question)
        ok = said.strip().split()[:1] == [truth]
        right += ok
        kind = by_kind["colour" if "colour" in question else "shape"]
        kind[0], kind[1] = kind[0] + ok, kind[1] + 1
        if i < args.show:
            print(f"{image.name}: {question} -> {said.strip()!r} ({'right' if ok else f'wrong, {truth}'})")
    majority = collections.Counter(t for _, _, t in rows).most_common(1)[0][1]
    print(
        f"{final}: {right}/{len(rows)} right = {100 * right / len(rows):.1f}% "
        f"(always the most frequent answer: {100 * majority / len(rows):.1f}%); "
        + ", ".join(f"{k} questions {100 * r / n:.1f}% of {n}" for k, (r, n) in sorted(by_kind.items()))
    )


if __name__ == "__main__":
    main()
