"""Planner accuracy: predicted vs measured memory.

CPU (always): model states (parameters, gradients, AdamW states) of real models after one optimizer
step, which the planner must match exactly, and the activations autograd saves in one forward pass
(measured with saved-tensor hooks), which the planner estimates from its per-token formula.
CPU, the Llama-3-8B shape's non-layer terms (full width 4096 and vocabulary 128256, REDUCED_LAYERS
decoder layers, 2048 tokens): the loss alone, full logits vs chunked (training.objectives.next_token), and one whole
QLoRA training step (4-bit NF4, LoRA r16 all-linear, bf16 autocast, gradient checkpointing, paged 8-bit
AdamW), peak memory measured vs the planner's (target within 10%). CPU, one LoRA step of the bundled
SmolLM2-135M in bf16 at 8 x 1024 tokens (benchmarks.vs_trainer's recipe at its longest batch): the
planner's live peak of a CPU process vs the measured one (a whole run's peak RSS adds what glibc's heap keeps
between steps, which the planner's host column counts: docs/planner.md). Each runs in a fresh process whose
peak resident memory (VmHWM, reset through /proc/self/clear_refs) above its baseline is the measure;
glibc's mmap threshold is pinned so freed tensors leave the process at once, as on a GPU allocator.
GPU (when CUDA exists): peak device memory of short real training runs vs the planner's peak (target
within 10%).

    python -m benchmarks.planner_accuracy [--skip-8b]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

from benchmarks.common import (
    ROOT,
    TOKENIZER,
    machine,
    read_rows,
    save_result,
    table,
    tempdir,
    train_inprocess,
    write_recipe,
)

CASES = [  # (label, recipe sections, autocast bf16 on CPU)
    (
        "tiny GQA llama, full, fp32",
        {
            "model": {
                "tokenizer": TOKENIZER,
                "from_scratch": dict(
                    hidden_size=96,
                    intermediate_size=256,
                    num_hidden_layers=3,
                    num_attention_heads=6,
                    num_key_value_heads=2,
                ),
            }
        },
        False,
    ),
    (
        "tiny GQA llama, full, bf16 autocast",
        {
            "model": {
                "tokenizer": TOKENIZER,
                "from_scratch": dict(
                    hidden_size=96,
                    intermediate_size=256,
                    num_hidden_layers=3,
                    num_attention_heads=6,
                    num_key_value_heads=2,
                ),
            },
            "precision": "bf16",
        },
        True,
    ),
    ("SmolLM2-135M, full, fp32", {"model": {"name_or_path": TOKENIZER}}, False),
    (
        "SmolLM2-135M, LoRA r16, fp32",
        {"model": {"name_or_path": TOKENIZER}, "method": {"type": "lora", "lora": {"r": 16, "dropout": 0.0}}},
        False,
    ),
    (
        "SmolLM2-135M, LoRA r16, bf16 autocast",
        {
            "model": {"name_or_path": TOKENIZER},
            "method": {"type": "lora", "lora": {"r": 16, "dropout": 0.0}},
            "precision": "bf16",
        },
        True,
    ),
]
BATCH, SEQ = 2, 128


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def saved_activation_bytes(model, ids: torch.Tensor, autocast: bool) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for backward in one forward + loss."""
    import torch.nn.functional as F

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr and ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    return sum(seen.values())


def accuracy_row(case: str, component: str, predicted: float, measured: float) -> dict:
    """One row of the tables: the planner's and the measured bytes of one component, in MiB, and the error."""
    return {
        "case": case,
        "component": component,
        "predicted_mib": predicted / 2**20,
        "measured_mib": measured / 2**20,
        "error_pct": 100 * (predicted - measured) / measured if measured else 0.0,
    }


