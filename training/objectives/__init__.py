"""Layer 5, objectives: what a step minimises: the one protocol (base.py), the registry of objective kinds
(registry.py), next-token cross-entropy (chunked), preference objectives, distillation, and the MoE
load-balancing loss. Online RL is an objective kind of its own package (training.rl), above this one.

Rule: collectives come in as callables or values (a mesh's ranks, the context's `gather`); never imports
torch.distributed, accelerate's collectives, parallel/, rl/ or loop/.

Importing the package registers its objective kinds (each module registers its own at its end).
"""

from training.objectives import distill, next_token, preference  # noqa: F401 (each registers its kind)
