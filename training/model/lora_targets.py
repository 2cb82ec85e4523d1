"""What `target_modules: all-linear` adapts on a Mixture-of-Experts model, chosen here rather than left to
chance, and what the adapters then cover, said at start-up.

In transformers 5 most MoE families keep their experts as fused 3-D parameters (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`) in a module that is not an `nn.Linear`, and their router as its own module. peft's
`all-linear` finds only `nn.Linear` layers, so by itself it would leave the experts, most of such a model,
frozen (unless peft's v4->v5 conversion happens to know the family, when it also adapts the router and
drops the linear layers it renames, such as Qwen2-MoE's shared expert). Here `all-linear` on a model with
fused experts means:
- every linear layer but the output head and the router, as peft's `all-linear` would;
- the experts' fused weights, as peft `target_parameters` (LoRA on each expert's slice: peft's ParamWrapper);
- the router left out (it decides which experts see a token; name it in target_modules or target_parameters
  to adapt it on purpose).
Linear layers that peft's conversion would rename for that family are given as parameters too, so that none
is dropped. peft's ParamWrapper has no dropout: the schema's default dropout becomes 0 there (said at
start-up); a dropout the recipe sets is refused naming the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from training.config import Lora
from training.core.errors import RecipeError

ROUTER_NAMES = ("gate", "router")  # what the MoE families call the router inside their sparse block


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The module under peft's wrappers (their `base_layer` chain)."""
    while isinstance(getattr(module, "base_layer", None), torch.nn.Module):
        module = module.base_layer
    return module


def is_expert_module(module: torch.nn.Module) -> bool:
    return "expert" in type(unwrapped(module)).__name__.lower()


def fused_expert_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """name -> parameter of every fused expert weight: a 3-D floating parameter held by an experts module."""
    out = {}
    for name, module in model.named_modules():
        if is_expert_module(module):
            for pname, p in module.named_parameters(recurse=False):
                if p.ndim == 3 and p.is_floating_point():
                    out[f"{name}.{pname}" if name else pname] = p
    return out


def router_modules(model: torch.nn.Module) -> list[str]:
    """Names of the routers: the children of a block that holds experts named gate/router or of a Router
    class (a linear one included)."""
    found = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if not any(is_expert_module(c) for c in children.values()):
            continue
        for child_name, child in children.items():
            if child_name in ROUTER_NAMES or "router" in type(unwrapped(child)).__name__.lower():
                found.append(f"{name}.{child_name}" if name else child_name)
    return found


def unwrapped_name(name: str) -> str:
    """A parameter's or module's name as in the model before peft wrapped it (its `base_layer`s dropped)."""
    return name.replace(".base_layer", "")


def layer_suffix(name: str) -> str:
    """`model.layers.3.mlp.experts.down_proj` -> `mlp.experts.down_proj`: the name within its layer (peft
    matches target names as suffixes), the whole name where there is no numbered layer."""
    return re.sub(r"^.*?\.\d+\.", "", name)


def renamed_by_peft(model: torch.nn.Module) -> set[str]:
    """Leaf names that peft's v4->v5 MoE conversion turns from target modules into expert parameters for this
    model's family (peft.utils.transformers_weight_conversion; any target ending in one is renamed)."""
    try:
        from peft.utils.transformers_weight_conversion import (
            _MODEL_TO_CONVERSION_PATTERN,
            _MOE_TARGET_MODULE_MAPPING,
        )
    except ImportError:  # a peft without the conversion renames nothing
        return set()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return set(_MOE_TARGET_MODULE_MAPPING.get(_MODEL_TO_CONVERSION_PATTERN.get(model_type), {}))


@dataclass
class Targets:
    """peft's target_modules / target_parameters and the dropout for them; `note` says what was decided."""

    modules: str | list[str]
    parameters: list[str] | None
    dropout: float
    note: str = ""
    routers: list[str] = field(default_factory=list)


