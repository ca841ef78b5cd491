"""Measure, per rank, what one training step of FourDStrategy really holds, next to the memory model's figures.

For each layout (a dict with keys dp, tp, zero, sp, overlap (``tensor_parallel_overlap``), ac, precision, tied, pp,
schedule, m for pipelines, cp, method for context parallelism, ep for expert parallelism and config: model config
fields to override, e.g. the MoE ones) one
``Trainer.fit`` runs one optimizer step per batch shape (b, s) in ``--shapes`` (a pipeline: two steps of the first
shape, the second measured, with batches of b·m split by the schedule). Under a pipeline the pack hook also tracks
when autograd frees each saved value, giving the peak of saved bytes alive at once during the schedule (the
in-flight micro-batches) and the bytes saved over the step. Around each ``training_step`` (forward + loss) a
``torch.autograd.graph.saved_tensors_hooks`` pack hook records every storage saved for backward once (parameters
excluded: they are model states), and a forward pre-hook on each activation-checkpointed block records the inputs
the checkpoint keeps; under selective checkpointing the block's policy is wrapped so that the outputs it decides to
keep (``SelectiveCheckpointContext.op_output`` of each op it answers ``MUST_SAVE`` or ``PREFER_SAVE``: what
PyTorch caches for the recomputation) are recorded too. Before the first optimizer step the bytes of the local
parameter, gradient and Adam-moment shards are recorded. Under expert parallelism the rows each MoE layer sent and
received (``ExpertDispatch.sent_rows`` / ``received_rows``) are recorded per step, and the activations are estimated
at this rank's load of the routing that occurred (``expert_load_imbalance`` = received over sent rows, summed over
its MoE layers: the estimate's received-row terms are linear in it). Each rank writes
``<out>/layout<i>_rank<r>.json`` with the measured and estimated figures.

Usage: ``torchrun --nproc-per-node N tests/scripts/measure_memory.py --out DIR --layouts JSON --shapes JSON``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from datetime import timedelta
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.autograd.graph import saved_tensors_hooks  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

from lightning_4d import FourDStrategy, ParallelConfig  # noqa: E402
from lightning_4d.measure import local_bytes, model_state_tensors  # noqa: E402
from lightning_4d.models import LlamaConfig  # noqa: E402
from lightning_4d.planning.model import estimate_memory, model_state_bytes, saved_activation_bytes  # noqa: E402
from lightning_4d.planning.workload import Workload  # noqa: E402
from lightning_4d.tasks import CausalLMModule  # noqa: E402


def _storages(t: torch.Tensor) -> list:
    """The storages behind ``t``: a wrapper subclass (DTensor, functional collectives' AsyncCollectiveTensor) has
    none of its own; its inner tensors do."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        inner = [getattr(t, a) for a in attrs]
        return [st for x in inner if torch.is_tensor(x) for st in _storages(x)]
    return [t.untyped_storage()]


class Shapes(IterableDataset):
    """One batch per (b, s), the same on every rank (tokens from a fixed generator)."""

    def __init__(self, shapes: list[tuple[int, int]], vocab: int) -> None:
        self.shapes, self.vocab = shapes, vocab

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for b, s in self.shapes:
            ids = torch.randint(0, self.vocab, (b, s + 1), generator=g)
            yield {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


class _Held:
    """What the pack hook stores in the autograd graph: the tensor, and a release callback run when autograd frees
    the saved value (after the backward that used it)."""

    __slots__ = ("t", "release")

    def __init__(self, t, release) -> None:
        self.t, self.release = t, release

    def __del__(self) -> None:
        self.release()


class Measured(CausalLMModule):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.saved: list[int] = []
        self.peak_live: list[int] = []  # largest bytes of saved tensors alive at once during the step (pipelines)
        self.total_packed: list[int] = []  # bytes saved over the whole step (each micro-batch's storages once)
        self.states: dict[str, int] = {}
        self.routed_rows: list[tuple[list[int], list[int]]] = []  # per step: (sent, received) rows per MoE layer

    def training_step(self, batch, batch_idx):
        seen: dict[int, int] = {}

        def params() -> set[int]:
            return {st.data_ptr() for p in self.parameters() for st in _storages(p)}

        param_ptrs = params()
        live: dict[int, list[int]] = {}  # storage -> [saved values holding it, bytes]
        stats = {"current": 0, "peak": 0, "total": 0}

        def release(ptrs: list[int]) -> None:
            for ptr in ptrs:
                entry = live.get(ptr)
                if entry is None:
                    continue
                entry[0] -= 1
                if entry[0] == 0:
                    stats["current"] -= entry[1]
                    del live[ptr]

        def pack(t):
            ptrs = []
            # the parameters' storages now: FSDP2's unsharded parameters come and go, and the allocator reuses a
            # freed one's address for activations, so a remembered address would hide those
            current = param_ptrs | params()
            for st in _storages(t):
                ptr = st.data_ptr()
                if isinstance(t, torch.nn.Parameter) or ptr in current:
                    continue
                seen.setdefault(ptr, st.nbytes())
                ptrs.append(ptr)
                if ptr in live:
                    live[ptr][0] += 1
                else:
                    live[ptr] = [1, st.nbytes()]
                    stats["current"] += st.nbytes()
                    stats["total"] += st.nbytes()
                    stats["peak"] = max(stats["peak"], stats["current"])
            return _Held(t, lambda: release(ptrs))

        def keep_inputs(module, args):
            for a in args:
                if torch.is_tensor(a):
                    for st in _storages(a):
                        seen.setdefault(st.data_ptr(), st.nbytes())

        def keep_outputs(policy):
            def recording(ctx, func, *args, **kwargs):
                decision = policy(ctx, func, *args, **kwargs)
                if decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
                    outputs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else [ctx.op_output]
                    for t in outputs:
                        if torch.is_tensor(t):
                            for st in _storages(t):
                                seen.setdefault(st.data_ptr(), st.nbytes())
                return decision

            return recording

        # checkpoint_wrapper's modules (FSDP2 renames their class to FSDPCheckpointWrapper)
        wrappers = [m for m in self.modules() if isinstance(getattr(m, "checkpoint_fn", None), functools.partial)]
        hooks = [m.register_forward_pre_hook(keep_inputs) for m in wrappers]
        originals = {m: m.checkpoint_fn for m in wrappers}
        for m, fn in originals.items():
            context_fn = fn.keywords.get("context_fn")
            if isinstance(context_fn, functools.partial) and context_fn.func is create_selective_checkpoint_contexts:
                recording = functools.partial(create_selective_checkpoint_contexts, keep_outputs(context_fn.args[0]))
                m.checkpoint_fn = functools.partial(fn.func, *fn.args, **{**fn.keywords, "context_fn": recording})
        try:
            with saved_tensors_hooks(pack, lambda held: held.t):
                loss = super().training_step(batch, batch_idx)
        finally:
            for h in hooks:
                h.remove()
            for m, fn in originals.items():
                m.checkpoint_fn = fn
        self.saved.append(sum(seen.values()))
        from lightning_4d.features.moe.expert import ExpertDispatch

        dispatches = [
            d for d in (getattr(m, "dispatch", None) for m in self.modules()) if isinstance(d, ExpertDispatch)
        ]
        self.routed_rows.append(([d.sent_rows for d in dispatches], [d.received_rows for d in dispatches]))
        self.peak_live.append(stats["peak"])
        self.total_packed.append(stats["total"])
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.states:
            return
        tensors = model_state_tensors(self, [], getattr(self.trainer.strategy, "gradient_buckets", None))
        self.states["parameters"] = local_bytes(tensors["parameters"])
        self.states["gradients"] = local_bytes(tensors["gradients"])

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if "optimizer_states" not in self.states:
            tensors = model_state_tensors(
                self, self.trainer.optimizers, getattr(self.trainer.strategy, "gradient_buckets", None)
            )
            self.states["optimizer_states"] = local_bytes(tensors["optimizer_states"])
            self.states["master_weights"] = local_bytes(tensors["master_weights"])
            self.states["compression"] = local_bytes(tensors["compression"])


def run(layout: dict, shapes: list[tuple[int, int]], model: str, layers: int | None = None) -> dict:
    L.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    overrides = {"num_layers": layers} if layers else {}
    overrides.update(layout.get("config", {}))  # model config fields, e.g. the MoE ones
    cfg = LlamaConfig.from_preset(model, tie_word_embeddings=layout.get("tied", False), **overrides)
    module = Measured(cfg, learning_rate=1e-3, warmup_steps=1, max_steps=len(shapes), init_seed=7)
    kw = dict(
        data_parallel_size=layout.get("dp", 1),
        tensor_parallel_size=layout.get("tp", 1),
        zero_stage=layout.get("zero", 0),
        sequence_parallel=layout.get("sp"),
        tensor_parallel_overlap=layout.get("overlap", False),
        activation_checkpointing=layout.get("ac", "none"),
        activation_offload_layers=layout.get("offload", 0),
        pipeline_parallel_size=layout.get("pp", 1),
        pipeline_schedule=layout.get("schedule", "1f1b"),
        num_microbatches=layout.get("m"),
        context_parallel_size=layout.get("cp", 1),
        context_parallel_method=layout.get("method", "ring"),
        expert_parallel_size=layout.get("ep", 1),
    )
    pp, m = layout.get("pp", 1), layout.get("m", 1)
    if pp > 1:
        # a pipeline keeps one batch shape (its stages' buffers are sized once); the first step also runs the
        # schedule's shape inference, so each shape is measured on a second step
        shapes = [shape for shape in shapes[:1] for _ in range(2)]
    strategy = FourDStrategy(**kw, process_group_backend="gloo", timeout=timedelta(seconds=120))
    precision = layout.get("precision", "32-true")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=len(shapes),
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    batches = [(b * m, s) for b, s in shapes] if pp > 1 else shapes  # the schedule splits a batch into m
    trainer.fit(module, DataLoader(Shapes(batches, cfg.vocab_size), batch_size=None))
    pc = ParallelConfig(**kw).resolve(world)
    rank = trainer.global_rank
    dp_cp_rank = (rank // pc.tp) % pc.dp_cp
    pp_rank = rank // (pc.tp * pc.dp_cp)
    estimated_states = model_state_bytes(
        cfg, pc, precision, dp_cp_rank=dp_cp_rank, pp_rank=pp_rank, tp_rank=rank % pc.tp
    )
    rows = []
    for i, ((b, s), measured) in enumerate(zip(shapes, module.saved)):
        if pp > 1 and i % 2 == 0:
            continue  # the step that also ran the schedule's shape inference
        sent, received = module.routed_rows[i]
        load = sum(received) / sum(sent) if sent else None  # this rank's, the routing that occurred (ep > 1)
        est = saved_activation_bytes(Workload(cfg, b, s, precision, expert_load_imbalance=load), pc, pp_rank=pp_rank)
        row = {"b": b, "s": s, "measured": measured, "estimated": sum(est.values()) - est["recompute"], "parts": est}
        if sent:
            balanced = saved_activation_bytes(
                Workload(cfg, b, s, precision, expert_load_imbalance=1.0), pc, pp_rank=pp_rank
            )
            row.update(
                sent_rows=sent,
                received_rows=received,
                expert_load=load,
                estimated_balanced=sum(balanced.values()) - balanced["recompute"],
            )
        # activation offload (any pp): the offloaded layers' saves go through their own (inner) hooks, not the pack
        # hook above: what it sees is what stays on the device (a stage offloaded whole: the RoPE tables neither)
        stages = pc.rank_stages(cfg.num_layers, pp_rank)
        per_layer = est["layers"] // sum(len(r) for _, r in stages)
        row["estimated"] -= sum(
            min(pc.activation_offload_layers, len(r)) * per_layer
            + (est["rope"] if pc.activation_offload_layers >= len(r) else 0)
            for _, r in stages
        )
        if pp > 1:
            full = estimate_memory(Workload(cfg, b, s, precision), pc, pp_rank=pp_rank, device_type="cpu")
            row.update(
                measured_total=module.total_packed[i],
                estimated_total=m * row["estimated"],
                measured_peak=module.peak_live[i],
                estimated_peak=full.activations
                - est["recompute"]
                - full.details["offload_unpacked"]
                + full.details["compute_weights"],
                in_flight=full.details["in_flight_microbatches_x1000"] / 1000,
            )
        rows.append(row)
    return {
        "layout": layout,
        "rank": rank,
        "activations": rows,
        "states": module.states,
        # these layouts keep every state on the device (no optimizer_offload): the host field is 0 and not measured
        "estimated_states": {k: v for k, v in estimated_states.__dict__.items() if k != "host" or v},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layouts", required=True)
    parser.add_argument("--shapes", default="[[1, 64], [2, 64], [1, 256], [2, 256]]")
    parser.add_argument("--model", default="tiny-test")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's num_layers")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = [tuple(x) for x in json.loads(args.shapes)]
    for i, layout in enumerate(json.loads(args.layouts)):
        record = run(layout, shapes, args.model, args.layers)
        (out / f"layout{i}_rank{record['rank']}.json").write_text(json.dumps(record))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    exit_distributed_process(main() or 0)
