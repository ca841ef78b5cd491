"""Our Llama (:class:`lightning_4d.models.llama.LlamaModel`) as a model family (:mod:`lightning_4d.families.base`).

It keeps Meta's module names (``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``), exposes fused
sequence-parallel input projections (``Attention.input_projection``, ``FeedForward.input_projection``,
``LlamaModel.head_projection``), computes vocabulary-parallel logits for :mod:`lightning_4d.parallel.loss`, keeps
float32 master weights under ``bf16-mixed`` and initializes its weights independently of the layout
(:meth:`LlamaModel.init_weights`). Its Hugging Face names and q/k permutation live beside the model
(:mod:`lightning_4d.models.hf_mapping`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_4d.checkpoint import (
    check_complete,
    check_same_model,
    read_folder,
    saved_key,
    saved_shapes,
    tied_aliases,
)
from lightning_4d.families.base import ModelFamily, PipelineLayout
from lightning_4d.families.hf_io import hf_load, hf_reader
from lightning_4d.features.context_parallel.runtime import ContextParallelAttention
from lightning_4d.features.moe import runtime as moe
from lightning_4d.features.tensor_parallel.runtime import TensorParallelPlan
from lightning_4d.models import hf_mapping
from lightning_4d.models.llama import Attention, LlamaModel, canonical_name
from lightning_4d.models.rope import context_parallel_positions, rope_cos_sin
from lightning_4d.parallel._compat.dtensor import local_offset
from lightning_4d.safe_load import load as safe_load

_PLAN = TensorParallelPlan(
    embedding="tok_embeddings",
    layers="layers",
    norm="norm",
    head="output",
    colwise=("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"),
    rowwise=("attention.wo", "feed_forward.w2"),
    layer_norms=("attention_norm", "ffn_norm"),
    gathered_inputs=(("attention", ("args", 3)), ("feed_forward", ("args", 1))),  # (x, cos, sin) / (x,)
    vocab_parallel_logits=True,
    token_parallel=("feed_forward",),  # a MoEFeedForward runs whole on the tp rank's tokens; FeedForward is split
)


def _local_piece(full: torch.Tensor, p: Any) -> torch.Tensor:
    """This rank's piece of DTensor ``p`` as a view of its whole tensor ``full`` (its offset and local shape: shards
    of shards on one dimension, as tp and FSDP2 make them, are one contiguous block), so that initialization holds
    nothing beside ``full`` (``distribute_tensor`` builds every rank's piece: measured on llama3.2-1b tp8 dp8 ZeRO 3,
    two 0.98 GiB copies of the embedding)."""
    offset, shape = local_offset(p), p.to_local().shape
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


class LlamaFamily(moe.LlamaMoEFamily, ModelFamily):
    """``lightning_4d.models.LlamaModel`` (module docstring); its MoE layers' hooks are the MoE feature's
    (:class:`~lightning_4d.features.moe.runtime.LlamaMoEFamily`)."""

    name = "lightning_4d Llama"
    master_weights = True
    activation_checkpointing = True
    compile = True
    float8 = True

    def is_model(self, module: nn.Module) -> bool:
        return isinstance(module, LlamaModel)

    def model_config(self, model: nn.Module) -> Any:
        return model.config

    def pipeline_layout(self, model: nn.Module) -> PipelineLayout:
        return PipelineLayout(embedding="tok_embeddings", layers="layers", norm="norm", head="output")

    def positions(self, model: nn.Module, seq_len: int, cp: tuple[int, int], device: torch.device) -> Tensor:
        return context_parallel_positions(seq_len, cp[0], cp[1], device=device)

    def rotary(self, model: nn.Module, h: Tensor, positions: Tensor) -> Any:
        return rope_cos_sin(model.config, positions)

    def run_layer(
        self, model: nn.Module, layer: nn.Module, h: Tensor, rotary: Any, positions: Tensor, documents: Any = None
    ) -> Tensor:
        return layer(h, *rotary, **(documents or {}))

    def document_inputs(self, model: nn.Module, h: Tensor, document_ids: Tensor) -> Any:
        return model.document_inputs(h, document_ids)

    def run_head(self, model: nn.Module, head: nn.Module, h: Tensor) -> Any:
        return head(h) if model.head_projection is None else model.head_projection(h, head)

    def tensor_parallel_plan(self, model: nn.Module) -> TensorParallelPlan:
        return _PLAN

    def apply_context_parallel(self, model: nn.Module, cp_mesh: Any, method: str) -> None:
        """Every ``Attention``'s ``core_attention`` becomes ring, all-gather or all-to-all attention over ``cp_mesh``
        (:class:`~lightning_4d.features.context_parallel.runtime.ContextParallelAttention`) and the model computes the
        zigzag rotary positions of its local tokens (``LlamaModel.context_parallel``)."""
        core = ContextParallelAttention(cp_mesh.get_group(), method)
        for module in model.modules():
            if isinstance(module, Attention):
                module.core_attention = core
        model.context_parallel = (cp_mesh.get_local_rank(), cp_mesh.size())

    def materialize(self, model: nn.Module, device: torch.device) -> None:
        """``to_empty`` on ``device`` and :meth:`LlamaModel.init_weights` (the same full weights for the same seed on
        every layout), when ``model`` still has meta parameters."""
        if any(p.is_meta for p in model.parameters()):
            model.to_empty(device=device)
            with torch.no_grad():
                model.init_weights(local_piece=_local_piece)

    @torch.no_grad()
    def load_hf(self, model: nn.Module, path: Path) -> None:
        """Read this rank's slices of every parameter of ``model`` (possibly split and sharded) from the Hugging Face
        directory ``path`` with DCP's ``HuggingFaceStorageReader``: each DTensor parameter receives just its shard of
        the file's tensor; q/k rows are permuted after reading their whole heads (the tp shard, a tp-only DTensor),
        then redistributed into the parameter's placements.

        Raises:
            ValueError: a padded vocabulary (Hugging Face files hold ``vocab_size`` rows), a tensor missing (named).
        """
        from torch.distributed.tensor import empty as dtensor_empty

        config = model.config
        if config.padded_vocab_size != config.vocab_size:
            raise ValueError(
                f"init_from={str(path)!r}: Hugging Face weights have vocab_size={config.vocab_size} rows; "
                f"the model pads to {config.padded_vocab_size} (pad_vocab_to_multiple_of="
                f"{config.pad_vocab_to_multiple_of}): use pad_vocab_to_multiple_of=1 to load them"
            )
        config.check_trainable("init_from")
        reader, available = hf_reader(path)
        state: dict[str, torch.Tensor] = {}
        rotary: list[tuple[nn.Parameter, torch.Tensor]] = []
        aliases = tied_aliases(model)  # a tied head's copy (pp > 1) reads the embedding's tensor
        copies: list[tuple[nn.Parameter, torch.Tensor]] = []
        for name, p in model.named_parameters():
            stacked = moe.hf_stacked_targets(p, canonical_name(name), config, available, path)
            if stacked is not None:  # an MoE layer's stacked weight: one Hugging Face tensor per row of dim 0
                state.update(stacked)
                continue
            key = hf_mapping.hf_name(saved_key(canonical_name(name), aliases))
            if key in state:  # the head's copy beside its embedding (a V schedule's rank 0)
                copies.append((p, state[key]))
                continue
            if key not in available:
                raise ValueError(
                    f"init_from={str(path)!r} holds no tensor {key!r} (for our {name!r}); it holds "
                    f"{len(available)} tensors, e.g. {sorted(available)[:3]}: "
                    "is it a Llama of this config?"
                )
            if canonical_name(name).endswith(hf_mapping.ROTARY):
                tmp = (
                    dtensor_empty(p.shape, dtype=p.dtype, device_mesh=p.device_mesh, placements=_tp_only(p))
                    if isinstance(p, DTensor)
                    else torch.empty_like(p)
                )
                rotary.append((p, tmp))
                state[key] = tmp
            else:
                state[key] = p.data
        hf_load(state, reader, path)
        for p, source in copies:
            _local_of(p).copy_(_local_of(source))
        for p, tmp in rotary:
            if isinstance(p, DTensor):
                local = hf_mapping.rotary_from_hf(tmp.to_local(), config.head_dim)
                whole = DTensor.from_local(local, p.device_mesh, tmp.placements, shape=p.shape, stride=p.stride())
                p.data.to_local().copy_(whole.redistribute(p.device_mesh, p.placements).to_local())
            else:
                p.data.copy_(hf_mapping.rotary_from_hf(tmp, config.head_dim))

    @torch.no_grad()
    def load_checkpoint_weights(self, prefix: str, model: nn.Module, path: Path) -> None:
        """Only the weights of ``model`` (``prefix`` in the LightningModule) from one of our checkpoints: a sharded
        folder (DCP reads this rank's slices) or a full file (memory-mapped, weights only; each rank keeps its
        shards).

        Raises:
            ValueError: the checkpoint lacks one of the model's tensors or holds it in another shape (the first
                named: :func:`~lightning_4d.checkpoint.check_same_model`), or holds more than plain data.
        """
        from torch.distributed.tensor import distribute_tensor

        aliases = tied_aliases(model)  # a tied head's copy (pp > 1) is saved once, as the embedding
        params: dict[str, nn.Parameter] = {}
        copies: list[tuple[nn.Parameter, nn.Parameter]] = []
        for n, p in model.named_parameters():
            name = saved_key(canonical_name(n), aliases)
            key = f"{prefix}.{name}" if prefix else name
            if key in params:  # the head's copy beside its embedding (a V schedule's rank 0)
                copies.append((p, params[key]))
            else:
                params[key] = p
        if path.is_dir():
            check_same_model(path, saved_shapes(check_complete(path)), params)
            read_folder({"state_dict": {k: p.data for k, p in params.items()}}, path)
            for p, source in copies:
                _local_of(p).copy_(_local_of(source))
            return
        saved = safe_load(path)
        saved = saved.get("state_dict", saved)
        check_same_model(path, {k: tuple(v.shape) for k, v in saved.items() if isinstance(v, torch.Tensor)}, params)
        for key, p in params.items():
            full = saved[key]
            if isinstance(p, DTensor):
                local = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.data.to_local().copy_(local)
            else:
                p.data.copy_(full)
        for p, source in copies:
            _local_of(p).copy_(_local_of(source))


def _local_of(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a (DTensor) parameter's data, to copy into in place."""
    data = t.data
    return data.to_local() if isinstance(data, DTensor) else data


def _tp_only(p: DTensor) -> list:
    """``p``'s placements with every mesh dimension but ``tp`` replicated: a local tensor of whole heads."""
    from torch.distributed.tensor import Replicate

    names = p.device_mesh.mesh_dim_names or ()
    return [pl if (names[i] if i < len(names) else None) == "tp" else Replicate() for i, pl in enumerate(p.placements)]


#: the family instance the registry lists
LLAMA = LlamaFamily()
