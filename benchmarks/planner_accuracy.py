"""Planner accuracy: predicted vs measured memory.

CPU (always): model states (parameters, gradients, AdamW states) of real models after one optimizer
step, which the planner must match exactly, and the activations autograd saves in one forward pass
(measured with saved-tensor hooks), which the planner estimates from its per-token formula.
GPU (when CUDA exists): peak device memory of short real training runs vs the planner's peak (target
within 10%).

    python -m benchmarks.planner_accuracy
"""

from __future__ import annotations

import sys

import torch

from benchmarks.common import (
    ROOT,
    TOKENIZER,
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


def cpu_rows() -> list[dict]:
    from training.backends import read_backend
    from training.config import parse_recipe
    from training.models import build_model, load_tokenizer
    from training.optim import build_optimizer
    from training.plan import activation_bytes, inventory, plan_backend, precision_mode

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
            out.append(
                {
                    "case": label,
                    "component": part,
                    "predicted_mib": p / 2**20,
                    "measured_mib": m / 2**20,
                    "error_pct": 100 * (p - m) / m if m else 0.0,
                }
            )
        del model, optimizer
    return out


def gpu_rows() -> list[dict]:
    """Peak CUDA memory of 4-step runs of our loop vs the planner's peak for the single backend."""
    from training.config import load_recipe
    from training.plan import estimate

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
        out.append(
            {
                "case": label,
                "component": "peak device memory",
                "predicted_mib": plan.peak_gib * 1024,
                "measured_mib": measured * 1024,
                "error_pct": 100 * (plan.peak_gib - measured) / measured,
            }
        )
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> dict:
    rows = cpu_rows()
    gpu = gpu_rows() if torch.cuda.is_available() else []
    headers = ["case", "component", "predicted MiB", "measured MiB", "error %"]
    print("## Planner accuracy, CPU (model states must be exact)\n")
    print(
        table(
            headers,
            [
                [r["case"], r["component"], r["predicted_mib"], r["measured_mib"], round(r["error_pct"], 2)]
                for r in rows
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
        "gpu": gpu or "skipped: no CUDA",
        "model_states_exact": states_exact,
        "max_activation_error_pct": max(abs(r["error_pct"]) for r in rows if "activations" in r["component"]),
        "max_gpu_peak_error_pct": max((abs(r["error_pct"]) for r in gpu), default=None),
    }
    print(f"\nmodel states exact: {states_exact}; results: {save_result('planner_accuracy', result)}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["model_states_exact"] else 1)
