"""The model-family interface: what :class:`~lightning_4d.strategy.FourDStrategy` must know about one kind of model to
lay it out in 4D, answered once per family (torchtitan's ``TrainSpec``, ``torchtitan/protocols/train_spec.py``).

A family *describes* its model; the machinery that acts on the description is written once for every family:

========================================  ==========================================================================
the family answers                        used by
========================================  ==========================================================================
:meth:`~ModelFamily.is_model`              the registry (:mod:`lightning_4d.families.registry`): find the models in a
                                           LightningModule (the only ``isinstance`` on a family, in its own file)
:meth:`~ModelFamily.model_config`          layout validation and the memory estimate (a ``LlamaConfig``)
:meth:`~ModelFamily.validate`              ``FourDStrategy.setup_environment``, before any process group
:meth:`~ModelFamily.pipeline_layout`       the ONE splitter and
                                           :class:`~lightning_4d.features.pipeline.runtime.StageChunk`
:meth:`~ModelFamily.rotary`,               the stage chunk's forward (the positions of the stage's tokens under
:meth:`~ModelFamily.run_layer`,            sp and cp are asked of the family too: ``torch.distributed.pipelining``
:meth:`~ModelFamily.run_head`,             passes activations only)
:meth:`~ModelFamily.positions`
:meth:`~ModelFamily.tensor_parallel_plan`  the ONE tp/sp applier
                                           (:func:`~lightning_4d.features.tensor_parallel.runtime.apply_tensor_parallel`)
:meth:`~ModelFamily.apply_context_parallel`  cp attention and the positions the model computes for its zigzag shard
:meth:`~ModelFamily.apply_data_parallel`   statistics over the global batch (MoE routing counts, over ``dp_cp``
                                           and, under tp, ``dp_cp x tp``)
:meth:`~ModelFamily.materialize`           ``FourDStrategy.setup``: the meta-device model made real (and initialized)
:meth:`~ModelFamily.load_hf`,              ``init_from`` (a Hugging Face directory, each rank reading its slices) and
:meth:`~ModelFamily.load_checkpoint_weights`  one of our checkpoints (weights only)
========================================  ==========================================================================

Adding a family is one file that subclasses :class:`ModelFamily` and one line in
:data:`lightning_4d.families.registry.FAMILIES` (``docs/architecture.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch import Tensor

from lightning_4d.module_tree import find_submodel, layer_items, set_submodel

__all__ = ["ModelFamily", "PipelineLayout", "find_submodel", "layer_items", "set_submodel"]

if TYPE_CHECKING:  # pragma: no cover
    from lightning_4d.config import ParallelConfig
    from lightning_4d.features.tensor_parallel.runtime import TensorParallelPlan
    from lightning_4d.models.llama_config import LlamaConfig


@dataclass(frozen=True)
class PipelineLayout:
    """Where a decoder-only model keeps the parts a pipeline split cuts, as dotted attribute paths on the model:
    ``embedding`` (token embedding; first stage), ``layers`` (an ``nn.ModuleDict`` keyed ``"0" .. "L-1"`` or an
    ``nn.ModuleList`` of the decoder layers, in order), ``norm`` (final norm) and ``head`` (LM head; both last
    stage)."""

    embedding: str
    layers: str
    norm: str
    head: str


class ModelFamily:
    """One kind of model the strategy can split (module docstring). Subclasses override every method; the defaults
    raise ``NotImplementedError`` naming the family and the method.

    Attributes:
        name: a short name for messages (``"lightning_4d Llama"``).
        master_weights: the strategy keeps float32 master weights for this family and casts the model to the compute
            dtype under ``bf16-mixed`` (our Llama); ``False``: precision is left to Lightning's precision plugin.
        activation_checkpointing: the family's decoder layers may be wrapped by activation checkpointing
            (:mod:`lightning_4d.parallel.activation_checkpoint`).
        compile: the family's decoder layers may be compiled one by one (``compile=True``,
            :mod:`lightning_4d.parallel.compile`).
        float8: the family's decoder layers' linears may be converted to torchao's float8 linears (``float8=...``,
            :mod:`lightning_4d.parallel.float8`; tested for our Llama only).
    """

    name: str = "model"
    master_weights: bool = False
    activation_checkpointing: bool = False
    compile: bool = False
    float8: bool = False

    def _missing(self, method: str) -> NotImplementedError:
        return NotImplementedError(f"the model family {self.name!r} does not implement {method}()")

    # ------------------------------------------------------------------ what the model is
    def is_model(self, module: nn.Module) -> bool:
        """Whether ``module`` is a model of this family (its root: a ``LlamaModel``, a ``LlamaForCausalLM``)."""
        raise self._missing("is_model")

    def model_config(self, model: nn.Module) -> "LlamaConfig":
        """The :class:`~lightning_4d.models.LlamaConfig` of ``model``'s shape (layout validation, memory estimate).

        Raises:
            ValueError: a variant the memory model does not model (names the field).
        """
        raise self._missing("model_config")

    def validate(self, model: nn.Module, config: "ParallelConfig") -> None:
        """Check the layout ``config`` against ``model`` before any process group exists.

        Raises:
            ValueError: naming the value and what would be valid.
        """
        config.validate_model(self.model_config(model))

    # ------------------------------------------------------------------ pipeline
    def pipeline_layout(self, model: nn.Module) -> PipelineLayout:
        """Where ``model`` keeps its embedding, decoder layers, final norm and head."""
        raise self._missing("pipeline_layout")

    def positions(self, model: nn.Module, seq_len: int, cp: tuple[int, int], device: torch.device) -> Tensor:
        """The global positions ``[seq_len / cp_size]`` of the tokens a pipeline stage holds of a sequence of
        ``seq_len`` tokens on cp rank ``cp = (cp_rank, cp_size)`` (its zigzag shard; ``arange(seq_len)`` when cp = 1),
        as :meth:`rotary` and :meth:`run_layer` take them. The family says how its model numbers positions, so the
        generic splitter imports no model's rotary embedding."""
        raise self._missing("positions")

    def rotary(self, model: nn.Module, h: Tensor, positions: Tensor) -> Any:
        """The rotary embedding of ``positions`` (``[s]``, global token positions) for hidden states ``h``
        ``[b, s_local, h]``, in whatever form :meth:`run_layer` takes."""
        raise self._missing("rotary")

    def run_layer(
        self, model: nn.Module, layer: nn.Module, h: Tensor, rotary: Any, positions: Tensor, documents: Any = None
    ) -> Tensor:
        """One decoder layer: ``h`` ``[b, s_local, hidden]`` -> ``[b, s_local, hidden]`` (causal over the whole
        sequence; within each document with ``documents``, what :meth:`document_inputs` returned)."""
        raise self._missing("run_layer")

    def document_inputs(self, model: nn.Module, h: Tensor, document_ids: Tensor) -> Any:
        """What :meth:`run_layer` takes for document masking (once per micro-batch and stage) from the document
        ids ``[b, s]`` of the whole sequence.

        Raises:
            ValueError: the family has no document masking.
        """
        raise ValueError(f"document masking is not supported for a {self.name} yet: train without document_masking.")

    def run_head(self, model: nn.Module, head: nn.Module, h: Tensor) -> Any:
        """The LM head on the final-norm output ``h``: logits ``[b, s, V]`` (a DTensor under tp if the family's
        loss wants the vocabulary-sharded logits)."""
        return head(h)

    # ------------------------------------------------------------------ tp, cp
    def tensor_parallel_plan(self, model: nn.Module) -> "TensorParallelPlan":
        """Which modules of ``model`` are column-/row-parallel, where the embedding, norms and head are."""
        raise self._missing("tensor_parallel_plan")

    def prepare(self, model: nn.Module, config: "ParallelConfig", mesh: Any) -> None:
        """Anything the family needs before the plans are applied when tp, cp or pp > 1 (default: nothing)."""

    def apply_data_parallel(self, model: nn.Module, tokens_mesh: Any) -> None:
        """Give ``model`` what it computes over the whole data-parallel batch: the mesh of the ranks holding
        disjoint tokens, ``dp_cp`` (``dp_cp_tp`` under tp, where our MoE layers run token parallel; they sum their
        routing counts over it, :mod:`lightning_4d.features.moe.layer`). Called when dp·cp·tp > 1; default:
        nothing. A family whose MoE layers take ep also subclasses the MoE feature's
        :class:`~lightning_4d.features.moe.runtime.ExpertParallelFamily`."""

    def apply_context_parallel(self, model: nn.Module, cp_mesh: Any, method: str) -> None:
        """Make ``model``'s attention exchange K/V over ``cp_mesh`` (``method``: ``"ring"``, ``"allgather"`` or
        ``"alltoall"``) and its rotary positions those of the rank's zigzag shard. Called only when cp > 1."""
        raise self._missing("apply_context_parallel")

    # ------------------------------------------------------------------ weights
    def materialize(self, model: nn.Module, device: torch.device) -> None:
        """Move a (parallelized) meta-device ``model`` to ``device`` and give it initial weights; nothing when it
        holds no meta tensor."""
        raise self._missing("materialize")

    def load_hf(self, model: nn.Module, path: Path) -> None:
        """Read this rank's slices of ``model``'s weights from the Hugging Face directory ``path``.

        Raises:
            ValueError: a tensor missing or unreadable (named).
        """
        raise self._missing("load_hf")

    def load_checkpoint_weights(self, prefix: str, model: nn.Module, path: Path) -> None:
        """Read this rank's slices of ``model``'s weights (``prefix`` in the LightningModule) from one of our
        checkpoints at ``path`` (a sharded folder or a full file).

        Raises:
            ValueError: a weight missing (named).
        """
        raise self._missing("load_checkpoint_weights")
