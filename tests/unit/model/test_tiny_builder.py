"""The tiny builder's rules (training.model.tiny, training.model.tiny_processor) where a type's tiny model and
processor must agree: a timm encoder built by name gives as many features as the config's tokens per picture
(Gemma 3n's MobileNetV5) and a picture as many tokens as an encoder that fixes its features' count gives
(DeepSeek-OCR-2's), a SAM neck's channels end at the tiny encoder's width (Unlimited-OCR's CLS embedding and
patches were 64 and 1024 wide), and an encoder that reads one frame per patch gets an image processor that
writes one (Dots3 Note's)."""

from __future__ import annotations

import torch
from PIL import Image
from transformers import AutoModel, AutoModelForImageTextToText

from training.model.tiny import IMAGE, tiny_image_text_config
from training.model.tiny_processor import image_processor, tiny_processor, token_ids


def test_a_channel_list_ending_at_an_encoders_width_ends_at_the_tiny_width():
    vision = tiny_image_text_config("unlimited_ocr").vision_config
    channels = vision.sam_config.downsample_channels
    assert list(channels) == [32, 64]  # the default [512, 1024]: halving back from the width
    assert channels[-1] == vision.encoder_config.hidden_size


def test_an_encoder_reading_one_frame_per_patch_gets_pixels_of_one_frame_per_patch():
    assert image_processor("dots3_note").temporal_patch_size == 1
    assert image_processor("qwen2_vl").temporal_patch_size == 2  # its encoder's patches are of 2 frames


def test_a_timm_encoder_gives_the_configs_soft_tokens_at_its_own_width():
    cfg = tiny_image_text_config("gemma3n")
    tower = AutoModel.from_config(cfg.vision_config)
    with torch.no_grad():
        out = tower(pixel_values=torch.zeros(1, 3, IMAGE, IMAGE), do_pooling=False).last_hidden_state
    assert out.shape[1] == cfg.vision_config.hidden_size  # the embedder's input width
    assert out.shape[2] * out.shape[3] == cfg.vision_soft_tokens_per_image


def test_a_picture_gets_as_many_tokens_as_its_features_where_the_encoder_fixes_them():
    """DeepSeek-OCR-2's encoder gives 144 learned queries per view whatever the picture; its processor counts a
    view's tokens from its side, so the tiny view is the side whose count is 144 (and the separator)."""
    cfg = tiny_image_text_config("deepseek_ocr2")
    proc = tiny_processor("deepseek_ocr2", cfg)
    token_ids(cfg, proc)
    inputs = proc(text=[proc.image_token], images=[Image.new("RGB", (48, 48))], return_tensors="pt")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg).eval()
    with torch.no_grad():
        features = model.model.get_image_features(
            inputs["pixel_values"], inputs.get("pixel_values_local"), inputs["num_local_patches"]
        ).pooler_output
    assert int((inputs["input_ids"] == cfg.image_token_id).sum()) == len(features[0]) == 145
