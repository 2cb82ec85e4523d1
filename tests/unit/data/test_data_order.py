"""The order of training batches: the (length-grouped) shuffle is a function of (seed, epoch) alone, covers
every example once per epoch, is the same on every rank (each taking its own batches of it), and a
resumed run skips exactly the batches it already trained on. Also: the bundled chat data rebuilds byte
for byte."""

import hashlib
import random
import subprocess
import sys
from types import SimpleNamespace

import datasets
import pytest
from accelerate.data_loader import prepare_data_loader, skip_first_batches

from conftest import ROOT
from training.data.loader import EpochSampler, make_loader
from training.data.prompts import make_prompt_loader
from training.loop.fit import batch_stream

N, BATCH = 103, 4


@pytest.fixture(scope="module")
def lengths():
    rng = random.Random(0)
    return [rng.randint(2, 60) for _ in range(N)]


@pytest.fixture(scope="module")
def examples(lengths):
    # example i is [i, i, ...] of its length: a batch's first column names its examples
    return datasets.Dataset.from_list(
        [{"input_ids": [i] * n, "labels": [i] * n} for i, n in enumerate(lengths)]
    )


def tokenizer():
    return SimpleNamespace(pad_token_id=-1)


def ids_of(batch) -> list[int]:
    return batch["input_ids"][:, 0].tolist()


def spread(order, lengths) -> float:
    """Mean (longest - shortest) length within a batch of BATCH consecutive indices."""
    batches = [order[i : i + BATCH] for i in range(0, len(order) - BATCH + 1, BATCH)]
    return sum(max(lengths[j] for j in b) - min(lengths[j] for j in b) for b in batches) / len(batches)


def test_grouped_order_is_a_deterministic_shuffle_of_similar_lengths(lengths):
    grouped = EpochSampler(N, seed=3, lengths=lengths, batch_size=BATCH)
    again = EpochSampler(N, seed=3, lengths=lengths, batch_size=BATCH)  # another process, same recipe
    epoch0 = list(grouped)
    assert sorted(epoch0) == list(range(N))  # every example exactly once
    assert epoch0 == list(again)
    grouped.set_epoch(1)
    again.set_epoch(1)
    epoch1 = list(grouped)
    assert epoch1 == list(again) and sorted(epoch1) == list(range(N))
    assert epoch1 != epoch0  # reshuffled every epoch
    assert list(EpochSampler(N, seed=4, lengths=lengths, batch_size=BATCH)) != epoch0
    random_order = list(EpochSampler(N, seed=3))
    assert spread(epoch0, lengths) < 0.3 * spread(random_order, lengths)  # really grouped


def test_grouped_loader_batches_are_shared_out_between_ranks(examples):
    """Each rank builds the same loader; accelerate gives rank r the global batches r, r+2, ... of it."""
    single = [ids_of(b) for b in make_loader(examples, BATCH, tokenizer(), 5, True, group_by_length=True)]
    ranks = [
        [
            ids_of(b)
            for b in prepare_data_loader(
                make_loader(examples, BATCH, tokenizer(), 5, True, group_by_length=True),
                num_processes=2,
                process_index=r,
            )
        ]
        for r in (0, 1)
    ]
    pairs = len(single) // 2
    assert ranks[0][:pairs] == single[0 : 2 * pairs : 2]
    assert ranks[1][:pairs] == single[1 : 2 * pairs : 2]
    seen = [i for r in ranks for b in r[:pairs] for i in b]
    assert len(seen) == len(set(seen))  # no example on two ranks


def test_grouped_by_the_global_batch_one_rank_and_two_ranks_with_accumulation_train_on_the_same_examples(
    examples,
):
    """Grouped by the global window (training passes batch x ranks x accumulation), one rank with batches of 4
    and two ranks with batches of 1 and 2 accumulated see the same 4 examples in every step."""
    one = [
        set(ids_of(b))
        for b in make_loader(examples, 4, tokenizer(), 5, True, group_by_length=True, group_size=4)
    ]
    ranks = [
        [
            ids_of(b)
            for b in prepare_data_loader(
                make_loader(examples, 1, tokenizer(), 5, True, group_by_length=True, group_size=4),
                num_processes=2,
                process_index=r,
            )
        ]
        for r in (0, 1)
    ]
    for step, want in enumerate(one):  # rank r's micro-batches 2 step and 2 step + 1 (accumulation 2)
        got = {i for r in (0, 1) for b in ranks[r][2 * step : 2 * step + 2] for i in b}
        assert got == want, step
    assert spread([i for w in one for i in sorted(w)], [len(x) for x in examples["input_ids"]]) < 12


