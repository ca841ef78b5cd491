"""Activation offload: the tensors chosen transformer layers save for backward go to host memory in forward and come
back in backward, so that the device holds no saved activations of those layers between the two.

Megatron-Core's ``cpu_offloading`` / ``cpu_offloading_num_layers`` and torchtune's ``OffloadActivations`` do the
same on the same PyTorch mechanism, ``torch.autograd.graph.saved_tensors_hooks``: a pack hook runs on every tensor
autograd saves, an unpack hook when backward needs it. Here (:class:`ActivationOffload`):

- pack: a saved tensor that is not a parameter (it shares no storage with one of the layer's parameters, the
  FSDP2-gathered and tp-local ones included: those are model states, whatever saves them) is copied to a host
  tensor (page-locked on CUDA) and the device tensor is released by autograd (it is freed once forward no longer
  uses it); autocast's weight copies count as activations here and go too;
- unpack: the host copy comes back to the device (a new device tensor, dropped after the node's backward).

Which layers: the first ``activation_offload_layers`` of every pipeline stage (all of a stage's when it holds
fewer; :func:`offloaded_layers`), as Megatron's ``cpu_offloading_num_layers`` counts them. The layers of a stage
whose backward comes right after its forward gain least; with 1F1B every stage holds up to ``pp - rank``
micro-batches' activations of all its layers, and an offloaded layer holds none of them.

Copies are synchronous on the compute stream (``Tensor.copy_`` / ``Tensor.to``, no side stream, no prefetch):
simple and safe, at the cost of the PCIe time (``2 · host bytes / host bandwidth`` per micro-batch, counted by the
step-time model, :mod:`lightning_4d.memory.step_time`). Overlapping them on a side stream is not built (it needs a
GPU to validate; ``docs/memory.md``).

On CPU (tests, ``lightning-4d measure``) the "host" copy is another CPU tensor made outside any
``TorchDispatchMode`` (``_compat.untracked``), so :class:`~lightning_4d.measure.LiveTensorBytes` counts device
memory only, as it would on CUDA; the unpacked copy is a new tensor (``clone``), as the host-to-device copy is.

Not with activation checkpointing (a checkpointed layer's own hooks take its saved tensors; Megatron-Core refuses
the combination too): ``ParallelConfig`` and ``FourDStrategy`` raise ``ValueError``. With ``compile=True`` the hooks
stay outside the compiled region (:mod:`lightning_4d.parallel.compile`) and take the tensors the compiled graph
saves.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

from lightning_4d.parallel._compat import local_tensor, untracked


class OffloadStats:
    """Host bytes the offloaded layers hold (all :class:`ActivationOffload` hooks of one model).

    Attributes:
        live: bytes of host copies alive now.
        peak: the most ``live`` has been since :meth:`reset`.
        packed: bytes copied to host since :meth:`reset` (forward; the same come back in backward).
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.packed = 0

    def reset(self) -> None:
        """Start counting ``peak`` and ``packed`` again (``live`` stays what it is)."""
        self.peak = self.live
        self.packed = 0

    def _add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        if nbytes > 0:
            self.packed += nbytes


def _storage_key(t: torch.Tensor) -> int:
    """The data pointer of ``t``'s (local) storage; -1 where it has none to read (a tensor without real storage)."""
    try:
        return local_tensor(t).untyped_storage().data_ptr() if t.device.type != "meta" else -1
    except RuntimeError:  # "invalid python storage": nothing to offload
        return -1


