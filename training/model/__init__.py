"""Layer 3, model: building and loading models, adapters (LoRA/QLoRA), attention kernels, FLOPs and the speed report, optimizers.

Rule: one device's concerns: never imports torch.distributed, accelerate's plugins or the layers above; imports core, config, launch, run.
"""
