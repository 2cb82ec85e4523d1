"""Layer 2, launch: the backend `accelerate launch` asked for (parsed once per process), the refusal table and the model-config checks.

Rule: knows accelerate config files and ACCELERATE_* variables; works on integers and configs; never imports torch.distributed, and imports only core and config.
"""
