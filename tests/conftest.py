"""Shared fixtures: tiny random models built in code (with SmolLM2's tokenizer cut to what data/ uses), recipes
written to tmp dirs, and helpers to run the CLIs in-process or as subprocesses."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import forked

ROOT = Path(__file__).resolve().parents[1]
# LLM_FORGE_TOKENIZER: a directory holding the same tokenizer's files, for a machine with its own environment
# and without the bundled package (a lent GPU machine: docs/benchmarks.md says how it was run there)
SMOLLM2_TOKENIZER = os.environ.get("LLM_FORGE_TOKENIZER", "bundled:smollm2-135m-instruct")
# the tiny models' tokenizer: SmolLM2's, cut to the 3,749 tokens data/ uses (tests/small_vocab.py says why)
TOKENIZER = str(ROOT / "tests/tokenizer")
TINY_ARCH = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# `precision: auto` would mean bf16 on CPUs with native bf16 and on GPUs: recipes here mean fp32 everywhere
os.environ["LLM_FORGE_PRECISION_AUTO"] = "no"
# CPU MFU is measured against this fixed ceiling (FLOP/s) instead of a torch.mm probe of this machine
# (training.model.matmul_ceiling): runs do not pay for the probe, and nothing depends on the CPU kind
os.environ["LLM_FORGE_CPU_PEAK_FLOPS"] = "1.7e11"
# `make test` runs one pytest-xdist worker per core: each worker's in-process runs, and the processes it
# starts, keep to one thread each (a second thread would only contend with the other worker's work)
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


# The files whose tests suffer most from a neighbour's load (Chromium's renderer; ZeRO-3 generation, one gloo
# collective per layer per token) run one after the other on one worker, first: paired with each other, late
# in the run (xdist's default order puts files with fewer tests last), they took 432 s and 367 s against
# 112 s and 65 s alone. The other files follow in xdist's order (most tests first).
RUN_FIRST_ON_ONE_WORKER = ("tests/app/test_app_browser.py", "tests/integration/test_agent_rl.py")


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A fixture that exits (train_inprocess's run refused: SystemExit 2, its message on stderr) fails as any error
    does. SystemExit is no Exception to pytest: the fixture was left half set up, its exit shown for the first test,
    and every later test asking for it errored on an AssertionError inside pytest, the cause out of sight."""
    try:
        return (yield)
    except SystemExit as e:
        error = RuntimeError(f"fixture {fixturedef.argname!r} exited with code {e.code}: its stderr says why")
        fixturedef.cached_result = (None, fixturedef.cache_key(request), (error, None))
        raise error from e


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    tests_in = {}
    for item in items:
        tests_in[_file_of(item.nodeid)] = tests_in.get(_file_of(item.nodeid), 0) + 1

    def order(item):
        file = _file_of(item.nodeid)
        if file in RUN_FIRST_ON_ONE_WORKER:
            return (0, RUN_FIRST_ON_ONE_WORKER.index(file))
        return (1, -tests_in[file])

    items.sort(key=order)  # stable: a file's tests keep their order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked `alone` (the browser walk) runs with the machine to itself, its set-up and tear-down included:
    beside the other worker's tests its processes (Chromium, the app, the runs it starts) waited on each other's
    turn for the CPU, and the walk took 604 s instead of 150 s (quiet 2-core Zen 4, while the app's page still asked
    itself again; since then 80 s against 64 s, and the suite no shorter without the lock). Every other test holds
    the run's lock shared, the one alone holds it exclusive; a gate taken before it keeps new tests from starting
    while it waits for the running ones to end."""
    lock = _run_dir(item.config) / "machine.lock"
    alone = item.get_closest_marker("alone") is not None
    with (
        _flock(lock.with_suffix(".gate"), fcntl.LOCK_EX, hold=alone),
        _flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH),
    ):
        return (yield)


def _run_dir(config) -> Path:
    """A directory of this pytest run that its xdist workers share (each has its own basetemp below it)."""
    base = config._tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _flock(path: Path, mode: int, hold: bool = True):
    """flock(2) on `path` for the block (`hold`), or only until the lock is had (a gate passed through)."""
    with open(path, "a") as f:
        fcntl.flock(f, mode)
        if not hold:
            fcntl.flock(f, fcntl.LOCK_UN)
        yield


def pytest_collection_finish(session):
    """The heap the imports and the collection made is frozen (gc.freeze): the collector no longer walks its
    millions of objects at each full collection a run's allocations trigger (reading a tokenizer's JSON did, 0.3-0.4 s
    a run). The fork server does the same before its forks (tests/warm_server.py)."""
    gc.collect()
    gc.freeze()


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (make test), with RUN_FIRST_ON_ONE_WORKER as one unit of work and the collection's
    order kept (pytest_collection_modifyitems above decides it)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = _file_of(nodeid)
            return "first-on-one-worker" if file in RUN_FIRST_ON_ONE_WORKER else file

    config.option.loadscopereorder = False
    return Scheduling(config, log)


def deep_update(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama saved with save_pretrained (+ the tiny models' tokenizer): a 'pretrained' model."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), TOKENIZER)


@pytest.fixture(scope="session")
def smollm2_tiny_model_dir(tmp_path_factory) -> Path:
    """The same tiny Llama over SmolLM2's whole tokenizer, for what needs that one: llama.cpp's GGUF converter
    knows a BPE pre-tokenizer by the ids it makes of a fixed text, and refuses the cut one as unknown."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama-smollm2"), SMOLLM2_TOKENIZER)


