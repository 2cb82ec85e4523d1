"""Helpers of the multi-process tests: launching a tiny run under an accelerate config on CPU processes,
reading its metrics and weights, comparing it with one process, killing and resuming it."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import (
    prepare_deepspeed_cmd_env,
    prepare_multi_gpu_env,
    prepare_simple_launcher_cmd_env,
)
from safetensors.torch import load_file

import forked
from conftest import ROOT, TINY_ARCH, TOKENIZER, deep_update

STEPS, CKPT_AT = 6, 3
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


SINGLE = {"train": {"batch_size": 4, "grad_accum": 1}}


TWO_RANKS = ["train.batch_size=1", "train.grad_accum=2"]


SINGLE_OVERRIDES = ["train.batch_size=4", "train.grad_accum=1"]  # one data-parallel rank


def write_recipe(path: Path, output_dir: Path, **extra) -> Path:
    """The multi-process tests' tiny from-scratch recipe (6 steps, a checkpoint and an eval at step 3),
    with `extra` sections merged in (deep_update)."""
    recipe = {
        "output_dir": str(output_dir),
        "seed": 0,
        "model": {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH)},
        "data": {
            "train": str(ROOT / "data/tiny_stories.txt"),
            "format": "text",
            "max_length": 32,
            "max_examples": 200,
            "eval_fraction": 0.05,
        },
        "train": {"lr": 3e-3, "batch_size": 4, "max_steps": STEPS, "warmup_steps": 2, "scheduler": "cosine"},
        "eval": {"at_start": False, "every_steps": CKPT_AT},
        "checkpoint": {"every_steps": CKPT_AT, "keep_last": 5},
    }
    path.write_text(yaml.safe_dump(deep_update(recipe, extra)))
    return path


def free_port() -> int:
    """A free port below the kernel's ephemeral range, for a test that names the port its processes meet
    on before they start. A port from bind(0) is ephemeral: until the processes bind it, a launch running
    on the other test worker (accelerate's main_process_port 0 is a bind(0) too) can be handed the same
    one, and two rendezvous on one port wait for each other until they time out (seen once in CI)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()  # not the tests' seeded global generator
    for _ in range(100):
        port = rng.randrange(20000, max(low, 20001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _picks_a_port(config: str) -> bool:
    """The file's main_process_port is 0: accelerate takes a port from bind(0) and lets it go before the
    rendezvous binds it, so a launch or gloo socket on the other test worker can be handed the same one
    (a launch that waited 900 s in CI); the tests give such a launch a port from free_port instead."""
    return yaml.safe_load((ROOT / "accelerate_configs" / config).read_text()).get("main_process_port") == 0


def launch_cmd(config: str, recipe: Path, *overrides: str, launcher_args: tuple = ()) -> list[str]:
    return [
        ACCELERATE,
        "launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / config),
        *launcher_args,
        "-m",
        "training.train",
        str(recipe),
        *overrides,
    ]


def launch(
    config: str,
    recipe: Path,
    *overrides: str,
    launcher_args: tuple = (),
    timeout: int = 900,
    env: dict | None = None,
    check: bool = True,
    fresh: bool = False,
):
    """`accelerate launch ...` (launch_cmd) to the end, forked from this worker's fork server (tests/forked.py:
    the same console-script entry and argv, without a fresh interpreter's imports, and so are its ranks;
    `fresh`: a new interpreter and ranks, as from a shell); past `timeout` the launcher and every rank it
    started are killed (their own process groups: a rank left behind would hold a port, a file lock or a
    core)."""
    if "--main_process_port" not in launcher_args and _picks_a_port(config):
        launcher_args = (*launcher_args, "--main_process_port", str(free_port()))
    cmd = launch_cmd(config, recipe, *overrides, launcher_args=launcher_args)
    try:
        proc = forked.run(cmd, env={**os.environ, **(env or {})}, cwd=ROOT, timeout=timeout, fresh=fresh)
    except subprocess.TimeoutExpired as e:  # what it printed, then each process's stacks: where it waited
        what = f"{config} still running after {timeout} s:\n{e.stdout[-3000:]}\n{e.stderr[-16000:]}"
        raise AssertionError(what) from None
    assert proc.returncode == 0 or not check, (
        f"{config} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return proc


def rows(run: Path, key: str) -> dict[int, dict]:
    return {
        r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r
    }


def weights(run: Path) -> dict[str, torch.Tensor]:
    """final/'s weights: the model's, or a LoRA run's adapter's."""
    final = run / "final"
    adapter = final / "adapter_model.safetensors"
    return load_file(adapter if adapter.exists() else final / "model.safetensors")


def assert_same_run(run: Path, ref: Path, steps=range(1, STEPS + 1)) -> None:
    """Same training losses, learning rates and eval losses at every step, and the same final weights."""
    got, want = rows(run, "loss"), rows(ref, "loss")
    assert sorted(got) == list(steps), f"{run}: logged steps {sorted(got)}"
    for s in steps:
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=1e-5, abs=1e-5), f"loss at step {s}"
        assert got[s]["lr"] == pytest.approx(want[s]["lr"], rel=1e-9), f"lr at step {s}"
    got_eval, want_eval = rows(run, "eval_loss"), rows(ref, "eval_loss")
    assert set(got_eval) == {s for s in want_eval if s in steps or s == STEPS} and got_eval
    for s in got_eval:
        assert got_eval[s]["eval_loss"] == pytest.approx(want_eval[s]["eval_loss"], rel=1e-5), (
            f"eval loss at step {s}"
        )
    assert_same_weights(run, ref)


def assert_identical_run(run: Path, ref: Path, steps=range(1, STEPS + 1)) -> None:
    """Bit for bit the reference run over `steps` (a resume on CPU in fp32 with the same backend): equal
    training losses, learning rates and eval losses, and torch.equal final weights."""
    got, want = rows(run, "loss"), rows(ref, "loss")
    assert sorted(got) == list(steps), f"{run}: logged steps {sorted(got)}"
    for s in steps:
        assert got[s]["loss"] == want[s]["loss"], f"loss at step {s}"
        assert got[s]["lr"] == want[s]["lr"], f"lr at step {s}"
    got_eval, want_eval = rows(run, "eval_loss"), rows(ref, "eval_loss")
    assert set(got_eval) == {s for s in want_eval if s in steps or s == STEPS} and got_eval
    for s in got_eval:
        assert got_eval[s]["eval_loss"] == want_eval[s]["eval_loss"], f"eval loss at step {s}"
    a, b = weights(run), weights(ref)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max |difference| {(a[k] - b[k]).abs().max().item():.3g}"


def assert_same_weights(run: Path, ref: Path) -> None:
    """final/'s weights (the model's, or the adapter's) equal the reference run's, key by key."""
    a, b = weights(run), weights(ref)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=5e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def with_checkpoint_of(ref: Path, step: int, out: Path) -> Path:
    """A fresh run directory holding only the reference run's step-`step` checkpoint (as if the run had
    been stopped right after saving it)."""
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(ref / "checkpoints" / f"step-{step}", out / "checkpoints" / f"step-{step}")
    return out


def resume_from(ref: Path, step: int, out: Path, recipe: Path, config: str) -> Path:
    """`with_checkpoint_of`, resumed with the same command under the same backend."""
    with_checkpoint_of(ref, step, out)
    proc = launch(config, recipe, f"output_dir={out}", *TWO_RANKS)
    assert f"resumed from {out / 'checkpoints' / f'step-{step}'}" in proc.stderr
    return out


def kill_and_resume(
    config: str, recipe: Path, killed: Path, *overrides: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    """SIGKILL every rank in the middle of step 5 (after the step-3 checkpoint), then run the same command
    again: it resumes from step 3. Returns the resumed launch (the killed one's stderr as its `killed_stderr`);
    the caller compares the whole run (steps 1-3 from before the kill, 4-6 after the resume) with the
    uninterrupted one. `env` is added to the killed launch's environment only."""
    killed_proc = launch(
        config,
        recipe,
        f"output_dir={killed}",
        *overrides,
        env={**(env or {}), "LLM_FORGE_FAULT": "kill@mid_step:5"},
        check=False,
    )
    assert killed_proc.returncode != 0 and not (killed / "final").exists()
    proc = launch(config, recipe, f"output_dir={killed}", *overrides)
    assert f"resumed from {killed / 'checkpoints' / f'step-{CKPT_AT}'}" in proc.stderr
    proc.killed_stderr = killed_proc.stderr
    return proc


def generate_from_finals(finals: list[Path]) -> str:
    """A fresh process without any process group loads each final/ with AutoModelForCausalLM and
    generates 5 tokens; its stdout has one "generated <layers> layers <path> <text>" line per model."""
    code = (
        "import sys\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "for path in sys.argv[1:]:\n"
        "    tok = AutoTokenizer.from_pretrained(path)\n"
        "    model = AutoModelForCausalLM.from_pretrained(path)\n"
        "    ids = tok('Once upon a time', return_tensors='pt').input_ids\n"
        "    out = model.generate(ids, max_new_tokens=5, do_sample=False)\n"
        "    assert out.shape[1] == ids.shape[1] + 5, out.shape\n"
        "    text = tok.decode(out[0, ids.shape[1]:])\n"
        "    print('generated', model.config.num_hidden_layers, 'layers', path, repr(text))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, finals)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


LAUNCHER_ENV = (
    "ACCELERATE_",
    "FSDP_",
    "PARALLELISM_CONFIG_",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "LOCAL_RANK",
    "RANK",
    "MASTER_",
)


def launch_environment(config) -> dict:
    """The launcher variables `accelerate launch --config_file CONFIG -m training.train r.yaml` sets."""
    args = launch_command_parser().parse_args(
        ["--config_file", str(config), "-m", "training.train", "r.yaml"]
    )
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
    elif args.multi_gpu or args.use_fsdp:
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
    if args.use_deepspeed or args.multi_gpu or args.use_fsdp:  # what torchrun adds for each process it starts
        env |= {"WORLD_SIZE": str(args.num_processes), "LOCAL_WORLD_SIZE": str(args.nproc_per_node)}
    return {k: v for k, v in env.items() if k.startswith(LAUNCHER_ENV)}
