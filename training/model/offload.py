"""Activation offloading: the tensors the forward saves for the backward move to pinned host memory while
the forward goes on, and come back when the backward needs them (torch's saved-tensor hooks, as torchtune's
OffloadActivations and TRL do). With gradient checkpointing, what the forward saves is each layer's input
(the recomputed layer's own tensors live inside its checkpoint and are not offloaded), so the accelerator
then holds the inputs of no layer but the one at work: 2 bytes x hidden x layers per token come off it.

The copies to the host run on a side stream, so the forward does not wait for them; the allocator is told
(`record_stream`) that the saved tensor is in use there until the copy ends. A tensor comes back on the
compute stream after that stream has waited for the copies. Parameters (saved by every matmul's backward)
and tensors under `min_bytes` stay where they are.

A run on the CPU is refused (training.model.build): there is no accelerator memory to relieve. The hooks take
their two moves as arguments so that the tests drive them on the CPU with stand-in moves."""

from __future__ import annotations

from collections.abc import Callable

import torch

MIN_BYTES = 1 << 20  # smaller tensors (norm statistics, masks) are not worth a transfer


class ActivationOffload:
    """Saved-tensor hooks that move large saved activations off the accelerator and back.

    to_host(t) -> host tensor, to_device(host, device) -> tensor: the moves (default: pinned memory on a side
    stream of t's CUDA device, and back on the current stream); tensors on a device of type `host` are in host
    memory already and stay. `moved` counts tensors and bytes moved."""

    def __init__(
        self,
        min_bytes: int = MIN_BYTES,
        to_host: Callable[[torch.Tensor], torch.Tensor] | None = None,
        to_device: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None,
        host: str = "cpu",
    ):
        self.min_bytes, self.host = min_bytes, host
        self.to_host = to_host or self._to_pinned
        self.to_device = to_device or self._from_pinned
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.moved = {"tensors": 0, "bytes": 0}

    def pack(self, t: torch.Tensor):
        size = t.numel() * t.element_size()
        if isinstance(t, torch.nn.Parameter) or t.device.type == self.host or size < self.min_bytes:
            return t
        self.moved["tensors"] += 1
        self.moved["bytes"] += size
        return (t.device, self.to_host(t))

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return self.to_device(host, device)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def _to_pinned(self, t: torch.Tensor) -> torch.Tensor:
        stream = self._stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is computed before it is copied
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # its memory is not reused until the copy is done
        return host

    def _from_pinned(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        torch.cuda.current_stream(device).wait_stream(self._stream(device))
        return host.to(device, non_blocking=True)


def install(model: torch.nn.Module, offload: ActivationOffload) -> None:
    """Every forward of `model` (with gradients) runs under the offloading hooks: entered by a forward
    pre-hook and left by a forward hook that runs even when the forward raises."""
    state: dict[str, torch.autograd.graph.saved_tensors_hooks] = {}

    def enter(module, args):
        state["hooks"] = offload.hooks()
        state["hooks"].__enter__()

    def leave(module, args, output):
        if (hooks := state.pop("hooks", None)) is not None:
            hooks.__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    model._activation_offload = offload
