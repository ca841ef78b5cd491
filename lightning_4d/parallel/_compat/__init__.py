"""Every private torch / Lightning / transformers / flash-attn name the package uses, in one package.

Private APIs change without deprecation. Each one the package calls is reached through a module of this package
only, and ``tests/test_compat.py`` checks that every name still exists on the installed versions, so an upgrade that
removes one fails that test loudly instead of silently taking another code path (a missed attribute reset in a
pipeline schedule leaves stale receive buffers and gives wrong results, not an error).

One module per feature the private names serve; importers name the module (``from lightning_4d.parallel._compat.
dtensor import local_tensor``), this package re-exports nothing:

- :mod:`.collectives`: torch's current names of the flat collectives, process groups by argument or by name;
- :mod:`.dispatch`: the dispatch mode below autograd, a tensor wrapper subclass's inner tensors, pytree flattening;
- :mod:`.dtensor`: a DTensor's local storage and offset, flattening and unflattening a ``DeviceMesh``;
- :mod:`.fsdp`: ``fully_shard``'s ``shard_placement_fn``, activation checkpointing's wrapper (and the module it
  wraps) and saved ops;
- :mod:`.kernels`: ``torch._grouped_mm``, ATen's flash attention, flash-attn 2;
- :mod:`.pipeline`: the pipelining schedules' private state;
- :mod:`.compile`: Dynamo's counters and switches, the functional collectives' waiting tensor;
- :mod:`.checkpoint`: DCP's metadata internals, the ``torch.layout`` unpickling;
- :mod:`.lightning`: Lightning's private members (strategy, precision, fit loop, checkpoint lookup), torch's LR
  scheduler's last rates;
- :mod:`.hf`: transformers' attention implementation switch;
- :mod:`.fake`: torch's fake process group and the answers its ranks would receive;
- :mod:`.process`: leaving a process without finalization, the CUDA allocator's history.

The modules import nothing of ours. Tested with torch 2.13.0 and lightning 2.6.6; flash-attn 2.7-2.8 for the
``flash`` kernel (see ``pyproject.toml``).
"""
