"""Generate data/shapes/: pictures of one coloured shape, with a question about its colour or its shape
(deterministic, no network; re-run to rebuild the files byte for byte).

    python data/make_shapes_data.py   # data/shapes/images/*.png (1620), train.jsonl (1500), eval.jsonl (120),
                                      # llava.jsonl (16, the LLaVA/ShareGPT record shape)

Each picture is 32x32 pixels: a circle, square, triangle or cross in red, green, blue or yellow, of 20-26
pixels, about centred (2 pixels of jitter), on a light background with a little noise. Each record asks one question in the
transformers/TRL chat shape (an image part and a text part in the user's content) and the assistant answers
with one word, so a model that does not look at the picture is right about a quarter of the time.
llava.jsonl holds the first 16 training pictures again in the LLaVA/ShareGPT shape (an `images` column and
an <image> placeholder in the text), for the tests of that shape. The pictures are drawn here, Apache-2.0
like the code.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent / "shapes"
SIZE = 32
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ["circle", "square", "triangle", "cross"]
QUESTIONS = {
    "colour": ["What colour is the shape?", "Which colour is it?", "Name the colour of the shape."],
    "shape": ["What shape is this?", "Which shape is in the picture?", "Name the shape."],
}
N_TRAIN, N_EVAL, N_LLAVA = 1500, 120, 16


def draw(shape: str, colour: tuple, rng: random.Random) -> Image.Image:
    bg = tuple(rng.randint(225, 250) for _ in range(3))
    im = Image.new("RGB", (SIZE, SIZE), bg)
    px = im.load()
    for _ in range(40):  # a little noise, so no two backgrounds are alike
        x, y = rng.randrange(SIZE), rng.randrange(SIZE)
        px[x, y] = tuple(max(0, c - rng.randint(10, 40)) for c in bg)
    s = rng.randint(20, 26)  # about centred: a little jitter in size and place
    x0 = (SIZE - s) // 2 + rng.randint(-2, 2)
    y0 = (SIZE - s) // 2 + rng.randint(-2, 2)
    box = [x0, y0, x0 + s, y0 + s]
    d = ImageDraw.Draw(im)
    if shape == "circle":
        d.ellipse(box, fill=colour)
    elif shape == "square":
        d.rectangle(box, fill=colour)
    elif shape == "triangle":
        d.polygon([(x0 + s // 2, y0), (x0, y0 + s), (x0 + s, y0 + s)], fill=colour)
    else:
        w = max(3, s // 3)
        d.rectangle([x0 + (s - w) // 2, y0, x0 + (s + w) // 2, y0 + s], fill=colour)
        d.rectangle([x0, y0 + (s - w) // 2, x0 + s, y0 + (s + w) // 2], fill=colour)
    return im


def main() -> None:
    rng = random.Random(2024)
    (HERE / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(N_TRAIN + N_EVAL):
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        name = f"images/{i:04d}.png"
        draw(shape, COLOURS[colour], rng).save(HERE / name, optimize=True)
        kind = rng.choice(list(QUESTIONS))
        question = rng.choice(QUESTIONS[kind])
        answer = colour if kind == "colour" else shape
        rows.append((name, question, answer))
    chat = [
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": n}, {"type": "text", "text": q}]},
                {"role": "assistant", "content": a},
            ]
        }
        for n, q, a in rows
    ]
    llava = [
        {
            "images": [n],
            "conversations": [{"from": "human", "value": f"<image>{q}"}, {"from": "gpt", "value": a}],
        }
        for n, q, a in rows[:N_LLAVA]
    ]
    for name, recs in (("train", chat[:N_TRAIN]), ("eval", chat[N_TRAIN:]), ("llava", llava)):
        with (HERE / f"{name}.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
    print(f"{HERE}: {N_TRAIN} train, {N_EVAL} eval, {N_LLAVA} llava records, {len(rows)} images")


if __name__ == "__main__":
    main()