def test_group_by_length_auto_groups_spread_out_lengths_and_says_so(caplog):
    """train.group_by_length: auto (the default) groups where random batches would compute under 3/4 of the
    grouped ones' real tokens, and says so; alike lengths, packed rows and text pretraining stay random."""
    import logging

    from training.config import parse_recipe
    from training.data.pipeline import group_by_length

    def recipe(**data):
        raw = {"output_dir": "x", "model": {"name_or_path": "m"}, "data": {"train": "a.jsonl", **data}}
        return parse_recipe({**raw, "train": {"batch_size": 4}})

    spread_out = datasets.Dataset.from_list([{"input_ids": [1] * n} for n in [8, 300, 20, 700] * 30])
    alike = datasets.Dataset.from_list([{"input_ids": [1] * n} for n in [100, 110, 95, 105] * 30])
    with caplog.at_level(logging.INFO, logger="training"):
        assert group_by_length(recipe(format="chat"), spread_out, 8) is True
    assert "length-grouped batches (train.group_by_length: auto)" in caplog.text
    assert group_by_length(recipe(format="chat"), alike, 8) is False
    assert group_by_length(recipe(format="chat", packing=True), spread_out, 8) is False
    assert group_by_length(recipe(format="text"), spread_out, 8) is False
    forced = parse_recipe({**recipe().model_dump(mode="json"), "train": {"group_by_length": False}})
    assert group_by_length(forced, spread_out, 8) is False


def test_resume_skips_exactly_the_batches_already_seen(examples):
    """training.loop.fit.batch_stream from global micro-batch k repeats the uninterrupted stream from k on,
    across an epoch boundary, with the length-grouped order."""
    loader = prepare_data_loader(make_loader(examples, BATCH, tokenizer(), 7, True, group_by_length=True))
    acc = SimpleNamespace(skip_first_batches=skip_first_batches)
    per_epoch = len(loader)
    stream = batch_stream(loader, acc, 0)
    full = [ids_of(next(stream)) for _ in range(2 * per_epoch + 3)]
    assert full[:per_epoch] != full[per_epoch : 2 * per_epoch]
    for start in (5, per_epoch - 1, per_epoch + 2):
        resumed = batch_stream(loader, acc, start)
        assert [ids_of(next(resumed)) for _ in range(per_epoch)] == full[start : start + per_epoch]


def test_bundled_chat_data_rebuilds_byte_for_byte(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "data/make_chat.py"), str(tmp_path)], check=True, cwd=ROOT)
    for name in ("train.jsonl", "test.jsonl"):
        made = hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
        assert made == hashlib.sha256((ROOT / "data/chat" / name).read_bytes()).hexdigest(), name


def test_rl_prompt_windows_repeat_for_num_iterations_the_same_on_one_and_two_ranks():
    """rl.num_iterations=2: each global window of prompts (batch x ranks x accumulation) comes twice in a row,
    so the loader does not skip the prompts of the steps that reuse rollouts; the windows of an epoch are
    disjoint (a last partial window is left out), one rank with batch 4 and two ranks with batch 1 x 2
    accumulation see the same rows at every step, and a resume in the middle of a cycle sees them too."""
    n, window = 18, 4
    prompts = datasets.Dataset.from_list([{"input_ids": [i + 1] * 3, "row": i} for i in range(n)])

    def steps(batch: int, ranks: int, accum: int, start: int = 0) -> list[set]:
        loaders = [
            batch_stream(
                prepare_data_loader(
                    make_prompt_loader(prompts, batch, tokenizer(), 3, True, window, 2),
                    num_processes=ranks,
                    process_index=r,
                ),
                SimpleNamespace(skip_first_batches=skip_first_batches),
                start * accum,
            )
            for r in range(ranks)
        ]
        count = 2 * (n // window) * 2 - start  # two epochs of optimizer steps
        return [
            {i for dl in loaders for _ in range(accum) for i in next(dl)["row"].tolist()}
            for _ in range(count)
        ]

    single = steps(4, 1, 1)
    assert all(len(w) == window for w in single)
    assert single[0::2] == single[1::2]  # every window twice in a row
    epoch = single[0 : 2 * (n // window) : 2]
    assert len(set().union(*epoch)) == (n // window) * window  # disjoint: no prompt skipped or seen twice
    assert single[8:] != single[:8]  # the next epoch reshuffles
    assert steps(1, 2, 2) == single
    assert steps(1, 2, 2, start=3) == single[3:]  # resumed after step 3, which step 4 repeats
