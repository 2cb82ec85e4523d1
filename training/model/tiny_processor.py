"""The processor of an image-text model built tiny (training.model.tiny): the type's own processor class,
with its PIL image processor at IMAGE x IMAGE pixels (no torchvision here) and the bundled SmolLM2 tokenizer,
the tokens the processor names added (and those it reads from the tokenizer by name), its sizes from the tiny
config (processor_kwargs); its chat template one generic template that writes an image part as the family's
own templates do (the image token, Qwen's or HunYuan's markers around it, Gemma 3's start-of-image). Built
offline; a type whose processor cannot be built so raises Unbuildable with why.
"""

from __future__ import annotations

import inspect
import os
import re
import string

import transformers
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.models.auto.feature_extraction_auto import FEATURE_EXTRACTOR_MAPPING_NAMES
from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES
from transformers.utils import is_torchvision_available

from training.model.tiny import DEEPSEEK_OCR2_VIEW, IMAGE, PATCH, get, put, sub_configs
from training.model.vision import expanded_token
from training.run.processors import image_token, leading_image_tokens, unchecked_processor_classes
from training.run.sources import pretrained_source

# LLM_FORGE_TOKENIZER: a directory of the same tokenizer, where the bundled package is not installed (as the tests)
TOKENIZER = os.environ.get("LLM_FORGE_TOKENIZER", "bundled:smollm2-135m-instruct")
# Processor arguments the type needs at this size (each with why).
PROCESSOR_KWARGS: dict[str, dict] = {
    "idefics3": {"image_seq_len": 4},  # the tokens per picture the connector makes (scale_factor 2)
    "smolvlm": {"image_seq_len": 4},
    "granite_docling": {"image_seq_len": 1},  # its connector's scale_factor 4: 16 patches -> 1 token
    "vipllava": {"vision_feature_select_strategy": "default"},  # its config has none; the model drops CLS
    "internvl": {"image_seq_length": 4},  # its pixel shuffle (downsample_ratio 0.5): 16 patches -> 4 tokens
    "qianfan_ocr": {"image_seq_length": 4},  # the same pixel shuffle
    "aria": {"size_conversion": {980: 4}},  # its picture's side -> the tokens its projector makes (tiny.py)
    # a picture's tokens are its cells of the encoder's overall stride (FastViT's: 64 px); a 32 px picture
    # is one cell, one token
    "fast_vlm": {"patch_size": IMAGE},
}
# Image processor settings of the tiny model that no generic rule derives
IMAGE_PROCESSOR_KWARGS: dict[str, dict] = {
    # its patch_size counts tokens per tile side after the 2 x 2 downsampling: 32 px / 8 px patches / 2
    "cohere2_vision": {"patch_size": IMAGE // PATCH // 2, "max_patches": 2},
    # pictures resized to this many tokens (70 is the fewest it takes; the default 280 outgrows the checks' rows)
    "gemma4": {"max_soft_tokens": 70},
    "gemma4_unified": {"max_soft_tokens": 70},
    # its size is one merged patch, not the picture: spatial_merge_size x patch_size pixels (40 = 2 x 20)
    "inkling2": {"size": {"height": 2 * PATCH, "width": 2 * PATCH}},
    "inkling2_loop": {"size": {"height": 2 * PATCH, "width": 2 * PATCH}},
    # Inkling's encoder folds one patch_size x patch_size patch into one token; its size is that patch's (40 = 40)
    "inkling_mm_model": {"size": {"height": PATCH, "width": PATCH}},
    # its patch_size is the side of a local crop (a whole picture here); the encoder's patch is vision_patch_size
    "step3p7": {"patch_size": IMAGE, "vision_patch_size": PATCH},
    "aria": {"max_image_size": 980},  # its processor's call passes 980 (tiny.py's aria)
    # a code per spatial_factor x spatial_factor pixels: the tiny VQ tokenizer's downsampling (tiny.py's)
    "apertus1p5": {"spatial_factor": 8},
    # its crops overlap by margins of patches on each side (4 + 4 of a 27-patch crop): 1 + 1 of the tiny 4-patch
    # crop, so that a window is left; one crop besides the whole picture
    "molmo2": {"overlap_margins": [1, 1], "max_crops": 1},
    # its size is made of these arguments: the tiny picture's area
    "emu3": {"min_pixels": IMAGE * IMAGE, "max_pixels": IMAGE * IMAGE},
    # pictures at its encoder's side, whose 64 x 64 patches make the 256 tokens its processor writes (tiny.py)
    "got_ocr2": {"size": {"height": 64 * PATCH, "width": 64 * PATCH}},
    # its views (the whole picture and its crops) at the side whose token count is its encoder's (tiny.py's)
    "deepseek_ocr2": {
        "size": {"height": DEEPSEEK_OCR2_VIEW, "width": DEEPSEEK_OCR2_VIEW},
        "tile_size": DEEPSEEK_OCR2_VIEW,
    },
    # its encoder's patch embedding takes one frame (no temporal patch in its config or model), but its image
    # processor is Qwen2-VL's, whose default stacks 2 frames per patch: the pixels of 2 patches per row
    "dots3_note": {"temporal_patch_size": 1},
}
# Video processor settings of the tiny model (each with why)
VIDEO_PROCESSOR_KWARGS: dict[str, dict] = {
    # its video processor draws each frame's timestamp in a font file the checkpoint ships (none here); the
    # matrix trains on pictures, not videos
    "ernie4_5_vl_moe": {"draw_on_frames": False},
}
# Tokens a processor reads from the tokenizer by name, as the family's tokenizer spells them (any other that
# a processor asks for is added as <its name>: tiny_processor)
GEMMA3_TOKENS = {
    "image_token": "<image_soft_token>",
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
}
# Gemma 4's processor reads its audio tokens with getattr (None when missing), and transformers 5.24's
# validate_inputs then refuses every call, pictures alone included ("audio inputs were provided")
GEMMA4_TOKENS = {"audio_token": "<audio_token>", "boa_token": "<boa_token>", "eoa_token": "<eoa_token>"}
# Qwen-Omni's processors read their tokens from the tokenizer by name, spelled as the checkpoints' tokenizers do
QWEN2_5_OMNI_TOKENS = {
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
    "audio_token": "<|AUDIO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
QWEN3_OMNI_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
NAMED_TOKENS: dict[str, dict] = {
    "gemma3": GEMMA3_TOKENS,
    "shieldgemma2": GEMMA3_TOKENS,
    "gemma4": GEMMA4_TOKENS,
    "gemma4_unified": GEMMA4_TOKENS,
    "diffusion_gemma": GEMMA4_TOKENS,
    "qwen2_5_omni_thinker": QWEN2_5_OMNI_TOKENS,
    "qwen3_omni_moe_thinker": QWEN3_OMNI_TOKENS,
}
# Feature extractors of processors that take one registered for no type (each with why)
FEATURE_EXTRACTORS = {
    "nemotron_h_omni": "ParakeetFeatureExtractor",  # its audio features are Parakeet's (processor's docstring)
}
# Config token ids whose tokens the processor writes without naming them (added to the tokenizer, the ids set)
CONFIG_TOKENS: dict[str, dict] = {
    # the thinkers' rope index counts a picture from the vision start token before it, an id their config
    # classes define no default for (the checkpoints' thinker_config sets it), and audio from its start token
    "qwen2_5_omni_thinker": {
        "vision_start_token_id": "<|vision_bos|>",
        "audio_start_token_id": "<|audio_bos|>",
        "audio_end_token_id": "<|audio_eos|>",
    },
    "qwen3_omni_moe_thinker": {
        "vision_start_token_id": "<|vision_start|>",
        "audio_start_token_id": "<|audio_start|>",
    },
    # its processor writes these tokens by spelling (a picture's <im_patch> per feature, between its markers) and
    # names none of them; the model finds the features' places and the pictures' bounds by these ids
    "molmo2": {
        "image_patch_id": "<im_patch>",
        "image_start_token_id": "<im_start>",
        "low_res_image_start_token_id": "<low_res_im_start>",
        "image_end_token_id": "<im_end>",
        "frame_start_token_id": "<frame_start>",
        "frame_end_token_id": "<frame_end>",
    },
    # its processor expands <image> into <IMG_START>, <IMG_ATOM> per feature, <IMG_GRID>, ...; the model puts
    # the features at the atoms and its indicator embeddings at the markers (as the Hub's tokenizer orders them)
    "ovis2": {
        "image_token_id": "<IMG_ATOM>",
        "visual_indicator_token_ids": ["<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>"],
    },
}
# VQ image tokenizers whose codes are tokens of the vocabulary, as their checkpoints' tokenizers name them: (the
# codebook size's config key, the token of code i, other tokens the model reads from the map); the config's
# vocabulary_map holds them with "<image>", the image token (training.model.tiny shrinks the codebooks)
VQ_CODES = {
    # code 12 is IMGIMGBCZ: its digits as the letters A-J
    "chameleon": ("num_embeddings", lambda i: "IMGIMG" + "".join(chr(65 + int(d)) for d in str(i)) + "Z", ()),
    "emu3": ("codebook_size", lambda i: f"<|visual token{i:06d}|>", ("<|extra_200|>",)),  # and its row end
}
# Tokens a processor writes by spelling that no config id names (added, as the checkpoints' tokenizers have them)
SPELLED_TOKENS = {"molmo2": ["<im_col>", "<im_low>"]}  # its patch rows' ends, its low-resolution view's
# The processor class its checkpoints name (their processor_config.json, which AutoProcessor reads), where
# transformers maps none to the type; its image, video and audio parts are then those of the types that map it
CHECKPOINT_PROCESSORS = {
    "cosmos3_omni": "Qwen3VLProcessor",  # a Qwen3-VL model; its docstring loads Qwen3-VL's processor
    "fast_vlm": "LlavaProcessor",  # a LLaVA model; the converted FastVLM checkpoints ship LLaVA's processor
    "glm_ocr": "Glm46VProcessor",  # zai-org/GLM-OCR ships GLM-4.6V's processor
    "glmga": "Glm46VProcessor",  # its modular file: GLM-4.6V's modeling and processor as they are
    "kosmos-2": "Kosmos2Processor",  # microsoft/kosmos-2-patch14-224 (the model's docstring)
    "kosmos-2.5": "Kosmos2_5Processor",  # microsoft/kosmos-2.5
    "qwen2_5_omni_thinker": "Qwen2_5OmniProcessor",  # the thinker of Qwen2.5-Omni's checkpoints
    "qwen3_omni_moe_thinker": "Qwen3OmniMoeProcessor",  # the thinker of Qwen3-Omni's checkpoints
}
# Types whose processor expects a SentencePiece tokenizer's word-start marker "▁" before a picture's tokens
# (each with why): built with a tiny SentencePiece-like tokenizer (sentencepiece_like) instead of the bundled BPE one
WORD_START = {
    # its processor tokenizes the picture's part (|SPEAKER| ... |NEWLINE| <s>) on its own and drops the first
    # token: the "▁" that Fuyu's tokenizer writes before |SPEAKER|, one of its pieces; a BPE tokenizer writes none
    # and the picture loses a token
    "fuyu",
}
# A generic chat template: string contents as they are, an image part as IMAGE_PART (the family's own
# templates write it so), then the text parts.
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ IMAGE_PART }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


TOKEN_TYPES = ("str", "AddedToken")


class Unbuildable(Exception):
    """The type cannot be built tiny here, with why."""


def tiny_tokenizer(named: dict[str, str], extra: list[str], word_start: bool = False):
    """The bundled tokenizer with `named` tokens (tokenizer.image_token, ...) and `extra` ones added; with
    `word_start`, a SentencePiece-like one with `extra` among its pieces."""
    bundled = AutoTokenizer.from_pretrained(pretrained_source(TOKENIZER), extra_special_tokens=named or None)
    tok = sentencepiece_like(bundled, extra) if word_start else bundled
    new = [t for t in dict.fromkeys([*named.values(), *extra]) if t and t not in tok.get_vocab()]
    if new:
        tok.add_special_tokens({"additional_special_tokens": new})
    return tok


def sentencepiece_like(bundled, pieces: list[str]):
    """A tokenizer that splits as SentencePiece does (a "▁" starts each word and the text, the `pieces` are
    vocabulary, so a text that opens with one gets a lone "▁" first): a unigram model over the printable
    characters, each also with "▁" before it, and the bundled tokenizer's special tokens and chat markers."""
    chars = [c for c in string.printable if not c.isspace()]
    vocab = dict.fromkeys(["<unk>", "▁", *pieces, *chars, *("▁" + c for c in chars)])
    model = Tokenizer(models.Unigram([(p, -1.0) for p in vocab], unk_id=0, byte_fallback=False))
    model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    model.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    special = {k: v for k, v in bundled.special_tokens_map.items() if isinstance(v, str)}
    special["unk_token"] = "<unk>"  # the unigram model's own
    tok = PreTrainedTokenizerFast(tokenizer_object=model, **special)
    tok.add_special_tokens({"additional_special_tokens": list(bundled.added_tokens_encoder)})
    return tok


def image_processor(model_type: str):
    """The type's image processor at IMAGE x IMAGE pixels, built with the sizes as arguments (so that they are
    saved): its PIL backend where it has one (the same pixels on every machine), else its torchvision one."""
    name = image_processor_name(model_type)
    if name is None and is_torchvision_available():
        raise Unbuildable("transformers registers no image processor for it")
    if name is None:
        raise Unbuildable("its image processor needs torchvision, which is not installed")
    return tiny_sizes(getattr(transformers, name), IMAGE_PROCESSOR_KWARGS.get(model_type, {}))


def video_processor(model_type: str):
    """The type's video processor (torchvision's transforms) at the tiny sizes, or None: none registered, or
    torchvision not installed (the processor is then built without it, as the trainer loads it)."""
    name = next(
        (n for t in kin(model_type) if (n := VIDEO_PROCESSOR_MAPPING_NAMES.get(t, {}).get("torchvision"))),
        None,
    )
    if name is None or not is_torchvision_available():
        return None
    return tiny_sizes(getattr(transformers, name), VIDEO_PROCESSOR_KWARGS.get(model_type, {}))


def tiny_sizes(cls, overrides: dict | None = None):
    """An image or video processor class built at IMAGE x IMAGE pixels, its patch and merge sizes the tiny
    model's, with the sizes as arguments (so that they are saved), then `overrides`."""
    default, kwargs = cls(), {}
    size = {k: v for k, v in dict(getattr(default, "size", None) or {}).items() if v is not None}
    if "shortest_edge" in size and size.get("longest_edge", 0) > 4096:  # Qwen2-VL's: pixels, not edges
        kwargs["size"] = {"shortest_edge": IMAGE * IMAGE, "longest_edge": IMAGE * IMAGE}
    elif "min_pixels" in size:  # Apertus 1.5's and Emu3's: picture areas
        kwargs["size"] = {"min_pixels": IMAGE * IMAGE, "max_pixels": IMAGE * IMAGE}
    elif size:
        kwargs["size"] = dict.fromkeys(size, IMAGE)
    for key in ("crop_size", "max_image_size", "high_res_size"):  # DeepSeek-VL-Hybrid's second encoder
        if isinstance(getattr(default, key, None), int):  # an edge (Step3p7's longest side)
            kwargs[key] = IMAGE
        elif getattr(default, key, None):
            kwargs[key] = {k: IMAGE for k, v in dict(getattr(default, key)).items() if v}
    # (a temporal patch stays the family's: 2 frames for Qwen2-VL's kin, 1 for ERNIE-4.5-VL, PaddleOCR-VL,
    # HunYuan-VL, Cosmos3-Edge, whose encoders' patch embeddings take one frame)
    sizes = (("patch_size", PATCH), ("merge_size", 2))
    sizes += (("encoder_patch_size", PATCH), ("tile_size", IMAGE))  # LFM2-VL's encoder patches and tiles
    for key, value in sizes:
        if isinstance(getattr(default, key, None), int):
            kwargs[key] = value
    patch = getattr(default, "patch_size", None)
    if patch is not None and not isinstance(patch, int):  # Pixtral's {height, width}, Fuyu's SizeDict
        kwargs["patch_size"] = {k: PATCH for k, v in dict(patch).items() if v}
    if isinstance(
        getattr(default, "min_num_patches", None), int
    ):  # Nemotron-H Omni's 1024: a picture's patches
        kwargs["min_num_patches"] = (IMAGE // PATCH) ** 2
    if getattr(default, "image_grid_pinpoints", None):
        kwargs["image_grid_pinpoints"] = [[IMAGE, IMAGE]]
    if "image_seq_length" in vars(default):  # PaliGemma's processor reads the tokens per picture here
        kwargs["image_seq_length"] = (IMAGE // PATCH) ** 2
    if isinstance(getattr(default, "scale_resolution", None), int):  # MiniCPM-V's picture and slice side
        kwargs["scale_resolution"] = IMAGE
    for key in ("do_image_splitting", "do_pan_and_scan"):
        if getattr(default, key, None):
            kwargs[key] = False
    return cls(**{**kwargs, **(overrides or {})})


# Types whose PIL image processor their processor cannot use (each with why), built with the torchvision one
TORCHVISION_FIRST = {
    # its processor asks the image processor for torch tensors, which the PIL backend's patchify_image (numpy's
    # transpose) cannot take: transformers 5.24
    "fuyu",
}


def image_processor_name(model_type: str) -> str | None:
    """The class name of the type's PIL image processor, else (torchvision installed) of its torchvision one;
    for a type that registers none of its own (Qwen3-VL-MoE, GLM-4.5V), that of the types sharing its processor
    class (Qwen3-VL's, GLM-4.1V's), as their checkpoints name it."""
    backends = ("pil", "torchvision") if is_torchvision_available() else ("pil",)
    if model_type in TORCHVISION_FIRST:
        backends = backends[::-1]
    for backend in backends:
        for t in kin(model_type):
            if name := IMAGE_PROCESSOR_MAPPING_NAMES.get(t, {}).get(backend):
                return name
    return None


def processor_name(model_type: str) -> str | None:
    """The type's processor class name: transformers' mapping, else the one its checkpoints name."""
    return PROCESSOR_MAPPING_NAMES.get(model_type) or CHECKPOINT_PROCESSORS.get(model_type)


def kin(model_type: str) -> list[str]:
    """The type, then the types that share its processor class."""
    processor = processor_name(model_type)
    if processor is None:
        return [model_type]
    return [
        model_type,
        *(t for t, n in PROCESSOR_MAPPING_NAMES.items() if n == processor and t != model_type),
    ]


def feature_extractor(model_type: str):
    """The audio feature extractor of a processor that takes one (Gemma 3n's, Gemma 4's), with its defaults."""
    name = next((n for t in kin(model_type) if (n := FEATURE_EXTRACTOR_MAPPING_NAMES.get(t))), None)
    name = name or FEATURE_EXTRACTORS.get(model_type)
    return None if name is None else getattr(transformers, name)()


def processor_tokens(proc) -> list[str]:
    """The special tokens a processor names (image_token, boi_token, vision_start_token, ...)."""
    named = (
        str(v) for k, v in vars(proc).items() if k.endswith("_token") and type(v).__name__ in TOKEN_TYPES
    )
    return [
        t for t in named if t[:1] + t[-1:] in ("<>", "[]", "][")
    ]  # <image>, Pixtral's [IMG], MiniMax's ]<]image[>[


def image_part(proc) -> str:
    """What the family's own chat templates write for an image part: the image token between the start and
    end markers the processor names (Qwen2-VL's kin, HunYuan-VL) unless its expansion writes them itself
    (MiniCPM-V); nothing where the processor writes the picture's tokens before the whole text (BLIP-2's
    prompts carry no image token)."""
    if leading_image_tokens(proc, Image.new("RGB", (IMAGE, IMAGE))) is not None:
        return ""
    markers = (("vision_start_token", "vision_end_token"), ("image_start_token", "image_end_token"))
    markers += (("vision_bos_token", "vision_eos_token"),)  # Qwen-Omni's
    for start, end in markers:
        if isinstance(getattr(proc, start, None), str) and isinstance(getattr(proc, end, None), str):
            if writes_markers(proc, getattr(proc, start), getattr(proc, end)):
                break
            return f"{getattr(proc, start)}{proc.image_token}{getattr(proc, end)}"
    # the token the trainer expands: Qianfan-OCR's <image> placeholder; Gemma 3's start-of-image token, which its
    # processor calls image_token
    return expanded_token(proc)


def writes_markers(proc, start: str, end: str) -> bool:
    """Whether the processor's expansion of its image token alone, with a picture, writes `start` and `end`
    (False where it refuses the token alone, as HunYuan-VL's does)."""
    try:
        ids = proc(text=[proc.image_token], images=[Image.new("RGB", (IMAGE, IMAGE))])["input_ids"][0]
    except Exception:  # noqa: BLE001 (any refusal: the markers are the template's to write)
        return False
    text = proc.tokenizer.decode([int(t) for t in ids])
    return start in text and end in text


# what a processor says when it reads a token from the tokenizer by name (tokenizer.image_token, ...)
NAMED = re.compile(r"has no attribute '?(\w+?)(?:_id)?'?$|missing required attribute '(\w+?)(?:_id)?'")


def processor_kwargs(model_type: str, cls, cfg) -> dict:
    """The arguments the processor class takes that the tiny model decides (LLaVA's patch size and feature
    strategy, the tokens per picture), then PROCESSOR_KWARGS."""
    params = inspect.signature(cls.__init__).parameters
    strategy = get(cfg, "vision_feature_select_strategy")
    clip = "clip" in str(get(get(cfg, "vision_config"), "model_type"))  # CLIP's encoder adds a CLS token
    derived = {
        "video_processor": video_processor(model_type),  # None without torchvision
        "feature_extractor": feature_extractor(model_type) if "feature_extractor" in params else None,
        "patch_size": PATCH,
        "vision_feature_select_strategy": strategy,
        "num_additional_image_tokens": int(clip),
        "image_seq_length": get(cfg, "mm_tokens_per_image") or (IMAGE // PATCH) ** 2,
        "num_image_tokens": (IMAGE // PATCH) ** 2,
        "img_size": IMAGE,  # Aya Vision's tiles
        "num_query_tokens": get(cfg, "num_query_tokens"),  # BLIP-2's image tokens: one per Q-Former query
        "downsample_factor": get(cfg, "downsample_factor"),
        "spatial_merge_size": get(cfg, "spatial_merge_size"),  # Mistral 3's patches merged 2 x 2
        "downsample_rate": get(cfg, "downsample_rate"),  # Granite 4 Vision's projector's, as a fraction
        "pooling_ratio": get(cfg, "projector_pooling_ratio"),  # Perception LM's projector pools n x n patches
    }
    kwargs = {k: v for k, v in derived.items() if k in params and (v is not None or k == "video_processor")}
    return {**kwargs, **PROCESSOR_KWARGS.get(model_type, {})}


def tiny_processor(model_type: str, cfg):
    """The type's processor class with its PIL image processor at IMAGE pixels and the bundled tokenizer,
    the tokens it names added: those it reads from the tokenizer by name or from its vocabulary by spelling
    (tried again with each), then those it holds (built once more, so that their ids are in the vocabulary)."""
    name = processor_name(model_type)
    if name is None:
        raise Unbuildable("transformers registers no processor class for it")
    cls = getattr(transformers, name)
    kwargs, named = processor_kwargs(model_type, cls, cfg), dict(NAMED_TOKENS.get(model_type, {}))
    extra = vq_code_tokens(cfg) + SPELLED_TOKENS.get(model_type, [])
    for attempt in range(10):
        tok = tiny_tokenizer(named, extra, model_type in WORD_START)
        try:
            with unchecked_processor_classes():
                tokenizers = (
                    {"qformer_tokenizer": tok}
                    if "qformer_tokenizer" in inspect.signature(cls).parameters
                    else {}
                )
                proc = cls(image_processor=image_processor(model_type), tokenizer=tok, **tokenizers, **kwargs)
        except Unbuildable:
            raise
        except Exception as e:  # noqa: BLE001 (the cell says what the class said)
            why = str(e).splitlines()[0][:120] if str(e) else ""
            wanted = NAMED.search(why)
            if wanted and attempt < 8 and isinstance(e, AttributeError | ValueError):
                token = wanted.group(1) or wanted.group(2)
                named[token] = f"<{token}>"
                continue
            if isinstance(e, KeyError) and isinstance(next(iter(e.args), None), str) and attempt < 8:
                extra.append(e.args[0])  # a token it looks up in the vocabulary (Fuyu's |SPEAKER|)
                continue
            raise Unbuildable(f"{name}: {type(e).__name__}: {why}") from None
        missing = [
            t for t in (*processor_tokens(proc), *config_tokens(model_type)) if t not in tok.get_vocab()
        ]
        if not missing:
            break
        extra += missing
    if image_token(proc) is None:
        raise Unbuildable(f"{name} names no image_token")
    proc.chat_template = TEMPLATE.replace("IMAGE_PART", repr(image_part(proc)))
    return proc


def vq_code_tokens(cfg) -> list[str]:
    """The tokens of a VQ image tokenizer's codes and those the model reads beside them (VQ_CODES); [] for most."""
    if cfg.model_type not in VQ_CODES:
        return []
    size, code, others = VQ_CODES[cfg.model_type]
    return [code(i) for i in range(getattr(cfg.vq_config, size))] + list(others)


def vocabulary_map(cfg, proc) -> None:
    """A VQ model's vocabulary_map (its codes' and the image token's ids, as the checkpoints' config.json has the
    tokenizer's), which the model reads to put a picture's codes in the text."""
    codes, tok = vq_code_tokens(cfg), proc.tokenizer
    if codes:
        image = token_id(tok, proc, "image_token")
        put(cfg, "vocabulary_map", {**{t: tok.convert_tokens_to_ids(t) for t in codes}, "<image>": image})
        put(cfg, "image_token_id", image)


def config_tokens(model_type: str) -> list[str]:
    """The tokens of the type's CONFIG_TOKENS."""
    named = CONFIG_TOKENS.get(model_type, {}).values()
    return [t for v in named for t in ([v] if isinstance(v, str) else v)]


def token_id(tok, proc, stem: str) -> int | None:
    """The id of the processor's `stem` token (image_token, ...): the tokenizer's named one first (Gemma 3's
    processor calls its start-of-image token image_token), then the id the processor holds (Aya Vision's
    image_token_id is its patch token's), then its token's id."""
    if stem == "image_token" and isinstance(get(proc, "img_patch_token"), str):  # Llama 4 fills <|patch|>
        return tok.convert_tokens_to_ids(proc.img_patch_token)
    if isinstance(get(tok, stem), str):
        return tok.convert_tokens_to_ids(get(tok, stem))
    if isinstance(get(proc, f"{stem}_id"), int):
        return get(proc, f"{stem}_id")
    named = image_token(proc) if stem == "image_token" else get(proc, stem)  # BLIP-2's is an AddedToken
    return tok.convert_tokens_to_ids(named) if isinstance(named, str) else None


def token_ids(cfg, proc) -> None:
    """The config's special token ids set to the processor's tokens (image_token_id <- image_token, ...);
    its vocabulary to the tokenizer's."""
    tok, vocab = proc.tokenizer, len(proc.tokenizer)
    for sub in sub_configs(cfg):
        # Gemma 4's per-layer inputs take the same ids; Inkling2's head is as wide as the vocabulary here
        for name in ("vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size"):
            if isinstance(get(sub, name), int) and get(sub, name) == 256:
                put(sub, name, vocab)
        for name in list(sub.to_dict()):
            stem = name.removesuffix("_id").removesuffix("_index")
            if stem != name and stem.endswith("_token") and (token := token_id(tok, proc, stem)) is not None:
                put(sub, name, token)
    for name, named in CONFIG_TOKENS.get(cfg.model_type, {}).items():
        put(cfg, name, tok.convert_tokens_to_ids(named))
    vocabulary_map(cfg, proc)
    for sub in sub_configs(cfg):
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(get(sub, name), int):
                put(sub, name, getattr(tok, name))