def state_space_out_projs(model: torch.nn.Module) -> set[str]:
    """Names of the `out_proj` linear layers inside state-space mixers (Mamba and its hybrids): peft refuses
    LoRA on them for these families, so all-linear leaves them out."""
    found = set()
    for name, module in model.named_modules():
        if sequence_state_layer_of(module):
            found |= {
                f"{name}.{n}"
                for n, m in module.named_modules()
                if n.endswith("out_proj") and isinstance(m, torch.nn.Linear)
            }
    return found


def linears_with_own_forward(model: torch.nn.Module) -> set[str]:
    """Names of the model's nn.Linear subclasses whose own forward is not a linear map of the last dimension
    (DeepSeek-V4's grouped o_a_proj: a block-diagonal product over groups): peft's LoRA would add a plain
    x @ A @ B of the whole width to their output, of the wrong shape, so all-linear leaves them out. Only
    transformers' model classes are looked at (quantised linears of bitsandbytes or torchao have their own
    forward too), and one that computes x @ W.T + b its own way (Falcon's FalconLinear) stays in."""
    return {
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and type(m).forward is not torch.nn.Linear.forward
        and type(m).__module__.startswith("transformers.models.")
        and not acts_linear(m)
    }


@torch.no_grad()
def acts_linear(m: torch.nn.Linear) -> bool:
    """Whether the layer's forward gives F.linear's answer on two rows (its shape only, on the meta device)."""
    x = torch.randn(2, m.in_features, dtype=m.weight.dtype, device=m.weight.device)
    try:
        y = m(x)
    except Exception:  # noqa: BLE001 (a forward that wants other inputs is not a plain linear map)
        return False
    if not isinstance(y, torch.Tensor):  # Llama 4's router (an nn.Linear) returns scores and logits
        return False
    want = torch.nn.functional.linear(x, m.weight, m.bias)
    return y.shape == want.shape and (y.is_meta or torch.allclose(y, want, rtol=1e-3, atol=1e-3))


def sequence_state_layer_of(module: torch.nn.Module) -> bool:
    return any(k in type(module).__name__.lower() for k in ("mamba", "mixer"))


def resolve(model: torch.nn.Module, lc: Lora) -> Targets:
    """The adapters' targets of method.lora on `model` (see the module doc); a dense model, or explicit
    targets, go to peft as they are."""
    if lc.target_modules != "all-linear":
        return Targets(lc.target_modules, lc.target_parameters, lc.dropout)
    experts = fused_expert_parameters(model)
    mixer_outs, own = state_space_out_projs(model), linears_with_own_forward(model)
    if not (experts or mixer_outs or own):
        return Targets(lc.target_modules, lc.target_parameters, lc.dropout)
    routers = router_modules(model) if experts else []
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    renamed = renamed_by_peft(model)
    modules, parameters = set(), set(lc.target_parameters or map(layer_suffix, experts))
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head or name in mixer_outs | own:
            continue
        if any(name == r or name.startswith(r + ".") for r in routers):
            continue
        suffix = layer_suffix(name)
        if suffix.rsplit(".", 1)[-1] in renamed:
            parameters.add(f"{suffix}.weight")  # as a parameter, which peft's conversion leaves alone
        else:
            modules.add(suffix)
    notes = [expert_note(lc)] if experts else []
    if mixer_outs:
        notes.append(
            "the state-space mixers' out_proj layers stay frozen (peft adapts no out_proj of this family)"
        )
    if own:
        kinds = sorted({f"{layer_suffix(n)} ({type(model.get_submodule(n)).__name__})" for n in own})
        notes.append(
            f"{', '.join(kinds)} stay frozen: linear layers with a forward of their own, which LoRA does not fit"
        )
    dropout = expert_dropout(lc) if experts else lc.dropout
    return Targets(
        sorted(modules), sorted(parameters) or None, dropout, "; ".join(filter(None, notes)), routers
    )