def cpu_rows() -> list[dict]:
    from training.config import parse_recipe
    from training.data.tokenizer import load_tokenizer
    from training.launch.backend import read_backend
    from training.model.build import build_model
    from training.model.optim import build_optimizer
    from training.planning.activations import activation_bytes, precision_mode
    from training.planning.inventory import inventory
    from training.planning.memory import plan_backend

    folder = tempdir("plan-acc")
    (folder / "single.yaml").write_text("distributed_type: 'NO'\n")
    single = read_backend(folder / "single.yaml")
    out = []
    for label, sections, autocast in CASES:
        raw = {
            "output_dir": str(folder / "run"),
            "data": {"train": str(ROOT / "data/tiny_stories.txt"), "format": "text", "max_length": SEQ},
            "train": {"batch_size": BATCH, "max_steps": 1},
            **sections,
        }
        recipe = parse_recipe(raw)
        inv = inventory(recipe)
        plan = plan_backend(recipe, inv, single, 1, 80, 64, checkpointing=False)
        mode = precision_mode(recipe, single)
        saved, _ = activation_bytes(recipe, inv, mode, False, "sdpa")
        weight_copies = inv.param_numel * 2 if mode == "autocast" else 0

        torch.manual_seed(0)
        model = build_model(recipe, load_tokenizer(recipe.model), torch.device("cpu"))
        model.train()
        optimizer = build_optimizer(model, recipe.train)
        ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        measured = {
            "parameters": sum(nbytes(p) for p in model.parameters()),
            "gradients": sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None),
            "optimizer states": sum(
                nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
            ),
        }
        optimizer.zero_grad(set_to_none=True)
        measured["saved activations (+ autocast weight copies)"] = saved_activation_bytes(
            model, ids, autocast
        )
        predicted = {
            "parameters": plan.params_gib * 2**30,
            "gradients": plan.grads_gib * 2**30,
            "optimizer states": plan.optimizer_gib * 2**30,
            "saved activations (+ autocast weight copies)": saved + weight_copies,
        }
        for part in measured:
            p, m = predicted[part], measured[part]
            out.append(accuracy_row(label, part, p, m))
        del model, optimizer
    return out


def gpu_rows() -> list[dict]:
    """Peak CUDA memory of 4-step runs of our loop vs the planner's peak for the single backend."""
    from training.config import load_recipe
    from training.planning.memory import estimate

    folder = tempdir("plan-acc-gpu")
    (folder / "cfg").mkdir()
    (folder / "cfg" / "single.yaml").write_text("distributed_type: 'NO'\n")
    corpus = folder / "corpus.txt"
    corpus.write_text((ROOT / "data/tiny_stories.txt").read_text() * 20)
    cases = [
        (
            "SmolLM2-135M full bf16 b8 s512",
            {"model": {"name_or_path": TOKENIZER}, "precision": "bf16", "train": {"batch_size": 8}},
        ),
        (
            "SmolLM2-135M LoRA bf16 b8 s512",
            {
                "model": {"name_or_path": TOKENIZER},
                "precision": "bf16",
                "train": {"batch_size": 8},
                "method": {"type": "lora"},
            },
        ),
        (
            "SmolLM2-135M full bf16 ckpt b16 s512",
            {
                "model": {"name_or_path": TOKENIZER, "gradient_checkpointing": True},
                "precision": "bf16",
                "train": {"batch_size": 16},
            },
        ),
        (
            "SmolLM2-135M QLoRA b8 s512",
            {
                "model": {"name_or_path": TOKENIZER},
                "precision": "bf16",
                "train": {"batch_size": 8},
                "method": {"type": "qlora"},
            },
        ),
    ]
    out = []
    for i, (label, sections) in enumerate(cases):
        raw = {
            "output_dir": str(folder / f"run{i}"),
            "resume": "none",
            "eval": {"at_start": False},
            "data": {"train": str(corpus), "format": "text", "max_length": 512},
            **{k: v for k, v in sections.items() if k != "train"},
            "train": {"max_steps": 4, "lr": 1e-5, **sections.get("train", {})},
        }
        path = write_recipe(raw, folder, f"r{i}.yaml")
        plan = estimate(
            load_recipe(path),
            1,
            torch.cuda.get_device_properties(0).total_memory / 2**30,
            configs_dir=folder / "cfg",
        )[0]
        torch.cuda.reset_peak_memory_stats()
        train_inprocess(path)
        measured = max(r["peak_mem_gb"] for r in read_rows(folder / f"run{i}"))
        out.append(accuracy_row(label, "peak device memory", plan.peak_gib * 2**30, measured * 2**30))
        torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------- the 8B shape, reduced depth

