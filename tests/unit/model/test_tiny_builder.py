"""The tiny builder's rules (training.model.tiny, training.model.tiny_processor) where a type's tiny model and
processor must agree: a timm encoder built by name gives as many features as the config's tokens per picture
(Gemma 3n's MobileNetV5), a SAM neck's channels end at the tiny encoder's width (Unlimited-OCR's CLS embedding and
patches were 64 and 1024 wide), and an encoder that reads one frame per patch gets an image processor that
writes one (Dots3 Note's)."""

from __future__ import annotations

import torch
from transformers import AutoModel

from training.model.tiny import IMAGE, tiny_image_text_config
from training.model.tiny_processor import image_processor


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
