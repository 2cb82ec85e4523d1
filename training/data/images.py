"""Images in chat records (image-text runs, model.vision): the record shapes people have, checked and
normalised; the placeholder expanded into the model's image tokens; pixels read when a batch is made.

Two record shapes, in chat (messages/role/content) or sharegpt (conversations/from/value) records:
  content parts   {"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text",
                  "text": "What is this?"}]}   (transformers/TRL; "path" or "url" may name the file instead
                  of "image"; a bare {"type": "image"} takes the next file of the record's `images` list)
  placeholders    {"images": ["cat.png"], "conversations": [{"from": "human", "value": "<image>\\nWhat is
                  this?"}, ...]}   (LLaVA/ShareGPT; `image` may hold a single file)
Both become messages with string content, the image token standing where each image is, and an `images`
list of absolute paths (relative paths are taken from the data file's directory). Every image is opened
and checked when the data is loaded (a missing or unreadable file is named with its record's line); its
pixels are decoded only when a batch is made (ImageBatcher).

What an image becomes in the tokens: a composed model's (model.vision) fixed number of image tokens; a
pretrained checkpoint's, what its processor makes of that picture (ImageExpander: the processor is asked
once per picture size, e.g. Idefics3's rows of tiles and their markers, Qwen2-VL's patch grid).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError

from training.config import ImageTokens
from training.core.batch import IGNORE
from training.core.fs import file_digest
from training.run.processors import image_text_processor, leading_image_tokens

IMAGE_KEYS = ("image", "path", "url")  # where a content part names its file


def is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def has_images(rec: dict, list_field: str, content_key: str) -> bool:
    """Whether a record carries images in either shape (for the refusal of a text-only run)."""
    if image_files_of(rec):
        return True
    msgs = rec.get(list_field)
    if not isinstance(msgs, list):
        return False
    return any(
        isinstance(m, dict)
        and isinstance(m.get(content_key), list)
        and any(map(is_image_part, m[content_key]))
        for m in msgs
    )


def image_files_of(rec: dict) -> list | None:
    """The record's `images` list (or single `image`), None when it has neither."""
    if "images" in rec and rec["images"] is not None:
        return rec["images"]
    if isinstance(rec.get("image"), str):
        return [rec["image"]]
    return None


class _Unusable(Exception):
    """A record normalize cannot use: `why` names the problem (None: left to the format's own check)."""

    def __init__(self, why: str | None):
        super().__init__(why)
        self.why = why


def normalize(rec: dict, list_field: str, content_key: str, spec: ImageTokens, base: Path):
    """(record with string contents and an `images` list of absolute paths, None) or (None, why)."""
    if not isinstance(rec, dict):
        return None, "expected a JSON object"
    msgs = rec.get(list_field)
    if not isinstance(msgs, list) or not msgs:
        return None, None  # the format's own check names what is missing
    listed = image_files_of(rec)
    if listed is not None and (not isinstance(listed, list) or not all(isinstance(f, str) for f in listed)):
        return None, "field 'images' must be a list of image file paths"
    try:
        out_msgs, files = place_images(msgs, list_field, content_key, spec, listed or [])
        paths = [image_path(f, base) for f in files]
    except _Unusable as e:
        return None, e.why
    out = {k: v for k, v in rec.items() if k not in ("images", "image")}
    return {**out, list_field: out_msgs, "images": paths}, None


def place_images(
    msgs: list, list_field: str, content_key: str, spec: ImageTokens, listed: list[str]
) -> tuple[list[dict], list[str]]:
    """(the messages with string contents, spec.in_text where each image is; the image files in the order
    they are placed), the record's `listed` files taken in order by bare image parts and placeholders."""
    queue = list(listed)
    files: list[str] = []
    out_msgs = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _Unusable(None)
        content = m.get(content_key)
        if isinstance(content, list):
            content = parts_text(content, f"{list_field}[{i}].{content_key}", spec, queue, files)
        elif isinstance(content, str):
            content = placeholders_text(content, f"{list_field}[{i}]", spec, queue, files, len(listed))
        out_msgs.append({**m, content_key: content})
    if queue:
        raise _Unusable(
            f"the record's 'images' lists {len(listed)} file(s) but its messages place "
            f"{len(listed) - len(queue)} (one {spec.token} or image part per file)"
        )
    return out_msgs, files


