"""Layer 5, parallel: the Accelerator and its CPU adaptations, the one Mesh that answers every degree, tensor/expert/sequence/pipeline parallelism, lean start-up, state dicts and checkpoint I/O.

Rule: the only package that touches torch.distributed, DTensor, DeviceMesh, deepspeed or accelerate's plugins; never imports planning/, evals/ or loop/.
"""
