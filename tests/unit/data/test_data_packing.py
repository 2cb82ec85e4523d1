"""Packing: bins, labels at example boundaries, real-token counts, and the proof that a packed forward
pass gives every example exactly the logits it gets alone (no attention across examples)."""

import importlib.util
import random

import datasets
import pytest
import torch

from conftest import TINY_ARCH, TOKENIZER
from training.config import Architecture, ModelSection
from training.core.batch import IGNORE, real_tokens
from training.data.loader import PackedCollator
from training.data.packing import best_fit_decreasing, pack_dataset, packing_efficiency


def test_best_fit_decreasing_places_every_item_once_within_capacity():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    bins = best_fit_decreasing(lengths, 128)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    lower_bound = -(-sum(lengths) // 128)
    assert len(bins) <= lower_bound * 1.03  # BFD is within a few percent of the volume bound here
    assert best_fit_decreasing([5, 3, 4, 4], 8) == [[0, 2], [3, 1]] or best_fit_decreasing(
        [5, 3, 4, 4], 8
    ) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        best_fit_decreasing([9], 8)


def test_best_fit_is_best_fit():
    # 6 goes alone; 5 opens a bin; 2 must go into the fuller bin (free 2, after the 6) rather than the 5's (free 3)
    assert best_fit_decreasing([6, 5, 2], 8) == [[0, 2], [1]]


def _examples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(5, 400, (n,), generator=g).tolist()
        labels = [IGNORE] * (n // 2) + ids[n // 2 :]  # a "prompt" without loss, then an "answer"
        rows.append({"input_ids": ids, "labels": labels})
    return datasets.Dataset.from_list(rows)


def test_pack_dataset_restarts_positions_and_masks_first_label():
    ds = _examples([10, 7, 5, 12, 3])
    packed = pack_dataset(ds, 16)
    assert sorted(len(r) for r in packed["input_ids"]) == sorted([12 + 3, 10 + 5, 7])
    for row in packed:
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
        for a, b in zip(starts, starts[1:] + [len(row["position_ids"])]):
            assert row["position_ids"][a:b] == list(range(b - a))
            assert row["labels"][a] == IGNORE  # no loss from the previous example's last token
    # every original example appears intact, labels unchanged after its first token
    originals = {tuple(r["input_ids"]): r["labels"] for r in ds}
    for row in packed:
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        for a, b in zip(starts, starts[1:]):
            key = tuple(row["input_ids"][a:b])
            assert row["labels"][a + 1 : b] == originals.pop(key)[1:]
    assert not originals
    assert packing_efficiency(packed, 16) == pytest.approx(37 / 48)


def test_packed_batch_counts_examples_unless_told_rows():
    """data.packed_batch: train.batch_size counts examples by default (the rows holding about that many, at the
    split's examples per row, at least one), or packed rows; unpacked data keeps the batch size."""
    from training.data.pipeline import examples_per_row, packed_rows

    packed = pack_dataset(_examples([10] * 12), 40)  # 4 examples in each of 3 rows
    assert len(packed) == 3 and examples_per_row(packed) == 4
    assert packed_rows(8, packed, "examples") == 2
    assert packed_rows(6, packed, "examples") == 2  # 1.5 rows round to 2
    assert packed_rows(1, packed, "examples") == 1
    assert packed_rows(8, packed, "rows") == 8
    assert packed_rows(8, packed.select([2, 0]), "examples") == 2  # a selection reads its own rows
    assert packed_rows(8, _examples([10] * 3), "examples") == 8


def test_real_tokens_counts_non_padding_in_packed_and_flat_batches():
    packed = pack_dataset(_examples([10, 7, 5, 12, 3, 2]), 16)
    rows = list(packed)
    batch = PackedCollator(pad_token_id=0)(rows)
    assert batch["input_ids"].shape == (3, 15)  # rows 12+3, 10+5, 7+2, padded to the longest
    assert "attention_mask" not in batch
    assert real_tokens(batch).item() == 39
    flat = PackedCollator(pad_token_id=0, padding_free=True)(rows)
    assert flat["input_ids"].shape == (1, 39)
    assert real_tokens(flat).item() == 39
    assert flat["cu_seq_lens_q"].tolist() == [
        0,
        *torch.tensor(sorted_example_lengths(rows)).cumsum(0).tolist(),
    ]
    assert flat["max_length_q"] == 12
    assert (flat["labels"][0, flat["cu_seq_lens_q"][:-1].long()] == IGNORE).all()


def sorted_example_lengths(rows):
    out = []
    for r in rows:
        starts = [i for i, p in enumerate(r["position_ids"]) if p == 0] + [len(r["position_ids"])]
        out += [b - a for a, b in zip(starts, starts[1:])]
    return out


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import AutoModelForCausalLM

    from training.data.tokenizer import load_tokenizer
    from training.model.build import from_scratch_config

    tok = load_tokenizer(ModelSection(name_or_path=TOKENIZER))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(from_scratch_config(Architecture(**TINY_ARCH), tok)).eval()


def _packed_matches_unpacked(model, batch_of_rows, collate, atol=1e-5):
    batch = collate(batch_of_rows)
    with torch.no_grad():
        packed_logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    checked = 0
    flat = batch["input_ids"].shape[0] == 1 and len(batch_of_rows) > 1
    offset = 0
    for r_i, r in enumerate(batch_of_rows):
        starts = [i for i, p in enumerate(r["position_ids"]) if p == 0] + [len(r["position_ids"])]
        for a, b in zip(starts, starts[1:]):
            ids = torch.tensor([r["input_ids"][a:b]])
            with torch.no_grad():
                alone = model(input_ids=ids).logits[0]
            got = packed_logits[0, offset + a : offset + b] if flat else packed_logits[r_i, a:b]
            torch.testing.assert_close(got, alone, atol=atol, rtol=1e-4)
            checked += 1
        if flat:
            offset += len(r["input_ids"])
    return checked


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_forward_gives_each_example_its_unpacked_logits(tiny_llama, attn):
    tiny_llama.set_attn_implementation(attn)
    assert tiny_llama.config._attn_implementation == attn
    packed = pack_dataset(_examples([30, 21, 9, 17, 40, 5, 26]), 64)
    rows = list(packed)
    assert any(len([p for p in r["position_ids"] if p == 0]) >= 3 for r in rows)  # really several per row
    assert _packed_matches_unpacked(tiny_llama, rows, PackedCollator(pad_token_id=0)) == 7
    # Sanity check that the test can fail: without restarting position ids (one long sequence) the
    # later examples see the earlier ones and their logits change.
    r = rows[0]
    contaminated = {
        "input_ids": torch.tensor([r["input_ids"]]),
        "position_ids": torch.arange(len(r["input_ids"]))[None],
    }
    second = [i for i, p in enumerate(r["position_ids"]) if p == 0][1]
    with torch.no_grad():
        bad = tiny_llama(**contaminated).logits[0, second:]
        alone = tiny_llama(input_ids=torch.tensor([r["input_ids"][second:]])).logits[0]
    assert (bad[: len(alone)] - alone).abs().max() > 1e-3
    # ... and transformers ignores the restarting position ids when a KV cache is built (use_cache=True),
    # which is why packed batches carry use_cache=False.
    batch = PackedCollator(pad_token_id=0)(rows[:1])
    assert batch["use_cache"] is False
    with torch.no_grad():
        cached = tiny_llama(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True
        ).logits[0, second:]
    assert (cached[: len(alone)] - alone).abs().max() > 1e-3


@pytest.mark.parametrize("arch", [{}, {"num_key_value_heads": 2}, {"type": "gpt2"}])
def test_varlen_sdpa_gives_each_example_its_unpacked_logits(arch, monkeypatch):
    """sdpa_varlen (training/model/attention.py): packed rows flattened into one padding-free row, attention one
    causal SDPA call per example. Llama, grouped-query attention and GPT-2 (learned positions)."""
    from transformers import AutoModelForCausalLM

    import training.model.attention as attention
    from training.data.tokenizer import load_tokenizer
    from training.model.build import from_scratch_config

    tok = load_tokenizer(ModelSection(name_or_path=TOKENIZER))
    torch.manual_seed(0)
    config = from_scratch_config(Architecture(**{**TINY_ARCH, **arch}), tok)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert attention.use_varlen_sdpa(model)
    assert model.config._attn_implementation == attention.VARLEN_SDPA
    calls = []
    real = attention.sdpa_attention_forward
    monkeypatch.setattr(
        attention,
        "sdpa_attention_forward",
        lambda m, q, *a, **kw: calls.append(q.shape[2]) or real(m, q, *a, **kw),
    )
    rows = list(pack_dataset(_examples([30, 21, 9, 17, 40, 5, 26]), 64))
    collate = PackedCollator(pad_token_id=0, padding_free=True)
    assert _packed_matches_unpacked(model, rows, collate) == 7
    # the packed forward really ran per example: one call per example and layer, each over its own tokens
    packed_calls = calls[: 7 * config.num_hidden_layers]
    assert sorted(set(packed_calls)) == [5, 9, 17, 21, 26, 30, 40]
    # and the loss is the padded batch's
    from training.data.loader import Collator
    from training.objectives.next_token import token_loss

    ds = _examples([30, 21, 9, 17, 40, 5, 26], seed=1)
    with torch.no_grad():
        s1, n1, _ = token_loss(model, Collator(pad_token_id=0)(list(ds)))
        s2, n2, _ = token_loss(model, collate(list(pack_dataset(ds, 64))))
    assert n1 == n2
    torch.testing.assert_close(s1, s2, atol=1e-3, rtol=1e-5)


def test_packed_loss_equals_unpacked_loss(tiny_llama):
    """The training loss (summed CE over labelled tokens) is the same packed or padded."""
    from training.data.loader import Collator
    from training.objectives.next_token import token_loss

    tiny_llama.set_attn_implementation("sdpa")
    ds = _examples([30, 21, 9, 17, 40, 5, 26], seed=1)
    padded = Collator(pad_token_id=0)(list(ds))
    packed = PackedCollator(pad_token_id=0)(list(pack_dataset(ds, 64)))
    with torch.no_grad():
        s1, n1, _ = token_loss(tiny_llama, padded)
        s2, n2, _ = token_loss(tiny_llama, packed)
    assert n1 == n2
    torch.testing.assert_close(s1, s2, atol=1e-3, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
    reason="padding-free packing with flash_attention_2 needs CUDA and the flash-attn package",
)
def test_padding_free_flash_attention_matches_unpacked():
    from transformers import AutoModelForCausalLM

    from training.data.tokenizer import load_tokenizer
    from training.model.build import from_scratch_config

    tok = load_tokenizer(ModelSection(name_or_path=TOKENIZER))
    torch.manual_seed(0)
    model = (
        AutoModelForCausalLM.from_config(
            from_scratch_config(Architecture(**TINY_ARCH), tok),
            dtype=torch.bfloat16,
            attn_implementation="flash_attention_2",
        )
        .cuda()
        .eval()
    )

    def collate(rows):
        b = PackedCollator(pad_token_id=0, padding_free=True)(rows)
        return {k: v.cuda() if torch.is_tensor(v) else v for k, v in b.items()}

    class OnCuda(torch.nn.Module):  # unpacked reference calls go to the GPU too
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, **kw):
            return self.m(input_ids=input_ids.cuda(), **kw)

    rows = list(pack_dataset(_examples([30, 21, 9, 17, 40, 5, 26]), 64))
    assert _packed_matches_unpacked(OnCuda(model), rows, collate, atol=3e-2) == 7


def test_packed_training_with_sdpa_varlen_matches_the_masked_path(make_recipe, tmp_path, capfd):
    """End to end: data.packing with SDPA trains on padding-free batches through sdpa_varlen (logged), with
    the same losses as the block-diagonal-mask path (eager attention, padded packed rows)."""
    from conftest import ROOT, train_inprocess
    from training.run.metrics import read_metrics

    losses = {}
    for attn in ("sdpa", "eager"):
        recipe = make_recipe(
            f"{attn}.yaml",
            model={"attn_implementation": attn},
            data={
                "train": str(ROOT / "data/dates/train.jsonl"),
                "format": "chat",
                "max_length": 256,
                "max_examples": 24,
                "packing": True,
                "cache": False,
            },
            train={"batch_size": 4, "max_steps": 3, "lr": 1e-3},
            checkpoint={"every_steps": None},
            output_dir=str(tmp_path / attn),
        )
        assert train_inprocess(recipe) == 0
        if attn == "sdpa":  # the training log goes to stderr
            err = capfd.readouterr().err
            assert "attention: sdpa_varlen for packed rows" in err
            # 24 examples of 63-77 tokens in rows of 256 (3 or 4 a row): one row is the work of batch_size=4
            assert "a micro-batch is 1 packed row(s) of up to 256 tokens, about 3 examples" in err
        rows = read_metrics(tmp_path / attn / "metrics.jsonl")
        losses[attn] = [r["loss"] for r in rows if "loss" in r]
    assert len(losses["sdpa"]) == 3
    torch.testing.assert_close(losses["sdpa"], losses["eager"], atol=1e-5, rtol=1e-5)