REDUCED_LAYERS = 1
SEQ_8B = 2048


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> int:
    """Reset VmHWM to the current resident size; return that size in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def _peak() -> int:
    return _status_kib("VmHWM") * 1024


def _reduced_8b_config():
    from transformers import LlamaConfig

    from benchmarks.gpu import LLAMA3_8B

    return LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": REDUCED_LAYERS})


def _qlora_8b_recipe(model_dir: str, loss_impl: str = "auto"):
    from training.config import parse_recipe

    return parse_recipe(
        {
            "output_dir": "unused",
            "precision": "bf16",
            "model": {"name_or_path": model_dir, "dtype": "bfloat16", "gradient_checkpointing": True},
            "method": {"type": "qlora", "lora": {"r": 16, "target_modules": "all-linear", "dropout": 0.0}},
            "data": {"train": ["unused.jsonl"], "max_length": SEQ_8B},
            "train": {"batch_size": 1, "optimizer": "paged_adamw_8bit", "loss_impl": loss_impl},
        }
    )


def child_loss(impl: str) -> dict:
    """Peak memory of the loss alone (forward + backward) at the 8B shape: hidden states as under bf16
    autocast (fp32, requiring grad), the QLoRA head (bf16, frozen), SEQ_8B tokens."""
    import torch.nn.functional as F

    from training.objectives.next_token import _full_loss, linear_loss_sum

    cfg = _reduced_8b_config()
    torch.manual_seed(0)
    x = torch.randn(1, SEQ_8B, cfg.hidden_size, requires_grad=True)
    w = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16) * 0.02
    labels = torch.randint(0, cfg.vocab_size, (1, SEQ_8B))
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # what position t predicts (none at the end)
    base = _reset_peak()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if impl == "full":
            loss = _full_loss(F.linear(x, w), targets)
        else:
            loss = linear_loss_sum(x, w, None, targets, "chunked")
    loss.backward()
    return {"peak_bytes": _peak() - base, "loss": loss.item()}


def child_qlora_step(model_dir: str) -> dict:
    """Peak memory of one QLoRA training step (forward, backward, optimizer step) of the reduced-depth 8B
    shape (measured_step)."""
    return measured_step(_qlora_8b_recipe(model_dir), 1, SEQ_8B)


STEPS_PEAK = "peak of two training steps (from before loading)"  # what measured_step's peak_bytes is


def measured_step(recipe, rows: int, length: int) -> dict:
    """Peak memory of training steps of the recipe's model (forward with its loss, in bf16 autocast where
    the recipe's precision is bf16, backward, optimizer step; two steps, the second with the optimizer's
    states resident) on `rows` x `length` random tokens, from before the model loads, with the
    peak of each phase above the resident model; and what is resident after loading (parameters and
    buffers, made resident: safetensors leaves unconverted weights as views of the file, which only become
    resident where touched)."""
    import gc

    from training.data.tokenizer import load_tokenizer
    from training.model.build import build_model
    from training.model.optim import build_optimizer
    from training.objectives.next_token import choose_loss, token_loss

    tokenizer = load_tokenizer(recipe.model)
    if recipe.method.type in ("lora", "qlora"):
        import peft  # noqa: F401  library code (peft loads bitsandbytes) is the process's baseline, not the model's
    torch.manual_seed(0)
    base = _reset_peak()
    model = build_model(recipe, tokenizer, torch.device("cpu"))
    for p in model.parameters():  # resident, as on a GPU
        p.data = p.data.clone()
    gc.collect()
    loaded = _reset_peak()
    choice = choose_loss(model, recipe.train.loss_impl, torch.device("cpu"))
    optimizer = build_optimizer(model, recipe.train)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (rows, length))
    batch = {"input_ids": ids, "labels": ids}
    peak = 0
    # two steps: the optimizer's states appear in the first one's update and are held through every later
    # forward and backward, as in a run (the phases are the second step's)
    for _ in range(2):
        phases = {}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.precision == "bf16"):
            s, n, _ = token_loss(model, batch)
        phases["forward"] = _peak() - loaded
        peak = max(peak, _peak())
        _reset_peak()
        (s / n).backward()
        phases["backward"] = _peak() - loaded
        peak = max(peak, _peak())
        _reset_peak()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        phases["optimizer step"] = _peak() - loaded
        peak = max(peak, _peak())
        _reset_peak()
    return {
        "peak_bytes": peak - base,
        "loaded_bytes": loaded - base,
        "phases": phases,
        "loss": choice.impl,
        "value": (s / n).item(),
    }


# (method, precision, rows, tokens per row): vs_trainer's LoRA recipe at its longest batch, in bf16 (where the
# CPU has native bf16) and fp32 (what `precision: auto` picks elsewhere), and full fine-tuning in both. A
# padded, a length-grouped and a packed batch of that shape hold the same tensors (packing adds position
# ids), so the shape stands for all three.
SMOLLM_STEPS = (
    ("lora", "bf16", 8, 1024, False),
    ("lora", "no", 8, 1024, False),
    ("full", "bf16", 4, 1024, False),
    ("full", "no", 4, 1024, False),
    ("lora", "bf16", 8, 1024, True),
    ("lora", "no", 8, 1024, True),
    ("full", "bf16", 4, 1024, True),
    ("full", "no", 4, 1024, True),
)


def _smollm_recipe(method: str, precision: str, batch: int, seq: int, checkpointing: bool = False):
    from training.config import parse_recipe

    lora = {"lora": {"r": 16, "alpha": 32, "dropout": 0.0}} if method == "lora" else {}
    return parse_recipe(
        {
            "output_dir": str(tempdir("plan-acc-smollm") / "run"),
            "precision": precision,
            "model": {"name_or_path": TOKENIZER, "gradient_checkpointing": checkpointing},
            "method": {"type": method, **lora},
            "data": {"train": str(ROOT / "data/chat/train.jsonl"), "format": "chat", "max_length": seq},
            "train": {"batch_size": batch, "max_steps": 1},
        }
    )


def child_smollm_step(method: str, precision: str, batch: str, seq: str, checkpointing: str = "") -> dict:
    """Peak memory of one training step of the bundled SmolLM2-135M (the chunked loss, as training runs it)
    at batch x seq tokens (measured_step)."""
    recipe = _smollm_recipe(method, precision, int(batch), int(seq), checkpointing == "checkpointing")
    return measured_step(recipe, int(batch), int(seq))


def smollm_rows() -> list[dict]:
    """One training step of SmolLM2-135M for each of SMOLLM_STEPS: the planner's live peak of a CPU process
    against the measured one (a whole run's peak RSS adds the heap's share, docs/planner.md)."""
    from training.planning.memory import GiB, estimate

    folder = tempdir("plan-acc-smollm-cfg")
    (folder / "single.yaml").write_text("distributed_type: 'NO'\n")
    out = []
    for method, precision, batch, seq, ckpt in SMOLLM_STEPS:
        plan = estimate(_smollm_recipe(method, precision, batch, seq, ckpt), 0, configs_dir=folder)[0]
        flag = ["checkpointing"] if ckpt else []
        step = _run_child("smollm-step", method, precision, str(batch), str(seq), *flag)
        what = "LoRA r16" if method == "lora" else "full"
        case = (
            f"SmolLM2-135M + {what}, {'bf16' if precision == 'bf16' else 'fp32'}, {batch} x {seq} tokens"
            f"{', gradient checkpointing' if ckpt else ''}, CPU"
        )
        out.append(accuracy_row(case, STEPS_PEAK, plan.peak_gib * GiB, step["peak_bytes"]))
    return out


def _run_child(*args: str, module: str = "benchmarks.planner_accuracy") -> dict:
    """`python -m module --child ARGS` in a fresh process (glibc's mmap threshold pinned); its last line's JSON."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", module, "--child", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _save_reduced_8b(folder) -> str:
    from transformers import AutoModelForCausalLM

    from training.config import ModelSection
    from training.data.tokenizer import load_tokenizer

    out = folder / f"llama3-8b-shape-{REDUCED_LAYERS}-layers"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_reduced_8b_config(), dtype=torch.bfloat16)
    model.save_pretrained(out)
    load_tokenizer(ModelSection(name_or_path=TOKENIZER)).save_pretrained(out)
    del model
    return str(out)


