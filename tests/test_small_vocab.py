"""The tiny models' tokenizer (tests/tokenizer/, tests/small_vocab.py) is SmolLM2's, smaller: the same special
tokens and chat template, the same pieces for the suite's data, and any text still encodes and decodes to itself."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from conftest import ROOT, SMOLLM2_TOKENIZER, TOKENIZER
from training.run.sources import pretrained_source

CHAT = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]


@pytest.fixture(scope="module")
def both():
    whole = AutoTokenizer.from_pretrained(pretrained_source(SMOLLM2_TOKENIZER))
    return whole, AutoTokenizer.from_pretrained(TOKENIZER)


def test_the_special_tokens_and_the_chat_template_are_smollm2s(both):
    whole, cut = both
    assert len(cut) == 3749 < len(whole) == 49152
    assert cut.all_special_tokens == whole.all_special_tokens and cut.all_special_ids == whole.all_special_ids
    assert (cut.eos_token_id, cut.pad_token) == (whole.eos_token_id, whole.pad_token)
    assert cut.apply_chat_template(CHAT, tokenize=False) == whole.apply_chat_template(CHAT, tokenize=False)


@pytest.mark.parametrize("name", ["tiny_stories.txt", "alpaca_tiny.jsonl", "dates/train.jsonl"])
def test_the_suites_data_are_the_same_pieces(both, name):
    whole, cut = both
    lines = (ROOT / "data" / name).read_text().splitlines()[:200]
    texts = lines if name.endswith(".txt") else [json.dumps(json.loads(line)) for line in lines]
    for text in texts:
        ids = cut(text).input_ids
        assert cut.convert_ids_to_tokens(ids) == whole.convert_ids_to_tokens(whole(text).input_ids), text


def test_any_text_encodes_below_the_size_and_decodes_to_itself(both):
    _, cut = both
    for text in [
        "Zygomorphic quokkas 🦘 jump über naïve façades",
        "\t  x\n\n€ 12,5 — ¿sí?",
        "<|im_start|>hi",
    ]:
        ids = cut(text).input_ids
        assert max(ids) < len(cut) and cut.decode(ids) == text