def parts_text(parts: list, where: str, spec: ImageTokens, queue: list[str], files: list[str]) -> str:
    """Content parts -> one string, spec.in_text for each image part (its file appended to `files`)."""
    text = []
    for j, part in enumerate(parts):
        if is_image_part(part):
            files.append(part_file(part, f"{where}[{j}]", queue))
            text.append(spec.in_text)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        else:
            raise _Unusable(
                f"{where}[{j}] must be {{'type': 'text', 'text': ...}} or {{'type': 'image', 'image': PATH}}"
            )
    return "".join(text)


def part_file(part: dict, where: str, queue: list[str]) -> str:
    """The file an image part names, or else the next of the record's `images` (taken from `queue`)."""
    named = next((part[k] for k in IMAGE_KEYS if isinstance(part.get(k), str)), None)
    if named is not None:
        return named
    if not queue:
        raise _Unusable(f"{where} is an image with no file and the record's 'images' has no more")
    return queue.pop(0)


def placeholders_text(
    content: str, where: str, spec: ImageTokens, queue: list[str], files: list[str], listed: int
) -> str:
    """A string content with its spec.token placeholders as spec.in_text, each taking the next of the
    record's `images` (from `queue`, appended to `files`); `listed` is how many the record lists in all."""
    n = content.count(spec.token)
    if n > len(queue):
        raise _Unusable(
            f"{where} has {n} {spec.token} placeholder(s) but the record's 'images' lists {listed} "
            f"file(s) in all"
        )
    files.extend(queue[:n])
    del queue[:n]
    return content.replace(spec.token, spec.in_text)  # the same string where they agree


def image_path(named: str, base: Path) -> str:
    """The absolute path of an image file the record names (a relative one from `base`), checked."""
    p = Path(named).expanduser()
    p = p if p.is_absolute() else base / p
    if why := image_problem(p, named):
        raise _Unusable(why)
    return str(p.resolve())


def image_problem(path: Path, named: str) -> str | None:
    """Why the image file cannot be used, or None (its header is read and checked, not its pixels)."""
    if not path.is_file():
        return f"image {named} does not exist (looked for {path})"
    try:
        with Image.open(path) as im:
            im.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        return f"image {named} cannot be read as an image ({type(e).__name__}: {e})"
    return None


def images_digest(paths) -> str:
    """One hash of the contents of every image file named (the tokenized cache's key includes it)."""
    h = hashlib.sha256()
    for p in sorted(set(paths)):
        h.update(f"{p}\0{file_digest(p)}\n".encode())
    return h.hexdigest()


def processor_of(spec: ImageTokens):
    """A pretrained image-text checkpoint's processor (spec.processor is its source)."""
    return image_text_processor(spec.processor, spec.revision, spec.trust_remote_code)


class ImageExpander:
    """Each image token of a tokenized example -> the tokens the model takes for its picture, none with a loss.

    A composed model: per_image copies of the token. A pretrained checkpoint: what its processor writes for
    the token with that picture (asked once per picture size and mode)."""

    def __init__(self, spec: ImageTokens, tokenizer):
        self.spec, self.token_id = spec, tokenizer.convert_tokens_to_ids(spec.expanded)
        self.by_size: dict = {}

    def tokens(self, path: str) -> list[int]:
        if self.spec.processor is None:
            return [self.token_id] * self.spec.per_image
        with Image.open(path) as im:
            key = (im.size, im.mode)
            if key not in self.by_size:
                self.by_size[key] = self.ask(im.convert("RGB"))
        return self.by_size[key]

    def ask(self, im) -> list[int]:
        """The processor's tokens for the image token with this picture. Asked with the token alone; a
        processor that takes it only inside its rendered form (HunYuan-VL: <start><token><end>) with that form,
        the tokens of the text around it (in the tokenized example already) taken off again. A processor that
        writes the picture's tokens before the whole text (BLIP-2: leading_image_tokens): those tokens, in the
        token's place."""
        proc, token, rendered = processor_of(self.spec), self.spec.expanded, self.spec.in_text
        if (lead := leading_image_tokens(proc, im)) is not None:
            return lead  # BLIP-2's query tokens: its model finds them by id wherever they stand
        for text in dict.fromkeys((token, rendered)):
            try:
                # as tensors, as a model is given them: Ovis2's processor reads its tile grid with .tolist()
                enc = proc(text=[text], images=[im], add_special_tokens=False, return_tensors="pt")
            except ValueError as e:
                refused = e
                continue
            ids = [int(t) for t in enc["input_ids"][0]]
            before, _, after = (
                proc.tokenizer(p, add_special_tokens=False)["input_ids"] for p in text.partition(token)
            )
            if ids[: len(before)] != before or (after and ids[-len(after) :] != after):
                raise ValueError(f"the processor's tokens for {text!r} do not begin and end as its text")
            return ids[len(before) : len(ids) - len(after)]
        raise refused

    def __call__(
        self, ids: list[int], labels: list[int], paths: list[str]
    ) -> tuple[list[int], list[int], int]:
        """(ids, labels, where the last picture ends) with the k-th image token replaced by paths[k]'s tokens.

        The end is the position after the last token the processor wrote for the last picture: a row cut
        shorter than that has lost part of a picture. Counting a token instead would miss cuts: Gemma 3's
        processor names its start-of-image token image_token, one per picture, and a cut among the picture's
        soft tokens after it leaves that count whole."""
        out_ids, out_labels, k, end = [], [], 0, 0
        for t, lab in zip(ids, labels):
            if t == self.token_id:
                pic = self.tokens(paths[k])
                k += 1
                out_ids.extend(pic)
                out_labels.extend([IGNORE] * len(pic))
                end = len(out_ids)
            else:
                out_ids.append(t)
                out_labels.append(lab)
        return out_ids, out_labels, end


