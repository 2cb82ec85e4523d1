"""Tiny pretrained image-text checkpoints written by the tests, each with its own processor, as the Hub ships
them: an Idefics3 (SmolVLM's architecture: its processor writes each picture as a row of image tokens
between <fake_token_around_image> markers, its chat template reads message contents as lists of parts only),
a LLaVA (SigLIP encoder, projector, Llama; its processor repeats <image> once per patch) and a Gemma 3 (each
picture its start-of-image token, soft tokens and end-of-image token). All use the bundled SmolLM2 tokenizer,
as SmolVLM does, with the checkpoint's special tokens added; weights are random (seeded)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3Processor,
    Gemma3TextConfig,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3Processor,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    SiglipVisionConfig,
)

from conftest import TOKENIZER
from training.run.sources import pretrained_source

TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
ENCODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)

# SmolVLM's template (abridged): contents are lists of parts; "User:" is followed by a space before text
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# llava-hf's template (abridged): the images of a message first, then its text; string contents too
LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}{{ part['text'] }}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tokenizer(special: list[str], named: dict[str, str] | None = None):
    """The bundled tokenizer, `special` tokens added; `named` ones (tokenizer.boi_token, ...) too."""
    tok = AutoTokenizer.from_pretrained(pretrained_source(TOKENIZER), extra_special_tokens=named)
    tok.add_special_tokens({"additional_special_tokens": special})
    return tok


def idefics3_checkpoint(path: Path) -> Path:
    from transformers import Idefics3ImageProcessorPil  # the PIL backend: no torchvision here

    if (path / "config.json").is_file():
        return path
    tok = _tokenizer(["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"])
    images = Idefics3ImageProcessorPil(
        do_image_splitting=False, max_image_size={"longest_edge": 32}, size={"longest_edge": 32}
    )
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tok, image_seq_len=4, chat_template=IDEFICS3_TEMPLATE
    )
    config = Idefics3Config(
        text_config=LlamaConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, **TEXT),
        vision_config=dict(image_size=32, patch_size=8, **ENCODER),
        scale_factor=2,  # 16 patches -> 4 image tokens
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(path)
    processor.save_pretrained(path)
    return path


def llava_checkpoint(path: Path, feature_layer: int = -1, encoder_layers: int = 1) -> Path:
    """feature_layer: the encoder layer whose hidden states the model reads (LLaVA-1.5's is -2)."""
    from transformers import SiglipImageProcessorPil

    if (path / "config.json").is_file():
        return path
    tok = _tokenizer(["<image>"])
    processor = LlavaProcessor(
        image_processor=SiglipImageProcessorPil(size={"height": 32, "width": 32}),
        tokenizer=tok,
        patch_size=8,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=0,
        image_token="<image>",
        chat_template=LLAVA_TEMPLATE,
    )
    config = LlavaConfig(
        vision_config=SiglipVisionConfig(
            image_size=32,
            patch_size=8,
            vision_use_head=False,
            **{**ENCODER, "num_hidden_layers": encoder_layers},
        ),
        text_config=LlamaConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, **TEXT),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=16,
        vision_feature_select_strategy="full",
        vision_feature_layer=feature_layer,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(path)
    processor.save_pretrained(path)
    return path


# Gemma 3's template (abridged): an image part is its start-of-image token, which its processor expands
GEMMA3_TEMPLATE = LLAVA_TEMPLATE.replace("'<image>\n'", "'<start_of_image>'")
GEMMA3_TOKENS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}


def gemma3_checkpoint(path: Path) -> Path:
    """Gemma 3: its processor writes each picture as "\\n\\n<start_of_image>", 4 <image_soft_token>s (the
    tokens the model fills with the picture's features) and "<end_of_image>\\n\\n"; its image_token is the
    start-of-image token."""
    from transformers import Gemma3ImageProcessorPil

    if (path / "config.json").is_file():
        return path
    tok = _tokenizer(list(GEMMA3_TOKENS.values()), named=GEMMA3_TOKENS)
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, do_pan_and_scan=False)
    processor = Gemma3Processor(
        image_processor=images, tokenizer=tok, image_seq_length=4, chat_template=GEMMA3_TEMPLATE
    )
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in GEMMA3_TOKENS.items()}
    config = Gemma3Config(
        text_config=Gemma3TextConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, head_dim=16, **TEXT),
        vision_config=SiglipVisionConfig(image_size=32, patch_size=8, vision_use_head=False, **ENCODER),
        mm_tokens_per_image=4,  # 4 x 4 patches pooled to 2 x 2
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(config).save_pretrained(path)
    processor.save_pretrained(path)
    return path
