"""Activation offload: the tensors chosen transformer layers save for backward go to host memory in forward and come
back in backward, so that the device holds no saved activations of those layers between the two.

Megatron-Core's ``cpu_offloading`` / ``cpu_offloading_num_layers`` and torchtune's ``OffloadActivations`` do the
same on the same PyTorch mechanism, ``torch.autograd.graph.saved_tensors_hooks``: a pack hook runs on every tensor
autograd saves, an unpack hook when backward needs it. Here (:class:`ActivationOffload`):

- pack: a saved tensor that is not a parameter (it shares no storage with one of the layer's parameters, the
  FSDP2-gathered and tp-local ones included: those are model states, whatever saves them) is copied to a host
  tensor (page-locked on CUDA) and the device tensor is released by autograd (it is freed once forward no longer
  uses it); autocast's weight copies count as activations here and go too;
- unpack: the host copy comes back to the device (a new device tensor, prefetched or copied then: below; dropped
  after its last use).

Which layers: the first ``activation_offload_layers`` of every pipeline stage (all of a stage's when it holds
fewer; :func:`offloaded_layers`), as Megatron's ``cpu_offloading_num_layers`` counts them. The layers of a stage
whose backward comes right after its forward gain least; with 1F1B every stage holds up to ``pp - rank``
micro-batches' activations of all its layers, and an offloaded layer holds none of them.

Copies overlap compute (as Megatron-Core's ``cpu_offloading`` double buffering and torchtune's
``OffloadActivations(use_streams=True)`` do): on CUDA each device-to-host copy runs on a side stream (the offload
stream) into page-locked memory (PyTorch's caching host allocator keeps the pinned blocks for the next step). No
``record_stream``: the hooks hold a reference to each device storage being copied until the event recorded after its
layer's copies has completed (``torch.cuda.Event.query``) or the compute stream has waited for it, and only then
drop it, so the storage is freed on the compute stream that allocated it, after its copy, as Megatron-Core and
torchtune hold theirs (``record_stream`` would leave the block to the allocator's own event polling, reserved for an
unbounded time after the tensor is freed). An offloaded layer starting its forward first drops the references of
every layer whose copies have completed, then makes the compute stream wait for the copies of all the layers but the
last :data:`LAYERS_IN_FLIGHT` and drops theirs (Megatron-Core's double buffering): without that bound, copies slower
than the forward would hold every offloaded layer's saved set until backward. So beyond the saved tensors the rank
keeps, at most the previous offloaded layer's saved set of a micro-batch is held, and during an offloaded layer's
forward its own, being copied (the last offloaded layer's, while its copies run or until the next offloaded layer
starts; the references left when the forward ends are dropped when backward needs the layer, after waiting for its
copies, or at the next offloaded layer's start): with kept layers after it, it is still held at the loss' backward.
``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``) show it; the CUDA memory estimate counts it in
every phase until backward reaches the layer (:func:`lightning_4d.planning.offload_costs.copies_in_flight`, whose
layer count a test keeps equal to :data:`LAYERS_IN_FLIGHT`).

In backward a layer's tensors are prefetched whole, on a second side stream, while the layer after it (the one
backward runs first) runs its backward: the trigger is a pre-hook on the autograd node of that next layer's output
(when it is in the same pipeline stage). The prefetch's device memory is allocated on the compute stream (from its
pool: ``torch.empty`` before the copy is queued), the reload stream waits for the compute stream, copies into it
and records an event that the compute stream waits for at the first unpack: the storage is then used and freed on
the stream that allocated it, no ``record_stream``. Each prefetched storage is shared by the views saved on it and
dropped after its last use. The device therefore holds one offloaded layer's saved set more during the backward of
the layer after it (the memory model counts it: :func:`lightning_4d.planning.offload_costs.prefetched_bytes`). A layer
with no next layer in its stage (the last layer of a stage offloaded whole) brings its tensors back node by node, each
when its node needs it, waiting for the copy. The step-time model charges only the part of the copies the compute does
not hide.

On CPU (tests, ``lightning-4d measure``) the "host" copy is another CPU tensor made outside any
``TorchDispatchMode`` (``_compat.dispatch.untracked``), so :class:`~lightning_4d.measure.LiveTensorBytes` counts device
memory only, as it would on CUDA; the unpacked copy is a new tensor (``clone``), as the host-to-device copy is.

Not with activation checkpointing (a checkpointed layer's own hooks take its saved tensors; Megatron-Core refuses
the combination too): ``ParallelConfig`` and ``FourDStrategy`` raise ``ValueError``. With ``compile=True`` the hooks
stay outside the compiled region (:mod:`lightning_4d.parallel.compile`) and take the tensors the compiled graph
saves.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

from lightning_4d.parallel._compat.dispatch import untracked
from lightning_4d.parallel._compat.dtensor import local_tensor


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


#: offloaded layers whose device-to-host copies may still run when the next offloaded layer's forward starts: 1 (the
#: previous layer's copies overlap this layer's forward; those of the one before must be done), as Megatron-Core's
#: ``cpu_offloading`` double buffering bounds them (module docstring)
LAYERS_IN_FLIGHT = 1


class _Streams:
    """The two side streams of one CUDA device (offload: device to host in forward; reload: host to device
    prefetches in backward), made once per process and device, and the offloaded layers whose copies to host may
    still run (``in_flight``, oldest first: ``(event, copies)``, the event recorded after the layer's copies, the
    :class:`_LayerCopies` that holds the device storages being copied)."""

    _made: dict[torch.device, "_Streams"] = {}

    def __init__(self, device: torch.device) -> None:
        self.offload = torch.cuda.Stream(device)
        self.reload = torch.cuda.Stream(device)
        self.in_flight: collections.deque = collections.deque()

    def bound_in_flight(self, compute: Any) -> None:
        """Called when an offloaded layer starts offloading: drop the device storages of every layer whose copies
        have completed (its event's ``query()``), then make stream ``compute`` wait for the copies of all but the
        last :data:`LAYERS_IN_FLIGHT` layers and drop theirs (module docstring: the bound on what is held)."""
        for event, copies in self.in_flight:
            if event.query():  # the copy has read the storages: freeing them now is safe on any stream
                copies.release()
        # released here or by backward (which waited for the copies): no longer in flight
        self.in_flight = collections.deque(entry for entry in self.in_flight if entry[1].sources)
        while len(self.in_flight) > LAYERS_IN_FLIGHT:
            event, copies = self.in_flight.popleft()
            compute.wait_event(event)  # the compute stream reuses the storages' blocks only after the copy
            copies.release()

    def held_layers(self) -> int:
        """Offloaded layers whose device storages are still held for their copies to host."""
        return sum(1 for _, copies in self.in_flight if copies.sources)

    @classmethod
    def of(cls, device: torch.device) -> Optional["_Streams"]:
        """The streams of ``device``; ``None`` on a device without streams (CPU: copies there are in program order)."""
        if device.type != "cuda":
            return None
        if device not in cls._made:
            cls._made[device] = cls(device)
        return cls._made[device]


class _LayerCopies:
    """The host copies one offloaded layer made in one forward (one micro-batch), and their prefetched device
    copies in backward.

    ``host[key]`` is a storage's host copy (``key``: its position in this forward), ``uses[key]`` how many saved
    tensors are views of it and not yet unpacked; ``device[key]`` its prefetched device storage, dropped at its last
    use (``uses`` reaching 0) so that the views saved on it share one device copy."""

    def __init__(self, streams: Optional[_Streams]) -> None:
        self.streams = streams
        self.host: list[torch.Tensor] = []
        self.uses: list[int] = []
        self.device: dict[int, tuple[torch.Tensor, Any]] = {}
        self.copied: Any = None  # the event after the last device-to-host copy (CUDA)
        #: the device storages being copied to host (CUDA), held until ``copied`` has completed (module docstring)
        self.sources: list[torch.Tensor] = []
        self.prefetched = False

    def add(self, host: torch.Tensor) -> int:
        self.host.append(host)
        self.uses.append(0)
        return len(self.host) - 1

    def release(self) -> None:
        """Drop the device storages held for the copies to host: call once ``copied`` has completed or the stream
        that frees them has waited for it."""
        self.sources = []

    def _copies_done(self, compute: Any) -> None:
        """Make stream ``compute`` wait for this layer's copies to host and drop the device storages held for them
        (backward needs the host copies now)."""
        if self.copied is not None:
            compute.wait_event(self.copied)
        self.release()
        if self.streams is not None:  # no longer in flight: the streams' list would keep its host copies alive
            self.streams.in_flight = collections.deque(e for e in self.streams.in_flight if e[1] is not self)

    def prefetch(self, device: torch.device) -> None:
        """Start bringing every storage still to be used back to ``device`` (on CUDA on the reload stream, after
        the forward's copies to host; on CPU a copy now)."""
        if self.prefetched:
            return
        self.prefetched = True
        streams = self.streams
        if streams is not None:
            compute = torch.cuda.current_stream(device)
            self._copies_done(compute)
            # allocated on the compute stream (its pool), filled on the reload stream once the compute stream's
            # work queued so far (the block's previous uses) is done; used and freed on the compute stream
            copies = {k: torch.empty_like(h, device=device) for k, h in enumerate(self.host) if self.uses[k] > 0}
            streams.reload.wait_stream(compute)
            with torch.cuda.stream(streams.reload):
                for k, d in copies.items():
                    d.copy_(self.host[k], non_blocking=True)
            ready = streams.reload.record_event()
            self.device.update({k: (d, ready) for k, d in copies.items()})
        else:
            self.device.update({k: (h.clone(), None) for k, h in enumerate(self.host) if self.uses[k] > 0})

    def take(self, key: int, device: torch.device) -> torch.Tensor:
        """The device storage of ``key`` for one unpack: the prefetched one (dropped here at its last use), else a
        copy made now (after the forward's copy to host, on CUDA)."""
        self.uses[key] -= 1
        if key in self.device:
            flat, ready = self.device.pop(key) if self.uses[key] <= 0 else self.device[key]
            if ready is not None:
                torch.cuda.current_stream(device).wait_event(ready)  # allocated on this stream: no record_stream
            return flat
        host = self.host[key]
        if device.type == "cpu":
            return host.clone()  # a new device storage, as the host-to-device copy is
        self._copies_done(torch.cuda.current_stream(device))
        return host.to(device, non_blocking=True)


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
        self._copied: dict[int, tuple[Any, int]] = {}
        self._parameters: Optional[set[int]] = None
        self._copies: Optional[_LayerCopies] = None
        #: the copies of this layer's last forward, kept (when a next layer prefetches them: ``prefetched_by_next``)
        #: until the next layer's forward links its prefetch to them
        self.last_copies: Optional[_LayerCopies] = None
        self.prefetched_by_next = False
        super().__init__(self._pack, self._unpack)

    def __exit__(self, *args: Any) -> None:
        copies = self._copies
        if copies is not None and copies.streams is not None:
            copies.copied = copies.streams.offload.record_event()
            copies.streams.in_flight.append((copies.copied, copies))
        self.last_copies = copies if self.prefetched_by_next else None
        self._copies = None
        self._copied.clear()
        self._parameters = None
        super().__exit__(*args)

    def _parameter_storages(self) -> set[int]:
        """The storages of the layer's parameters in this forward, read at its first pack (after FSDP2's pre-forward
        hook, which runs after the offload's, has gathered them) and kept until the forward ends."""
        if self._parameters is None:
            self._parameters = {_storage_key(p) for p in self.layer.parameters()}
        return self._parameters

    def _to_host(self, local: torch.Tensor) -> torch.Tensor:
        """A host copy of ``local``'s whole storage (bytes), on the offload stream on CUDA."""
        if self._copies is None:
            self._copies = _LayerCopies(_Streams.of(local.device))
            if self._copies.streams is not None:
                self._copies.streams.bound_in_flight(torch.cuda.current_stream(local.device))
        streams = self._copies.streams
        with untracked():
            flat = torch.empty(0, dtype=torch.uint8, device=local.device).set_(local.untyped_storage())
            host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=streams is not None)
            if streams is None:
                host.copy_(flat)
            else:
                streams.offload.wait_stream(torch.cuda.current_stream(local.device))
                with torch.cuda.stream(streams.offload):
                    host.copy_(flat, non_blocking=True)
                self._copies.sources.append(flat)  # held until the copy has read it (module docstring)
        self.stats._add(host.numel())
        weakref.finalize(host, self.stats._add, -host.numel())
        return host

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
        local = local_tensor(t)
        # a view made again for each use (``x.view(-1, h)`` of wq, wk, wv) is a new object every time: its base
        # (or the tensor itself) alive proves the storage was not freed and reused since it was copied
        owner = local._base if local._base is not None else local
        known = self._copied.get(ptr)
        if known is not None and known[0]() is owner:
            key = known[1]
        else:
            host = self._to_host(local)
            key = self._copies.add(host)
            self._copied[ptr] = (weakref.ref(owner), key)
        copies = self._copies
        copies.uses[key] += 1
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if dtensor else None
        return (local.device, copies, key, local.dtype, local.storage_offset(), local.size(), local.stride(), spec)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, copies, key, dtype, offset, size, stride, spec = packed
        flat = copies.take(key, device)
        local = torch.empty(0, dtype=dtype, device=flat.device).set_(flat.untyped_storage(), offset, size, stride)
        if spec is None:
            return local
        mesh, placements, shape, global_stride = spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=global_stride)