def makes_token_types(proc) -> bool:
    """Whether the processor's own call returns mm_token_type_ids: it lists them among its model inputs
    (Qwen2-VL's kin), or its call returns them by default without listing them (PaddleOCR-VL, whose model
    refuses pictures without them)."""
    return (
        "mm_token_type_ids" in proc.model_input_names
        or getattr(proc, "return_mm_token_type_ids", False) is True
    )


def add_image_token(tokenizer, token: str) -> None:
    """The placeholder as one special token of the tokenizer (added when missing)."""
    if token not in tokenizer.get_vocab():
        tokenizer.add_tokens([token], special_tokens=True)


def image_processor(image_size: int):
    """transformers' SigLIP image processor at the model's size: resize, rescale to [0, 1], normalise."""
    try:  # the PIL backend by name (the default one needs torchvision, which it otherwise falls back from)
        from transformers import SiglipImageProcessorPil as Processor
    except ImportError:  # pragma: no cover - older transformers
        from transformers import SiglipImageProcessor as Processor
    return Processor(size={"height": image_size, "width": image_size})


class ImageBatcher:
    """Image files -> the model's pixel inputs for one batch, decoded when the batch is made: a composed
    model's pixel_values [n, 3, size, size] (SigLIP's processor), a pretrained checkpoint's whatever its
    image processor returns for the pictures in order (pixel_values and e.g. pixel_attention_mask,
    image_grid_thw), and the batch's mm_token_type_ids where its processor makes them: the modality of each
    token, from which Qwen2-VL's kin place the pictures' tokens in their multimodal rotary positions (Qwen3-VL
    refuses a batch of pictures without them, Qwen2.5-VL would number the tokens as text)."""

    def __init__(self, spec: ImageTokens):
        self.spec = spec
        self.processor = image_processor(spec.image_size) if spec.processor is None else None

    def __call__(self, paths: list[str], input_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        pics = []
        for p in paths:
            with Image.open(p) as im:
                pics.append(im.convert("RGB"))
        if self.processor is not None:
            return {"pixel_values": self.processor(images=pics, return_tensors="pt")["pixel_values"]}
        proc = processor_of(self.spec)
        # the image settings the processor's own call applies (Aya Vision's and InternVL's crop_to_patches), as
        # ImageExpander counted the picture's tokens with them
        settings = proc._merge_kwargs(tokenizer_init_kwargs=proc.tokenizer.init_kwargs)["images_kwargs"]
        out = dict(proc.image_processor(images=pics, **{**settings, "return_tensors": "pt"}))
        # fp32 pixels, as processors give them: Llama 4's normalises in bf16 (as its original code) and its patch
        # embedding does not cast; the run's precision (autocast) then computes in what it computes in
        out = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in out.items()}
        if input_ids is not None and makes_token_types(proc):
            out["mm_token_type_ids"] = torch.tensor(proc.create_mm_token_type_ids(input_ids))
        return out