def save_tiny_model(out: Path, tokenizer: str) -> Path:
    """A tiny random Llama (seed 0) over `tokenizer`'s vocabulary, saved with it in `out`."""
    from transformers import AutoModelForCausalLM

    from training.config import Architecture, ModelSection
    from training.data.tokenizer import load_tokenizer
    from training.model.build import from_scratch_config

    tok = load_tokenizer(ModelSection(name_or_path=tokenizer))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(from_scratch_config(Architecture(**TINY_ARCH), tok))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def save_reward_model(out: Path, num_labels: int = 1) -> Path:
    """A tiny random LlamaForSequenceClassification (a reward model with `num_labels` scores) saved with the
    tiny models' tokenizer, as a checkpoint trained elsewhere would be."""
    from transformers import LlamaForSequenceClassification

    from training.config import Architecture, ModelSection
    from training.data.tokenizer import load_tokenizer
    from training.model.build import from_scratch_config

    tok = load_tokenizer(ModelSection(name_or_path=TOKENIZER))
    config = from_scratch_config(Architecture(**TINY_ARCH), tok)
    config.num_labels = num_labels
    torch.manual_seed(1)
    LlamaForSequenceClassification(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory) -> Path:
    return save_reward_model(tmp_path_factory.mktemp("tiny-reward-model"))


def own_scores(path, texts: list[str]) -> list[float]:
    """A reward model's score of each text alone, with plain transformers (no padding, no special tokens
    added, as TRL tokenizes for reward models)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [
            model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() for t in texts
        ]


@pytest.fixture
def make_recipe(tmp_path):
    """make_recipe(**sections) -> path of a recipe YAML for a tiny from-scratch model on bundled data."""

    def _make(name: str = "recipe.yaml", **extra) -> Path:
        base = {
            "output_dir": str(tmp_path / "run"),
            "seed": 0,
            "model": {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH)},
            "data": {
                "train": str(ROOT / "data/tiny_stories.txt"),
                "format": "text",
                "max_length": 32,
                "max_examples": 200,
            },
            "train": {"lr": 3e-3, "batch_size": 4, "max_steps": 6, "warmup_steps": 0},
            "eval": {"at_start": False},
        }
        if "name_or_path" in extra.get("model", {}):  # a pretrained model replaces the from-scratch one
            base["model"] = {}
        recipe = deep_update(base, extra)
        path = tmp_path / name
        path.write_text(yaml.safe_dump(recipe))
        return path

    return _make


def run_cli(
    module: str, *args: str, env: dict | None = None, timeout: int = 600, fresh: bool | None = None
) -> subprocess.CompletedProcess:
    """`python -m module args...` from the repo root: forked from the worker's fork server (tests/forked.py),
    or, given `env` (which may change what a library reads when it is imported), a fresh interpreter;
    `fresh=False` forks with an `env` that only our code reads, when it runs (LLM_FORGE_FAULT)."""
    argv = [sys.executable, "-m", module, *map(str, args)]
    fresh = env is not None if fresh is None else fresh
    return forked.run(argv, env={**os.environ, **(env or {})}, cwd=ROOT, timeout=timeout, fresh=fresh)


def train_inprocess(*argv: str) -> int:
    """Run training.train.main in this process (fast: no interpreter start-up), resetting accelerate's
    process-wide state afterwards so the next run can pick a different precision or backend."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from training.train import main

    try:
        return main(list(map(str, argv)))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        PartialState._reset_state()


def picture_records(path: Path) -> Path:
    """Two chats in `path` (chat records): a picture question, and a longer chat whose picture comes in its second user turn (a cut
    inside that picture still leaves the first answer to learn)."""
    image = str(ROOT / "data/shapes/images/0000.png")
    question = [{"type": "image", "image": image}, {"type": "text", "text": "What colour is the shape?"}]
    first = "Tell me which colour you like best, of all the colours there are in the world, and why."
    chats = [
        [{"role": "user", "content": question}, {"role": "assistant", "content": "green"}],
        [
            {"role": "user", "content": first},
            {"role": "assistant", "content": "green, as it is the colour of the leaves"},
            {"role": "user", "content": question},
            {"role": "assistant", "content": "green"},
        ],
    ]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    return path
