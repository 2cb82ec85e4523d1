"""The memory planner: exact model states on a real tiny model, sharding, offload, fit and recommendation, CLI errors."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import ROOT, SMOLLM2_TOKENIZER, TINY_ARCH, TOKENIZER
from training.config import load_recipe
from training.launch.backend import read_backends
from training.plan import main
from training.planning.activations import activation_bytes, micro_batch
from training.planning.inventory import inventory
from training.planning.memory import GiB, estimate
from training.planning.report import format_plan

DS = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto"},
}


FSDP2 = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": True}}


def mesh(dp_replicate=1, dp_shard=1, tp=1) -> dict:
    sizes = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "cp": 1}
    return {"parallelism_config": {f"parallelism_config_{k}_size": v for k, v in sizes.items()}}


def write_configs(folder: Path, *names: str) -> Path:
    """Accelerate config files of the usual shapes, independent of the repository's accelerate_configs/."""
    folder.mkdir(exist_ok=True)
    specs = {
        "single": {"distributed_type": "NO"},
        "ddp": {"distributed_type": "MULTI_GPU"},
        "fsdp": {
            "distributed_type": "FSDP",
            "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_offload_params": False},
        },
        "zero2": {
            "distributed_type": "DEEPSPEED",
            "deepspeed_config": {"deepspeed_config_file": "zero2.json"},
        },
        "zero2_offload": {
            "distributed_type": "DEEPSPEED",
            "deepspeed_config": {"deepspeed_config_file": "zero2_offload.json"},
        },
        "zero3": {
            "distributed_type": "DEEPSPEED",
            "deepspeed_config": {
                "zero_stage": 3,
                "offload_optimizer_device": "none",
                "offload_param_device": "none",
            },
        },
        "tp": {"distributed_type": "MULTI_GPU", "num_processes": 2, **mesh(tp=2)},
        "fsdp_tp": {**FSDP2, "num_processes": 4, **mesh(dp_shard=2, tp=2)},
        "hsdp": {**FSDP2, "num_processes": 4, **mesh(dp_replicate=2, dp_shard=2)},
        "zero3_offload": {
            "distributed_type": "DEEPSPEED",
            "deepspeed_config": {
                "zero_stage": 3,
                "offload_optimizer_device": "cpu",
                "offload_param_device": "cpu",
            },
        },
    }
    for n in ("zero3", "zero3_offload"):  # without it training refuses ZeRO-3 (final/ could not be exported)
        specs[n]["deepspeed_config"]["zero3_save_16bit_model"] = True
    for n in names:
        (folder / f"{n}.yaml").write_text(
            yaml.safe_dump(
                {"num_machines": 1, "num_processes": 2, "use_cpu": False, **specs[n]}, sort_keys=False
            )
        )
    (folder / "zero2.json").write_text(json.dumps(DS))
    off = json.loads(json.dumps(DS))
    off["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    (folder / "zero2_offload.json").write_text(json.dumps(off))
    return folder


def by_name(plans, ckpt=False):
    return {p.backend: p for p in plans if p.gradient_checkpointing == ckpt}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("method", ["full", "lora"])
def test_model_states_equal_real_tensor_sizes(method, make_recipe, tiny_model_dir, tmp_path):
    from training.data.tokenizer import load_tokenizer
    from training.model.build import build_model
    from training.model.optim import build_optimizer

    extra = (
        {"model": {"name_or_path": str(tiny_model_dir)}, "method": {"type": "lora", "lora": {"r": 4}}}
        if method == "lora"
        else {}
    )
    recipe = load_recipe(make_recipe(**extra))
    plan = by_name(estimate(recipe, 1, 80, 64, configs_dir=write_configs(tmp_path / "cfg", "single")))[
        "single"
    ]

    torch.manual_seed(0)
    model = build_model(recipe, load_tokenizer(recipe.model), torch.device("cpu"))
    optimizer = build_optimizer(model, recipe.train)
    ids = torch.randint(0, 100, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    assert plan.params_gib * GiB == params
    assert plan.grads_gib * GiB == grads
    assert plan.optimizer_gib * GiB == states
    if method == "lora":
        assert grads < params / 10  # only the adapters train


def test_sharding_divides_by_number_of_gpus(make_recipe, tmp_path):
    recipe = load_recipe(make_recipe(precision="bf16"))
    cfg = write_configs(tmp_path / "cfg", "ddp", "fsdp", "zero3")
    one, four = (
        by_name(estimate(recipe, 1, 80, 64, configs_dir=cfg)),
        by_name(estimate(recipe, 4, 80, 64, configs_dir=cfg)),
    )
    for name in ("fsdp", "zero3"):
        assert four[name].devices == 4
        for part in ("params_gib", "grads_gib", "optimizer_gib"):
            assert getattr(four[name], part) * GiB == int(getattr(one[name], part) * GiB) // 4, (name, part)
    # DeepSpeed keeps 16 bytes/param in bf16 (2 params + 2 grads + 12 fp32 master/moments), before sharding
    z3 = one["zero3"]
    assert (z3.params_gib + z3.grads_gib + z3.optimizer_gib) * GiB == pytest.approx(
        16 * z3.params_gib * GiB / 2, rel=1e-9
    )
    assert (
        four["ddp"].params_gib == one["ddp"].params_gib
        and four["ddp"].optimizer_gib == one["ddp"].optimizer_gib
    )


def test_rl_full_fine_tuning_with_kl_counts_the_frozen_copy(make_recipe, tmp_path):
    """rl.beta > 0 with method.type=full keeps a frozen copy of the model (the KL reference): its
    parameters once more, no gradients, no optimizer state; beta 0 keeps none."""
    data = {"train": str(ROOT / "data/rl/train.jsonl"), "format": "prompts"}
    cfg = write_configs(tmp_path / "cfg", "single", "ddp", "zero2")
    plans = {}
    for beta in (0.0, 0.04):
        rl = {"rewards": [{"function": "length_penalty"}], "beta": beta}
        recipe = load_recipe(make_recipe(f"beta{beta}.yaml", precision="bf16", data=data, rl=rl))
        plans[beta] = by_name(estimate(recipe, 2, 80, 64, configs_dir=cfg))
    for name in ("single", "ddp", "zero2"):
        without, kept = plans[0.0][name], plans[0.04][name]
        assert kept.params_gib == 2 * without.params_gib > 0, name
        assert (kept.grads_gib, kept.optimizer_gib) == (without.grads_gib, without.optimizer_gib), name
        assert kept.peak_gib == pytest.approx(without.peak_gib + without.params_gib, rel=1e-9), name


def test_rl_num_iterations_counts_the_kept_sampling_log_probabilities(make_recipe, tmp_path):
    """rl.num_iterations > 1 keeps one fp32 log-probability per token of the window's rollouts between steps:
    (max_length + max_new_tokens) x batch x num_generations x accumulation x 4 bytes more."""
    data = {"train": str(ROOT / "data/rl/train.jsonl"), "format": "prompts"}
    cfg = write_configs(tmp_path / "cfg", "single")
    act = {}
    for mu in (1, 2):
        rl = {"rewards": [{"function": "length_penalty"}], "num_iterations": mu, "max_new_tokens": 16}
        train = {"grad_accum": 2}
        recipe = load_recipe(make_recipe(f"mu{mu}.yaml", precision="bf16", data=data, rl=rl, train=train))
        act[mu] = by_name(estimate(recipe, 1, 80, 64, configs_dir=cfg))["single"].activations_gib
    assert (act[2] - act[1]) * GiB == pytest.approx((32 + 16) * 4 * 4 * 2 * 4, rel=1e-3)


def test_rl_async_counts_the_generating_copy_and_its_snapshots(make_recipe, tmp_path):
    """rl.async = K (full fine-tuning: every weight trainable): the generating copy's weights and K snapshots,
    (1 + K) x the parameters more, no gradients or optimizer state; its KV cache beside the step's
    activations. The synchronous run keeps none of it."""
    data = {"train": str(ROOT / "data/rl/train.jsonl"), "format": "prompts"}
    cfg = write_configs(tmp_path / "cfg", "single", "ddp")
    plans = {}
    for k in (0, 1, 2):
        rl = {"rewards": [{"function": "length_penalty"}], "async": k}
        recipe = load_recipe(make_recipe(f"async{k}.yaml", precision="bf16", data=data, rl=rl))
        plans[k] = by_name(estimate(recipe, 2, 80, 64, configs_dir=cfg))
    for name in ("single", "ddp"):
        sync = plans[0][name]
        for k in (1, 2):
            got = plans[k][name]
            assert got.params_gib == pytest.approx((2 + k) * sync.params_gib, rel=1e-9), (name, k)
            assert (got.grads_gib, got.optimizer_gib) == (sync.grads_gib, sync.optimizer_gib), name
            assert got.activations_gib > sync.activations_gib, name
        assert plans[2][name].activations_gib == plans[1][name].activations_gib  # one KV cache at a time


def test_a_lora_policy_generating_under_bf16_counts_its_merged_copy(make_recipe, tiny_model_dir, tmp_path):
    """A LoRA run's rollouts under bf16 are drawn from a copy of the base with the adapter merged
    (training/generation/merged.py): the base's parameters once more on each process or GPU, no gradients or
    optimizer state. Not in fp32, not under rl.async (its draws go through the adapter)."""
    data = {"train": str(ROOT / "data/rl/train.jsonl"), "format": "prompts"}
    cfg = write_configs(tmp_path / "cfg", "single")
    for name, kind in (("cpu", "NO"), ("cpu_ddp", "MULTI_CPU")):
        spec = {"num_machines": 1, "num_processes": 2, "use_cpu": True, "distributed_type": kind}
        (cfg / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    rl = {"rewards": [{"function": "length_penalty"}]}
    lora = {"type": "lora", "lora": {"r": 4}}
    plans = {}
    for how, extra in {"bf16": {}, "no": {}, "async": {"async": 1}}.items():
        precision = "no" if how == "no" else "bf16"
        model = {"name_or_path": str(tiny_model_dir)}
        recipe = make_recipe(
            f"{how}.yaml", precision=precision, data=data, rl=rl | extra, method=lora, model=model
        )
        recipe = load_recipe(recipe)
        plans[how] = by_name(estimate(recipe, 1, 80, 64, configs_dir=cfg))
    for name in ("cpu", "cpu_ddp", "single"):
        merged, fp32 = plans["bf16"][name], plans["no"][name]
        base = fp32.params_gib - fp32.grads_gib  # all but the adapter (fp32 adapter: its gradients' bytes)
        assert merged.params_gib == pytest.approx(fp32.params_gib + base, rel=1e-9), name
        assert (merged.grads_gib, merged.optimizer_gib) == (fp32.grads_gib, fp32.optimizer_gib), name
        assert plans["async"][name].params_gib < merged.params_gib, name


def test_sharded_rl_counts_the_weights_it_gathers_to_generate(make_recipe, tmp_path):
    """Under ZeRO-3 and FSDP2 the policy generates on its weights gathered whole (rl.gather_for_generation): while
    it does, a device holds the whole model beside its shard, with the rollouts' KV cache, instead of the step's
    activations. A wide model on short sequences, so that generation is the larger: the plan grows with the
    gathering, by less than the whole model and its cache; nothing changes where the weights stay sharded or are
    not sharded."""
    data = {"train": str(ROOT / "data/rl/train.jsonl"), "format": "prompts", "max_length": 16}
    cfg = write_configs(tmp_path / "cfg", "single", "ddp", "fsdp", "zero3")
    wide = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16}
    model = {"from_scratch": {**TINY_ARCH, **wide}, "tokenizer": TOKENIZER}
    plans = {}
    for gather in (True, False):
        rl = {"rewards": [{"function": "length_penalty"}], "gather_for_generation": gather}
        rl |= {"max_new_tokens": 8, "num_generations": 2}
        train = {"batch_size": 1}
        recipe = load_recipe(make_recipe(f"{gather}.yaml", model=model, data=data, rl=rl, train=train))
        plans[gather] = by_name(estimate(recipe, 2, 80, 64, configs_dir=cfg))
    for name in ("single", "ddp"):
        assert plans[True][name] == plans[False][name], name
    on, off = plans[True]["fsdp"], plans[False]["fsdp"]
    grew = on.activations_gib - off.activations_gib
    assert 0 < grew < 2 * on.params_gib + 0.01  # the whole model is twice a shard over 2 GPUs
    held = on.params_gib + on.optimizer_gib + on.buffers_gib + on.activations_gib
    assert on.peak_gib >= max(held - 1e-9, off.peak_gib)  # the peak holds it
    assert (on.params_gib, on.buffers_gib) == (off.params_gib, off.buffers_gib)
    # ZeRO-3's buffers already hold up to stage3_max_live_parameters (1e9) gathered: this whole model
    assert plans[True]["zero3"] == plans[False]["zero3"]


def test_rl_counts_the_kv_cache_of_every_rollout_a_step_draws_at_once(make_recipe, tmp_path):
    """A step's groups are drawn in one call (training/rl/rollouts.py), so the rollouts' KV cache holds
    num_generations x batch_size x grad_accum sequences; on a deep, wide model with short sequences it outgrows
    the loss's logits, and twice the micro-batches hold twice the cache (the step's activations are one
    micro-batch's)."""
    data = {"train": str(ROOT / "data/rl/train.jsonl"), "format": "prompts", "max_length": 64}
    cfg = write_configs(tmp_path / "cfg", "single")
    deep = {"hidden_size": 4096, "intermediate_size": 128, "num_hidden_layers": 32, "num_attention_heads": 32}
    model = {"from_scratch": {**TINY_ARCH, **deep}, "tokenizer": TOKENIZER}
    rl = {"rewards": [{"function": "length_penalty"}], "max_new_tokens": 64, "num_generations": 4}
    act = {}
    for accum in (1, 2):
        train = {"batch_size": 2, "grad_accum": accum}
        recipe = load_recipe(make_recipe(f"a{accum}.yaml", model=model, data=data, rl=rl, train=train))
        act[accum] = by_name(estimate(recipe, 1, 80, 64, configs_dir=cfg))["single"].activations_gib
    # 2 (keys and values) x 32 layers x 4096 features x 128 tokens x 4 x 2 x accum sequences x 4 bytes (fp32)
    kv = 2 * 32 * 4096 * 128 * 4 * 2 * 4 / 2**30
    assert act[2] - act[1] == pytest.approx(kv, rel=1e-6)


def test_rl_counts_the_vocabulary_head_on_the_completions_only(make_recipe, tmp_path):
    """RL's losses make logits from the first scored token on (training/model/logits.py): the plan's vocabulary
    terms (the kept logits, the loss's log-softmax, its exp and their gradients) count max_new_tokens positions a
    sequence, not the prompt's max_length too. The loss's peak stays with a longer prompt and doubles with twice
    the completions; the saved activations grow with the prompt by the layers' terms alone (bytes per token, far
    below one per vocabulary entry). Before, the bundled agent recipe planned 22.9 GiB of host memory and warned
    that it may be killed on a 24 GB machine where it peaks at 9.9 GB. (Planned over SmolLM2's whole vocabulary:
    the suite's cut one is smaller than a tiny layer's bytes per token.)"""
    saved, peak = {}, {}
    for length, new in ((64, 16), (128, 16), (64, 32)):
        data = {"train": str(ROOT / "data/rl/train.jsonl"), "format": "prompts", "max_length": length}
        rl = {"rewards": [{"function": "length_penalty"}], "max_new_tokens": new}
        model = {"tokenizer": SMOLLM2_TOKENIZER}
        recipe = load_recipe(
            make_recipe(f"{length}-{new}.yaml", precision="bf16", model=model, data=data, rl=rl)
        )
        inv = inventory(recipe)
        saved[length, new], peak[length, new] = activation_bytes(recipe, inv, "autocast", False, "sdpa")
    vocab, rows = inv.config.vocab_size, micro_batch(recipe)[1]
    assert peak[128, 16] == peak[64, 16]
    assert peak[64, 32] == pytest.approx(2 * peak[64, 16], rel=1e-6)
    assert 0 < saved[128, 16] - saved[64, 16] < 64 * rows * vocab


def test_rl_on_vllm_counts_the_engines_share_of_each_gpu(make_recipe, tiny_model_dir, tmp_path):
    """rl.generator=vllm: each GPU gives rl.vllm_gpu_memory_utilization of its memory to the colocated engine
    (its weights and KV cache), counted among the buffers; nothing on CPU processes, where it is refused."""
    data = {"train": str(ROOT / "data/rl/train.jsonl"), "format": "prompts"}
    cfg = write_configs(tmp_path / "cfg", "single", "ddp")
    plans = {}
    for generator in ("transformers", "vllm"):
        rl = {"rewards": [{"function": "length_penalty"}], "generator": generator}
        model = {"name_or_path": str(tiny_model_dir)}
        recipe = load_recipe(make_recipe(f"{generator}.yaml", model=model, data=data, rl=rl))
        plans[generator] = by_name(estimate(recipe, 2, 80, 64, configs_dir=cfg))
    for name in ("single", "ddp"):
        plain, vllm = plans["transformers"][name], plans["vllm"][name]
        assert vllm.buffers_gib == pytest.approx(plain.buffers_gib + 0.3 * 80, rel=1e-6), name
        assert vllm.peak_gib == pytest.approx(plain.peak_gib + 0.3 * 80, rel=1e-6), name


def test_offload_moves_optimizer_states_to_host(make_recipe, tmp_path):
    recipe = load_recipe(make_recipe(precision="bf16"))
    plans = by_name(
        estimate(
            recipe,
            2,
            80,
            64,
            configs_dir=write_configs(tmp_path / "cfg", "zero2", "zero2_offload", "zero3_offload"),
        )
    )
    on_gpu, offloaded = plans["zero2"], plans["zero2_offload"]
    assert on_gpu.optimizer_gib > 0 and offloaded.optimizer_gib == 0
    assert (
        offloaded.host_gib >= 2 * on_gpu.optimizer_gib > 0
    )  # both ranks' optimizer shards live in host memory
    assert (
        offloaded.host_gib > on_gpu.host_gib and offloaded.grads_gib == 0
    )  # ZeRO-Offload moves gradients too
    assert offloaded.peak_gib < on_gpu.peak_gib
    assert plans["zero3_offload"].params_gib == 0 and plans["zero3_offload"].host_gib > offloaded.host_gib


def test_too_small_gpu_marks_no_fit_and_changes_recommendation(make_recipe, tmp_path):
    recipe = load_recipe(make_recipe(precision="bf16", train={"batch_size": 8}))
    cfg = write_configs(tmp_path / "cfg", "single", "ddp", "zero3_offload")
    roomy = estimate(recipe, 2, 80, 64, configs_dir=cfg)
    assert all(p.fits for p in roomy) and roomy[0].recommended and roomy[0].backend == "ddp"
    ddp, offload = by_name(roomy)["ddp"], by_name(roomy)["zero3_offload"]
    assert offload.peak_gib < ddp.peak_gib
    squeezed = (ddp.peak_gib + offload.peak_gib) / 2 + 0.75  # between the two, CUDA context included
    tight = estimate(recipe, 2, squeezed, 64, configs_dir=cfg)
    tight_by = by_name(tight)
    assert not tight_by["ddp"].fits and "per GPU" in tight_by["ddp"].reason
    best = next(p for p in tight if p.recommended)
    assert best.backend != "ddp" and best.fits
    text = format_plan(tight)
    assert f"Recommended: {best.backend}" in text and "| ddp |" in text and "no: needs" in text
    nothing = estimate(recipe, 2, 0.01, 64, configs_dir=cfg)
    assert not any(p.fits for p in nothing) and "Nothing fits" in format_plan(nothing)


def test_repository_accelerate_configs_all_parse():
    backends = read_backends(ROOT / "accelerate_configs")
    assert backends and all(b.kind in ("single", "ddp", "fsdp", "deepspeed") for b in backends)
    meshes = {b.name: b.mesh for b in backends if b.mesh}
    assert meshes == {
        "tp": "tp=2",
        "fsdp_tp": "dp_shard=2 x tp=2",
        "hsdp": "dp_replicate=2 x dp_shard=2",
        "cp": "cp=2",
        "pp": "pp=2",
        "pp_dp": "pp=2 x dp_replicate=2",
    }
    assert {b.name: b.sp_size for b in backends if b.sp_size > 1} == {"sp_ulysses": 2}  # DeepSpeed's groups
    for b in backends:
        if "zero3" in b.name:
            assert b.zero_stage == 3
        if "offload" in b.name:
            assert b.offload_optimizer or b.offload_params


def test_cli_prints_table_and_recommendation(make_recipe, tmp_path, capsys):
    cfg = write_configs(tmp_path / "cfg", "single", "zero3_offload")
    assert (
        main(
            [
                str(make_recipe()),
                "--num-gpus",
                "1",
                "--gpu-memory",
                "24GB",
                "--cpu-memory",
                "32GiB",
                "--configs",
                str(cfg),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| single | 1 | full |" in out and "Recommended: single" in out
    assert "accelerate launch --config_file" in out


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--gpu-memory", "lots"], "--gpu-memory"),
        (["--cpu-memory", "-3GiB"], "--cpu-memory"),
        (["--num-gpus", "-1"], "--num-gpus"),
        (["--num-gpus", "two"], "--num-gpus"),
        (["--num-machines", "0"], "--num-machines"),
        (["--configs", "/nonexistent"], "/nonexistent"),
    ],
)
def test_bad_arguments_exit_2_with_message(args, needle, make_recipe, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(make_recipe()), *args])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_missing_recipe_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["no/such/recipe.yaml"])
    assert e.value.code == 2 and "no/such/recipe.yaml" in capsys.readouterr().err


# ----------------------------------------------------------------------------- machines and host memory


def test_plans_only_for_the_machines_named(capsys):
    """`--num-gpus 2 --gpu-memory 24GiB` for full.yaml once recommended multi_node.yaml on 4 devices."""
    recipe = ROOT / "training/recipes/full.yaml"
    assert main([str(recipe), "--num-gpus", "2", "--gpu-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "Recommended: multi_node" not in out and "Recommended: ddp** on 2 device(s)" in out
    assert "| multi_node | 2 | full | off |" in out and "give --num-machines 2 to plan for it" in out
    plans = estimate(load_recipe(recipe), 2, 24)
    assert all(p.devices <= 2 for p in plans if p.fits) and all(p.machines == 1 for p in plans)
    two = by_name(estimate(load_recipe(recipe), 2, 24, num_machines=2))
    assert two["multi_node"].fits and two["multi_node"].devices == 4 and two["ddp"].devices == 4
    assert "--num_processes 4 --num_machines 2 --machine_rank $MACHINE_RANK" in two["multi_node"].command
    assert two["single"].devices == 1 and "--num_machines" not in two["single"].command


def test_host_memory_is_judged_only_against_the_limit_given(make_recipe, tmp_path, monkeypatch):
    recipe = load_recipe(make_recipe(precision="bf16"))
    cfg = write_configs(tmp_path / "cfg", "ddp", "zero3_offload")
    monkeypatch.setattr("os.sysconf", lambda name: 1)  # this machine's RAM must play no part
    free = estimate(recipe, 8, 80, configs_dir=cfg)
    assert all(p.fits and p.host_limit_gib is None for p in free) and all(p.host_gib > 0 for p in free)
    text = format_plan(free)
    assert "Host memory: no limit assumed (no --cpu-memory given" in text and "not judged" in text
    tight = by_name(estimate(recipe, 8, 80, 1e-4, configs_dir=cfg))
    assert not tight["ddp"].fits and "GiB host memory > 0.0001 GiB" in tight["ddp"].reason
    assert "judged against 0.0001 GiB per machine (--cpu-memory)" in format_plan(list(tight.values()))


# ----------------------------------------------------------------------------- meshes: TP, FSDP x TP, HSDP


def norm_bytes(recipe) -> int:
    """Bytes of the tensors the Llama TP plan leaves whole: the RMSNorm weights."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from training.planning.inventory import model_config

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(model_config(recipe))
    return sum(nbytes(p) for name, p in model.named_parameters() if "norm" in name)


def test_tensor_parallel_and_meshes_divide_what_they_shard(make_recipe, tmp_path):
    recipe = load_recipe(make_recipe())
    cfg = write_configs(tmp_path / "cfg", "single", "fsdp", "tp", "fsdp_tp", "hsdp")
    plans = by_name(estimate(recipe, 4, 80, configs_dir=cfg))
    one, tp, fsdp_tp, hsdp, fsdp = (plans[n] for n in ("single", "tp", "fsdp_tp", "hsdp", "fsdp"))
    assert (tp.devices, fsdp_tp.devices, hsdp.devices, fsdp.devices) == (2, 4, 4, 4)
    assert (tp.mesh, fsdp_tp.mesh, hsdp.mesh) == ("tp=2", "dp_shard=2 x tp=2", "dp_replicate=2 x dp_shard=2")
    whole = norm_bytes(recipe)
    for part in ("params_gib", "grads_gib"):  # TP halves the linears and embeddings; norms stay whole
        single_bytes = getattr(one, part) * GiB
        assert getattr(tp, part) * GiB == whole + (single_bytes - whole) // 2, part
        assert getattr(fsdp_tp, part) * GiB == int(getattr(tp, part) * GiB) // 2, part  # then dp_shard=2
        assert getattr(hsdp, part) * GiB == int(single_bytes) // 2, part  # sharded over dp_shard only
        assert getattr(fsdp, part) * GiB == int(single_bytes) // 4, part  # vs all 4 ranks
    assert tp.optimizer_gib < one.optimizer_gib and hsdp.optimizer_gib > fsdp.optimizer_gib
    assert tp.activations_gib < one.activations_gib and fsdp_tp.activations_gib == tp.activations_gib
    assert hsdp.activations_gib == fsdp.activations_gib == one.activations_gib  # data parallel: own batch
    assert "--config_file" in tp.command and " --num_processes 2 " in tp.command
    assert "| tp (tp=2) | 2 |" in format_plan(list(plans.values()))


def test_a_mesh_runs_on_exactly_its_processes(make_recipe, tmp_path):
    recipe = load_recipe(make_recipe())
    cfg = write_configs(tmp_path / "cfg", "ddp", "fsdp_tp", "hsdp")
    many = by_name(estimate(recipe, 8, 80, configs_dir=cfg))
    assert many["ddp"].devices == 8 and many["hsdp"].devices == many["fsdp_tp"].devices == 4
    assert " --num_processes 4 " in many["hsdp"].command and many["hsdp"].fits
    few = by_name(estimate(recipe, 2, 80, configs_dir=cfg))
    assert few["ddp"].fits and not few["hsdp"].fits and not few["fsdp_tp"].recommended
    assert "runs on exactly 4 processes" in few["fsdp_tp"].reason and "gives 2 GPUs" in few["fsdp_tp"].reason


def test_rl_counts_each_reward_model_whole_on_every_device(make_recipe, tmp_path, tiny_reward_model_dir):
    """A reward model is loaded whole by every process (not prepared, so no backend shards it): its
    parameters, in its checkpoint's dtype, on every device, under single, DDP and ZeRO-3 alike."""
    from transformers import AutoModelForSequenceClassification

    reward = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir)
    reward_bytes = sum(p.numel() * p.element_size() for p in reward.parameters())
    data = {"train": str(ROOT / "data/rl/train.jsonl"), "format": "prompts"}
    cfg = write_configs(tmp_path / "cfg", "single", "ddp", "zero3")
    plans = {}
    for name, rewards in (("none", []), ("one", [{"function": "reward_model"}])):
        specs = [{"function": "length_penalty"}] + [
            {**r, "args": {"path": str(tiny_reward_model_dir)}} for r in rewards
        ]
        recipe = load_recipe(make_recipe(f"{name}.yaml", data=data, rl={"rewards": specs}))
        plans[name] = by_name(estimate(recipe, 2, 80, 64, configs_dir=cfg))
    for backend in ("single", "ddp", "zero3"):
        without, with_rm = plans["none"][backend], plans["one"][backend]
        assert (with_rm.params_gib - without.params_gib) * GiB == pytest.approx(reward_bytes, rel=1e-9), (
            backend
        )
        assert (with_rm.grads_gib, with_rm.optimizer_gib) == (without.grads_gib, without.optimizer_gib)
        assert with_rm.peak_gib == pytest.approx(without.peak_gib + reward_bytes / GiB, rel=1e-9), backend


def test_a_distillation_teacher_is_counted_whole_or_sharded_like_the_student_unless_precomputed(
    make_recipe, tmp_path, tiny_model_dir
):
    """A teacher computed on the fly is held in the student's dtype: whole on one process and under DDP,
    sharded over the 2 processes under ZeRO-3 (training.parallel.frozen), with no gradients or optimizer
    state; with distill.top_k no teacher is held while training and the plan is the plain one."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    teacher_bytes = sum(p.numel() * 4 for p in teacher.parameters())  # the student's dtype: fp32
    cfg = write_configs(tmp_path / "cfg", "single", "ddp", "zero3")
    plans = {}
    for name, distill in (
        ("none", None),
        ("fly", {"teacher": str(tiny_model_dir)}),
        ("top_k", {"teacher": str(tiny_model_dir), "top_k": 32}),
    ):
        extra = {"distill": distill} if distill else {}
        recipe = load_recipe(make_recipe(f"{name}.yaml", **extra))
        plans[name] = by_name(estimate(recipe, 2, 80, 64, configs_dir=cfg))
    for backend, held in (("single", teacher_bytes), ("ddp", teacher_bytes), ("zero3", teacher_bytes / 2)):
        plain, fly, top_k = plans["none"][backend], plans["fly"][backend], plans["top_k"][backend]
        assert (fly.params_gib - plain.params_gib) * GiB == pytest.approx(held, rel=1e-9), backend
        assert (fly.grads_gib, fly.optimizer_gib) == (plain.grads_gib, plain.optimizer_gib)
        assert top_k.peak_gib == plain.peak_gib


def test_without_gpus_every_file_is_planned_as_its_cpu_processes(make_recipe, tmp_path):
    """--num-gpus 0: the files run as CPU processes (as training runs them on a CPU-only machine): each on
    its own process count, every process's peak in host memory, judged against --cpu-memory; nothing is
    refused for want of a GPU."""
    recipe = load_recipe(make_recipe())
    cfg = write_configs(tmp_path / "cfg", "single", "ddp", "zero3")
    plans = by_name(estimate(recipe, 0, 80, 64, configs_dir=cfg))
    assert {n: p.devices for n, p in plans.items()} == {"single": 1, "ddp": 2, "zero3": 2}
    assert all(p.fits for p in plans.values()), [p.reason for p in plans.values()]
    ddp, single = plans["ddp"], plans["single"]
    # two processes, each its peak and the heap's retained activations (cpu_heap_retention), and the load copy
    per_process = ddp.peak_gib + ddp.activations_gib
    assert ddp.host_gib == pytest.approx(2 * per_process + 2 * single.params_gib, rel=0.02)
    tight = by_name(estimate(recipe, 0, 80, ddp.host_gib * 0.9, configs_dir=cfg))
    assert not tight["ddp"].fits and "host memory" in tight["ddp"].reason


class NewTensorBytes(TorchDispatchMode):
    """Follows the bytes of the tensors the ops under it create (views and in-place results excluded)
    until they are freed: `peak` is the most alive at once."""

    live = peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = tree_flatten(args)[0]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t._base is None and not any(t is a for a in inputs):
                n = t.untyped_storage().nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self.freed, n)
        return out

    def freed(self, n: int) -> None:
        self.live -= n


def test_the_cpu_adamw_steps_temporaries_are_twice_its_largest_trainable_tensor(make_recipe):
    """On CPU torch's AdamW updates one tensor at a time (its foreach kernels are for CUDA-like devices), so
    its step holds two temporaries of the largest trainable tensor, which the planner allows for (it once
    allowed the gradients' whole size, 2x too much for SmolLM2 under checkpointing)."""
    from training.data.tokenizer import load_tokenizer
    from training.model.build import build_model
    from training.model.optim import build_optimizer
    from training.planning.inventory import inventory

    recipe = load_recipe(make_recipe())
    model = build_model(recipe, load_tokenizer(recipe.model), torch.device("cpu"))
    optimizer = build_optimizer(model, recipe.train, torch.device("cpu"))
    for _ in range(2):  # the second step: the states exist, as in every step of a run
        ids = torch.randint(0, 100, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        with NewTensorBytes() as mode:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    largest = max(nbytes(p) for p in model.parameters())
    assert inventory(recipe).largest_trainable_bytes == largest
    assert mode.peak == pytest.approx(2 * largest, rel=0.01)