def offloaded_layers(stages: list[tuple[int, range]], count: int) -> list[int]:
    """The decoder layers (global indices) whose activations go to host: the first ``count`` of each pipeline stage
    in ``stages`` (``ParallelConfig.rank_stages``: ``(stage, layers)`` of one pp rank), all of a shorter stage's."""
    return [i for _, layers in stages for i in list(layers)[:count]]


def _first_grad_tensor(out: Any) -> Optional[torch.Tensor]:
    """The first tensor with an autograd node in a layer's output (a tensor, or a tuple whose first is one)."""
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            return t
    return None


def _prefetch_hook(hooks: ActivationOffload) -> Any:
    """A forward hook for the layer after ``hooks``' layer: when backward reaches the node that made its output (the
    start of its backward), prefetch what ``hooks``' layer saved in the same micro-batch (its forward ran just
    before)."""

    def hook(module: nn.Module, args: Any, out: Any) -> None:
        copies, t = hooks.last_copies, _first_grad_tensor(out)
        hooks.last_copies = None
        if copies is None or t is None:
            return
        device = local_tensor(t).device
        t.grad_fn.register_prehook(lambda grads: copies.prefetch(device))

    return hook


def apply_activation_offload(
    layers: nn.Module, indices: list[int], stats: OffloadStats, stages: Optional[list[tuple[int, range]]] = None
) -> None:
    """Enter an :class:`ActivationOffload` around the forward of each layer of ``layers`` (an ``nn.ModuleDict`` or
    ``nn.ModuleList`` of decoder layers, keyed by global index) at ``indices``, by forward pre- and post-hooks (the
    post-hook also when forward raises), so parameter names do not change; and a forward hook on the layer after
    each (in the same pipeline stage of ``stages``, ``ParallelConfig.rank_stages``; all of ``layers`` are one stage
    without it) that prefetches the offloaded layer's tensors when backward starts on it (module docstring)."""
    from lightning_4d.module_tree import layer_items

    items = dict(layer_items(layers))
    stage_of = {i: stage for stage, r in stages for i in r} if stages is not None else None
    for index in indices:
        layer = items[str(index)]
        hooks = ActivationOffload(layer, stats)
        layer.register_forward_pre_hook(lambda module, args, _h=hooks: _h.__enter__())
        layer.register_forward_hook(lambda module, args, out, _h=hooks: _h.__exit__(None, None, None), always_call=True)
        after = items.get(str(index + 1))
        if after is not None and (stage_of is None or stage_of.get(index + 1) == stage_of.get(index)):
            hooks.prefetched_by_next = True
            after.register_forward_hook(_prefetch_hook(hooks))