def reduced_8b_rows() -> list[dict]:
    """The loss alone (full vs chunked, planner's loss terms) and a whole QLoRA step (planner's peak) at
    the Llama-3-8B width and vocabulary with REDUCED_LAYERS layers, 2048 tokens, on CPU."""
    from training.planning.activations import _REST, chunked_loss_bytes
    from training.planning.inventory import inventory
    from training.planning.memory import GiB, estimate

    cfg = _reduced_8b_config()
    folder = tempdir("plan-acc-8b")
    model_dir = _save_reduced_8b(folder)
    recipe = _qlora_8b_recipe(model_dir)
    inv = inventory(recipe, cfg)
    tokens, vocab, h = SEQ_8B, cfg.vocab_size, cfg.hidden_size
    # the loss's own terms, as the planner counts them (mode autocast, LoRA)
    old = _REST[("lora", "autocast")][1] * vocab * (tokens - 1) + tokens * vocab * (8 + 2) + tokens * h * 4
    kept, transient = chunked_loss_bytes(recipe, inv, "autocast", tokens)
    out = []
    for impl, predicted in (("full", old), ("chunked", kept + transient + tokens * h * 4)):
        m = _run_child("loss", impl)["peak_bytes"]
        case = f"loss alone, {impl} logits, 8B head (bf16), {tokens} tokens"
        out.append(
            accuracy_row(case, "peak memory of forward + backward (incl. the input's gradient)", predicted, m)
        )
    (folder / "cfg").mkdir()
    (folder / "cfg" / "single.yaml").write_text("distributed_type: 'NO'\n")
    plan = estimate(recipe, 1, 80, configs_dir=folder / "cfg", config=cfg)[0]
    step = _run_child("qlora-step", model_dir)
    rows = [
        ("parameters + buffers, as loaded", (plan.params_gib + plan.buffers_gib) * GiB, step["loaded_bytes"]),
        (STEPS_PEAK, plan.peak_gib * GiB, step["peak_bytes"]),
    ]
    case = f"QLoRA 8B shape, {REDUCED_LAYERS} layer(s), {tokens} tokens, {step['loss']} loss"
    out.extend(accuracy_row(case, part, p, m) for part, p, m in rows)
    print(
        f"QLoRA step, peak of each phase above the loaded model (MiB): "
        f"{ {k: round(v / 2**20) for k, v in step['phases'].items()} }"
    )
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.planner_accuracy")
    ap.add_argument("--skip-8b", action="store_true", help="leave out the reduced-depth 8B-shape checks")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:  # one measurement in a fresh process (see _run_child)
        kind, *rest = args.child
        children = {"loss": child_loss, "qlora-step": child_qlora_step, "smollm-step": child_smollm_step}
        result = children[kind](*rest)
        print(json.dumps(result))
        return result
    rows = cpu_rows() + smollm_rows()
    gpu = gpu_rows() if torch.cuda.is_available() else []
    headers = ["case", "component", "predicted MiB", "measured MiB", "error %"]
    print(f"## Planner accuracy, CPU (model states must be exact); {machine()}\n")
    print(
        table(
            headers,
            [
                [r["case"], r["component"], r["predicted_mib"], r["measured_mib"], round(r["error_pct"], 2)]
                for r in rows
            ],
        )
    )
    big = [] if args.skip_8b else reduced_8b_rows()
    if big:
        print(f"\n## Llama-3-8B shape at {REDUCED_LAYERS} layer(s), CPU peak memory (target within 10%)\n")
        print(
            table(
                headers,
                [
                    [
                        r["case"],
                        r["component"],
                        r["predicted_mib"],
                        r["measured_mib"],
                        round(r["error_pct"], 2),
                    ]
                    for r in big
                ],
            )
        )
    if gpu:
        print("\n## Planner accuracy, GPU peak memory (target within 10%)\n")
        print(
            table(
                headers,
                [
                    [
                        r["case"],
                        r["component"],
                        r["predicted_mib"],
                        r["measured_mib"],
                        round(r["error_pct"], 2),
                    ]
                    for r in gpu
                ],
            )
        )
    else:
        print("\nGPU peak-memory accuracy: skipped: no CUDA")
    states_exact = all(
        r["error_pct"] == 0 for r in rows if r["component"] in ("parameters", "gradients", "optimizer states")
    )
    result = {
        "cpu": rows,
        "reduced_8b": big or "skipped (--skip-8b)",
        "max_reduced_8b_peak_error_pct": max(
            (abs(r["error_pct"]) for r in big if r["component"].startswith("peak of")), default=None
        ),
        "gpu": gpu or "skipped: no CUDA",
        "model_states_exact": states_exact,
        "max_activation_error_pct": max(abs(r["error_pct"]) for r in rows if "activations" in r["component"]),
        "max_gpu_peak_error_pct": max((abs(r["error_pct"]) for r in gpu), default=None),
    }
    print(f"\nmodel states exact: {states_exact}; results: {save_result('planner_accuracy', result)}")
    return result


if __name__ == "__main__":
    result = main()
    sys.exit(0 if result.get("model_states_exact", True) else 1)
