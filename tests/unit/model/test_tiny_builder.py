"""The tiny builder's rules (training.model.tiny, training.model.tiny_processor) where a type's tiny model and
processor must agree: a SAM neck's channels end at the tiny encoder's width (Unlimited-OCR's CLS embedding and
patches were 64 and 1024 wide), and an encoder that reads one frame per patch gets an image processor that
writes one (Dots3 Note's)."""

from __future__ import annotations

from training.model.tiny import tiny_image_text_config
from training.model.tiny_processor import image_processor


def test_a_channel_list_ending_at_an_encoders_width_ends_at_the_tiny_width():
    vision = tiny_image_text_config("unlimited_ocr").vision_config
    channels = vision.sam_config.downsample_channels
    assert list(channels) == [32, 64]  # the default [512, 1024]: halving back from the width
    assert channels[-1] == vision.encoder_config.hidden_size


def test_an_encoder_reading_one_frame_per_patch_gets_pixels_of_one_frame_per_patch():
    assert image_processor("dots3_note").temporal_patch_size == 1
    assert image_processor("qwen2_vl").temporal_patch_size == 2  # its encoder's patches are of 2 frames