def expert_dropout(lc: Lora) -> float:
    """0.0 for adapters on fused experts: peft's ParamWrapper has no dropout. A dropout the recipe set is
    refused (RecipeError naming method.lora.dropout); the schema's default gives way."""
    if lc.dropout == 0:
        return 0.0
    if "dropout" in lc.model_fields_set:
        raise RecipeError(
            f"method.lora.dropout: {lc.dropout:g} cannot apply to this Mixture-of-Experts model's experts: with "
            "target_modules all-linear their fused weights are adapted as parameters (peft's ParamWrapper), which "
            "take no dropout; set method.lora.dropout: 0.0, or list the linear layers to adapt in "
            "method.lora.target_modules to leave the experts frozen"
        )
    return 0.0


def expert_note(lc: Lora) -> str:
    if lc.dropout == 0:
        return ""
    return f"method.lora.dropout {lc.dropout:g} (the default) -> 0 (peft's adapters on fused expert weights take no dropout)"


# ----------------------------------------------------------------------------- what the adapters cover


@dataclass
class Coverage:
    """Elements of the base model's parameters under adapters, by part, and the experts left frozen."""

    total: int
    linear: int = 0
    experts: int = 0
    router: int = 0
    frozen_experts: dict[str, int] = field(default_factory=dict)
    routers_frozen: int = 0

    def line(self) -> str:
        pct = lambda n: f"{100 * n / max(self.total, 1):.1f}%"  # noqa: E731
        adapted = self.linear + self.experts + self.router
        parts = [f"linear layers {pct(self.linear)}"]
        if self.experts or self.frozen_experts:
            parts.append(f"experts {pct(self.experts)}")
            parts.append(
                f"router {pct(self.router)}" if self.router else f"router frozen ({pct(self.routers_frozen)})"
            )
        return (
            f"LoRA adapters on {pct(adapted)} of the model's {self.total / 1e6:.1f}M parameters: "
            + ", ".join(parts)
        )


def coverage(peft_model) -> Coverage:
    """What the adapters of a peft model cover (peft's own record of the modules and parameters it
    targeted), the parameters of the base counted once."""
    base = peft_model.get_base_model()
    lora = peft_model.base_model
    clean = {unwrapped_name(n): p.numel() for n, p in base.named_parameters() if "lora_" not in n}
    routers = router_modules(base)
    in_router = lambda name: any(name == r or name.startswith(r + ".") for r in routers)  # noqa: E731
    experts = {unwrapped_name(n): p.numel() for n, p in fused_expert_parameters(base).items()}
    out = Coverage(total=sum(clean.values()))
    by_module: dict[str, list[str]] = {}
    for n in clean:
        by_module.setdefault(n.rsplit(".", 1)[0], []).append(n)
    adapted = {unwrapped_name(n) for n in getattr(lora, "targeted_parameter_names", [])}
    for module in getattr(lora, "targeted_module_names", []):
        adapted.update(by_module.get(unwrapped_name(module), []))
    for name in adapted:
        n = clean.get(name, 0)
        if name in experts:
            out.experts += n
        elif in_router(name.rsplit(".", 1)[0]) or in_router(name):
            out.router += n
        else:
            out.linear += n
    out.frozen_experts = {n: k for n, k in experts.items() if n not in adapted}
    out.routers_frozen = sum(k for n, k in clean.items() if in_router(n) and n not in adapted)
    return out


def check_experts_adapted(cov: Coverage, lc: Lora) -> None:
    """all-linear on an MoE model must not leave its experts frozen (RecipeError naming them)."""
    if lc.target_modules != "all-linear" or lc.target_parameters is not None or not cov.frozen_experts:
        return  # the recipe chose the parameters to adapt
    names = sorted({layer_suffix(n) for n in cov.frozen_experts})
    share = 100 * sum(cov.frozen_experts.values()) / max(cov.total, 1)
    raise RecipeError(
        f"method.lora.target_modules: all-linear leaves this model's experts frozen ({', '.join(names)}: "
        f"{share:.1f}% of its parameters); name them in method.lora.target_parameters, or list the linear layers "
        "to adapt in method.lora.target_modules to train without the experts on purpose"
    )