class ActivationOffload(saved_tensors_hooks):
    """``saved_tensors_hooks`` that keep one layer's saved activations in host memory (module docstring).

    Storages are copied whole, once per forward: a tensor saved several times (the normalized input of ``wq``,
    ``wk`` and ``wv``, each through a view of its own; the attention output as ``[b, s, h]`` and ``[b·s, h]``; the
    RoPE tables) has one host copy, each saved view is rebuilt on it in backward. The hooks remember each copy by
    the storage's address, with a weak reference to the tensor that owns the memory (the view's base), until the
    layer's forward ends; memory freed and reused at the same address belongs to another owner, and gets its own
    copy.

    Args:
        layer: the transformer layer whose parameters are never offloaded (compared by storage at pack time, so
            FSDP2's gathered parameters and tp's local shards are recognized too).
        stats: where the host bytes are counted.
    """

    def __init__(self, layer: nn.Module, stats: OffloadStats) -> None:
        self.layer = layer
        self.stats = stats
        self._copied: dict[int, tuple[Any, torch.Tensor]] = {}
        self._parameters: Optional[set[int]] = None
        super().__init__(self._pack, self._unpack)

    def __exit__(self, *args: Any) -> None:
        self._copied.clear()
        self._parameters = None
        super().__exit__(*args)

    def _parameter_storages(self) -> set[int]:
        """The storages of the layer's parameters in this forward, read at its first pack (after FSDP2's pre-forward
        hook, which runs after the offload's, has gathered them) and kept until the forward ends."""
        if self._parameters is None:
            self._parameters = {_storage_key(p) for p in self.layer.parameters()}
        return self._parameters

    def _pack(self, t: torch.Tensor) -> Any:
        dtensor = isinstance(t, DTensor)
        if (
            isinstance(t, nn.Parameter)
            or t.device.type == "meta"
            or (not dtensor and type(t) is not torch.Tensor)  # another tensor subclass (a pending collective): kept
        ):
            return t
        ptr = _storage_key(t)
        if ptr == -1 or ptr in self._parameter_storages():
            return t
        local = t._local_tensor if dtensor else t
        # a view made again for each use (``x.view(-1, h)`` of wq, wk, wv) is a new object every time: its base
        # (or the tensor itself) alive proves the storage was not freed and reused since it was copied
        owner = local._base if local._base is not None else local
        known = self._copied.get(ptr)
        if known is not None and known[0]() is owner:
            host = known[1]
        else:
            with untracked():
                flat = torch.empty(0, dtype=torch.uint8, device=local.device).set_(local.untyped_storage())
                host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=local.device.type == "cuda")
                host.copy_(flat)
            self.stats._add(host.numel())
            weakref.finalize(host, self.stats._add, -host.numel())
            self._copied[ptr] = (weakref.ref(owner), host)
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if dtensor else None
        return (local.device, host, local.dtype, local.storage_offset(), local.size(), local.stride(), spec)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, dtype, offset, size, stride, spec = packed
        # a new device storage, as the host-to-device copy is (on CPU too), viewed as the saved tensor was
        flat = host.clone() if device.type == "cpu" else host.to(device, non_blocking=False)
        local = torch.empty(0, dtype=dtype, device=flat.device).set_(flat.untyped_storage(), offset, size, stride)
        if spec is None:
            return local
        mesh, placements, shape, global_stride = spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=global_stride)


def offloaded_layers(stages: list[tuple[int, range]], count: int) -> list[int]:
    """The decoder layers (global indices) whose activations go to host: the first ``count`` of each pipeline stage
    in ``stages`` (``ParallelConfig.rank_stages``: ``(stage, layers)`` of one pp rank), all of a shorter stage's."""
    return [i for _, layers in stages for i in list(layers)[:count]]


def apply_activation_offload(layers: nn.Module, indices: list[int], stats: OffloadStats) -> None:
    """Enter an :class:`ActivationOffload` around the forward of each layer of ``layers`` (an ``nn.ModuleDict`` or
    ``nn.ModuleList`` of decoder layers, keyed by global index) at ``indices``, by forward pre- and post-hooks (the
    post-hook also when forward raises), so parameter names do not change."""
    from lightning_4d.module_tree import layer_items

    items = dict(layer_items(layers))
    for index in indices:
        layer = items[str(index)]
        hooks = ActivationOffload(layer, stats)
        layer.register_forward_pre_hook(lambda module, args, _h=hooks: _h.__enter__())
        layer.register_forward_hook(lambda module, args, out, _h=hooks: _h.__exit__(None, None, None), always_call=True)
