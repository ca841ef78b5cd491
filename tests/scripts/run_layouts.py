"""Train the tiny Llama under several layouts in one (torchrun-launched or single) process group and record, per
layout and per rank: the logged per-step ``train_loss``, the bytes of the local parameter / gradient / optimizer-state
shards, and (rank 0) the final full weights.

Usage (from the tests): ``torchrun --nproc-per-node N tests/scripts/run_layouts.py --out DIR --layouts JSON``,
or ``python tests/scripts/run_layouts.py --out DIR --layouts '[{"reference": true}]'`` for the single-process
reference (plain Lightning, no FourDStrategy). Each layout is a dict with keys dp, tp, zero, sp, overlap
(``tensor_parallel_overlap``), precision, ac, offload (``activation_offload_layers``), clip,
compile, tied, accum, bucket, sdc, compress (gradient compression), rank, start and pcomm (PowerSGD's rank, start
step and comm dtype), comm (record CommMeter events), for pipeline parallelism pp, schedule, v (stages per rank),
m (micro-batches per step), split (layers per
stage) and pcd (pipeline comm dtype), for context parallelism cp and method ("ring" / "allgather"), for expert
parallelism ep, for hybrid sharding replicate (``data_parallel_replicate_size``), optoffload (``optimizer_offload``:
also records where the optimizer's states live), float8 (the recipe), norm
(record the global gradient norm before clipping at every step), and
config (a dict of model config fields to override, e.g. the MoE ones).
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from lightning_4d import FourDStrategy  # noqa: E402
from lightning_4d.data import LMDataModule  # noqa: E402
from lightning_4d.measure import local_bytes, model_state_tensors  # noqa: E402
from lightning_4d.models.llama import canonical_name  # noqa: E402
from lightning_4d.parallel._compat.compile import compiled_graph_count  # noqa: E402
from lightning_4d.parallel._compat.dtensor import local_tensor  # noqa: E402
from lightning_4d.tasks import CausalLMModule  # noqa: E402


def _tp_local_numel(p: torch.Tensor) -> int:
    """Elements of this parameter on one tp rank with no ZeRO sharding (the stage-0 size)."""
    if not isinstance(p, DTensor):
        return p.numel()
    names = p.device_mesh.mesh_dim_names or ()
    n = p.numel()
    for name, placement in zip(names, p.placements):
        if name == "tp" and placement.is_shard():
            n //= p.device_mesh.size(names.index("tp"))
    return n


class Recorder(L.Callback):
    def __init__(self, record_norm: bool = False) -> None:
        self.record_norm = record_norm
        self.losses: list[float] = []
        self.bytes: dict[str, int] = {}
        #: per batch: [optimizer step, data-parallel rank, the first 8 tokens of each of its sequences]
        self.samples: list = []
        self.loss_steps: list[int] = []
        self._step = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.record_norm and not hasattr(trainer.strategy, "parallel_config"):  # plain Lightning: torch's norm
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.bytes.setdefault("grad_norms", []).append(float(torch.nn.utils.get_total_norm(grads)))
        elif self.record_norm:  # the global gradient norm before clipping (max_norm inf: coefficient 1, no change)
            from lightning_4d.parallel.clipping import clip_grad_norm_
            from lightning_4d.parallel.sharded_optimizer import ShardedOptimizer, unwrap_optimizer

            # a ShardedOptimizer's buckets, else every mesh (expert gradients on (edp, ep), dense ones on dp_cp under
            # ZeRO 2/3 with ep); pp: the norm over every stage
            sharded = ShardedOptimizer.of(unwrap_optimizer(optimizer))
            pipeline = getattr(trainer.strategy, "pipeline", None)
            pp_group = trainer.strategy.mesh.pp.get_group() if pipeline is not None else None
            norm = clip_grad_norm_(list(pl_module.parameters()), float("inf"), pp_group=pp_group, sharded=sharded)
            self.bytes.setdefault("grad_norms", []).append(float(norm))
        if "params" in self.bytes:
            return
        params = list(pl_module.parameters())
        sync = getattr(trainer.strategy, "gradient_buckets", None)
        self.bytes["params"] = local_bytes(params)
        self.bytes["grads"] = local_bytes(model_state_tensors(pl_module, [], sync)["gradients"])
        self.bytes["tp_local_params"] = sum(_tp_local_numel(p) * p.element_size() for p in params)
        self.bytes["num_params"] = len(params)
        self.bytes["gradient_buckets"] = len(sync.buckets) if sync is not None else 0
        # float8: torchao's Float8Linear modules, and those whose weight FSDP2 all-gathers in float8
        float8 = [m for m in pl_module.modules() if type(m).__name__ == "Float8Linear"]
        self.bytes["float8_linears"] = len(float8)
        self.bytes["float8_gathered"] = sum(
            type(local_tensor(m.weight)).__name__ == "WeightWithDynamicFloat8CastTensor" for m in float8
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step
        dp_rank = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        self.samples.append([self._step, dp_rank.get("rank", 0), batch["input_ids"][:, :8].tolist()])
        # gradients alive when a batch's forward starts (a step's first micro-batch: none under FourDStrategy)
        alive = sum(p.grad is not None for p in pl_module.parameters())
        self.bytes.setdefault("grads_at_batch_start", []).append(alive)

    def on_after_backward(self, trainer, pl_module) -> None:
        # ZeRO 0/1 move every gradient into its bucket from a backward hook: none should be left in .grad here
        if "grads_left_after_backward" not in self.bytes:
            self.bytes["grads_left_after_backward"] = sum(p.grad is not None for p in pl_module.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        self.loss_steps.append(self._step)  # the optimizer step this batch belongs to
        if "train_aux_loss" in trainer.callback_metrics:  # MoE: the load-balancing loss and routing statistics
            self.bytes.setdefault("aux_losses", []).append(float(trainer.callback_metrics["train_aux_loss"]))
            self.bytes.setdefault("tokens_per_expert_max", []).append(
                float(trainer.callback_metrics["moe_tokens_per_expert_max"])
            )
        if "optimizer_states" not in self.bytes and trainer.optimizers[0].state:  # after the first optimizer step
            sync = getattr(trainer.strategy, "gradient_buckets", None)  # its PowerSGD state counts as optimizer state
            states = model_state_tensors(pl_module, trainer.optimizers, sync)["optimizer_states"]
            self.bytes["optimizer_states"] = local_bytes(states)
            if getattr(getattr(trainer.strategy, "parallel_config", None), "optimizer_offload", False):
                self.bytes["offload"] = _offload_record(pl_module, trainer)


def _offload_record(pl_module, trainer) -> dict:
    """Where an offloaded optimizer's tensors live: the storages of its states and of the tensors it steps (ZeRO 1:
    the ShardedOptimizer's host copies and host gradients) against those of the parameters the layers compute with
    and of the gradient buckets (no storage shared), the states' devices, and their host bytes."""
    from lightning_4d.parallel.sharded_optimizer import ShardedOptimizer, unwrap_optimizer

    def ptrs(tensors) -> set:
        return {local_tensor(t).untyped_storage().data_ptr() for t in tensors if t is not None and t.numel()}

    optimizer = unwrap_optimizer(trainer.optimizers[0])
    sharded = ShardedOptimizer.of(optimizer)
    states = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.ndim > 0]
    stepped = sharded.host_tensors() if sharded is not None else []
    sync = getattr(trainer.strategy, "gradient_buckets", None)
    buckets = [b.buffer for b in sync.buckets] if sync is not None else []
    device = ptrs(list(pl_module.parameters()) + buckets)
    return {
        "shared_storages": len(ptrs(states + stepped) & device),
        "state_devices": sorted({str(local_tensor(t).device) for t in states + stepped}),
        "num_states": len(states),
        "num_stepped": len(stepped),
        "host_bytes": local_bytes(states + stepped),
        "sharded_optimizer": sharded is not None,
    }


class _StarveUpperExperts(L.Callback):
    """Adds -1e4 to the router logits of experts ``E/2 .. E-1`` of every MoE layer: no token picks them, so under
    ep2 the experts of ep rank 1 receive no row at all (tests/test_expert_parallel.py)."""

    def on_fit_start(self, trainer, pl_module) -> None:
        for layer in pl_module.model.moe_layers():
            mask = torch.zeros(layer.config.num_experts)
            mask[layer.config.num_experts // 2 :] = -1e4
            layer.router.register_forward_hook(lambda m, i, o, mask=mask: o + mask.to(o.dtype))


def run_one(
    layout: dict,
    args: argparse.Namespace,
    out: Path,
    index: int,
    max_steps: int | None = None,
    ckpt_dir: Path | None = None,
    ckpt_path: str | None = None,
    weights_as: str | None = None,
) -> Recorder:
    L.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    reference = layout.get("reference", False)
    dp = layout.get("dp", 1)
    accum = layout.get("accum", 1)
    pp = layout.get("pp", 1)
    m = layout.get("m", 1) if pp > 1 else 1  # pipeline micro-batches per step (derived from the global batch)
    micro = args.global_batch // (dp * accum * m)
    import lightning_4d.parallel.grad_buffers as grad_buffers

    grad_buffers._BUCKET_BYTES = layout.get("bucket", 25 * 2**20)  # small buckets: several all-reduces overlap backward
    dm = LMDataModule(
        seq_length=args.seq_length,
        micro_batch_size=micro,
        global_batch_size=args.global_batch,
        train_samples=args.global_batch * args.steps,
        val_samples=micro * dp,
        seed=1234,
    )
    from lightning_4d.models import LlamaConfig

    overrides = {"num_layers": args.layers} if args.layers else {}
    overrides.update(layout.get("config", {}))  # model config fields, e.g. MoE: {"num_shared_experts": 1}
    model_config = LlamaConfig.from_preset(args.model, tie_word_embeddings=layout.get("tied", False), **overrides)
    module = CausalLMModule(model_config, learning_rate=args.lr, warmup_steps=2, max_steps=args.steps, init_seed=7)
    if reference:
        strategy = "auto"
    else:
        strategy = FourDStrategy(
            data_parallel_size=dp,
            tensor_parallel_size=layout.get("tp", 1),
            zero_stage=layout.get("zero", 0),
            data_parallel_replicate_size=layout.get("replicate", 1),
            optimizer_offload=layout.get("optoffload", False),
            pipeline_parallel_size=pp,
            pipeline_schedule=layout.get("schedule", "1f1b"),
            context_parallel_size=layout.get("cp", 1),
            context_parallel_method=layout.get("method", "ring"),
            virtual_pipeline_stages=layout.get("v"),
            pipeline_layer_split=layout.get("split"),
            sequence_parallel=layout.get("sp"),
            tensor_parallel_overlap=layout.get("overlap", False),
            activation_checkpointing=layout.get("ac", "none"),
            activation_offload_layers=layout.get("offload", 0),
            compile=layout.get("compile", False),
            save_distributed_checkpoint=layout.get("sdc", True),
            gradient_compression=layout.get("compress", "none"),
            powersgd_rank=layout.get("rank", 4),
            powersgd_start_step=layout.get("start", 0),
            powersgd_comm_dtype=layout.get("pcomm"),
            pipeline_comm_dtype=layout.get("pcd"),
            expert_parallel_size=layout.get("ep", 1),
            float8=layout.get("float8"),
            process_group_backend="gloo",
            timeout=timedelta(seconds=120),
        )
    recorder = Recorder(record_norm=layout.get("norm", False))
    callbacks: list = [recorder]
    if layout.get("comm"):  # bytes on the wire per step (lightning_4d.parallel.comm)
        from lightning_4d.parallel.comm import CommMeterCallback

        class _Meter(CommMeterCallback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                meter = self.meter
                super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
                recorder.bytes.setdefault("comm_events", []).append(meter.events)
                sync = getattr(trainer.strategy, "gradient_buckets", None)
                if sync is not None and "bucket_bytes" not in recorder.bytes:
                    recorder.bytes["bucket_bytes"] = [b.padded * b.dtype.itemsize for b in sync.buckets]

        callbacks.append(_Meter(per_kind=True))
    if layout.get("starve"):  # no token routed to the upper half of the experts (ep rank 1's at ep2)
        callbacks.append(_StarveUpperExperts())
    if ckpt_dir is not None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=max_steps))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1 if reference else world,
        strategy=strategy,
        max_steps=max_steps or args.steps,
        precision=layout.get("precision", "32-true"),
        logger=False,
        enable_checkpointing=ckpt_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        gradient_clip_val=layout.get("clip"),
        accumulate_grad_batches=accum,
    )
    if layout.get("compile"):
        torch.compiler.reset()  # this fit's graphs compile anew (a cached graph of an earlier layout would count 0)
    graphs = compiled_graph_count()
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    # graphs Dynamo compiled during this fit (0 without compile, and 0 if compile fell back to eager)
    recorder.bytes["compiled_graphs"] = compiled_graph_count() - graphs
    weights = {}
    if (ckpt_dir is None and ckpt_path is None) or weights_as is not None:
        for name, p in module.model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            weights[canonical_name(name)] = full.detach().float().cpu().clone()
    rank = trainer.global_rank
    if weights_as is not None:  # final weights of a checkpoint run: rank 0's, and under pp every rank's own stages
        if rank == 0:
            torch.save(weights, out / f"{weights_as}_weights.pt")
        if pp > 1:
            torch.save(weights, out / f"{weights_as}_weights_rank{rank}.pt")
    if ckpt_dir is not None or ckpt_path is not None:
        return recorder
    if layout.get("offload"):  # activation offload: the most host bytes held at once (0 would mean it never ran)
        recorder.bytes["host_offloaded"] = trainer.strategy.offload_stats.peak
    record = {
        "layout": layout,
        "losses": recorder.losses,
        "bytes": recorder.bytes,
        "rank": rank,
        "param_shapes": {
            canonical_name(n): [list(p.shape), p.element_size()] for n, p in module.model.named_parameters()
        },
    }
    (out / f"layout{index}_rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        torch.save(weights, out / f"layout{index}_weights.pt")
    if pp > 1:  # each pipeline stage holds its own layers: every rank saves what it has, the test merges
        torch.save(weights, out / f"layout{index}_weights_rank{rank}.pt")
    return recorder


def resume_check(layout: dict, args: argparse.Namespace, out: Path, index: int) -> None:
    """Train ``args.steps`` straight, then half the steps + save + resume to the end: record both loss curves."""
    straight = run_one(layout, args, out, index)
    half = args.steps // 2
    ckpt_dir = out / f"ckpt{index}"
    first = run_one(layout, args, out, index, max_steps=half, ckpt_dir=ckpt_dir)
    second = run_one(layout, args, out, index, ckpt_path=str(ckpt_dir / "last.ckpt"))
    record = {
        "layout": layout,
        "straight": straight.losses,
        "first": first.losses,
        "resumed": second.losses,
        "files": sorted(p.name for p in (ckpt_dir / "last.ckpt").iterdir())
        if (ckpt_dir / "last.ckpt").is_dir()
        else ["<file>"],
    }
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    (out / f"resume{index}_rank{rank}.json").write_text(json.dumps(record))


def reshard(layouts: list, args: argparse.Namespace, out: Path) -> None:
    """``--reshard first``: for each layout (a dict with a ``"name"``), train ``args.steps`` straight, then the first
    half with a checkpoint (``out/<name>/last.ckpt``); ``--reshard resume``: resume each layout from the checkpoint
    of the same ``name`` (saved on another layout) to ``args.steps``. One JSON record per layout and rank, and the
    final weights of the straight and the resumed runs (``<name>_straight_weights.pt``, ``<name>_resumed_weights.pt``;
    under pp one ``..._weights_rank<r>.pt`` per rank).
    ``--no-straight``: the first half only (the caller compares with a reference run of its own). A resumed layout
    with a ``"from"`` key resumes from that name's checkpoint instead (its batches' samples are recorded too)."""
    rank = int(os.environ.get("RANK", "0"))
    for i, layout in enumerate(layouts):
        name = layout["name"]
        if args.reshard == "first":
            # the straight run's final weights as <name>_straight_weights.pt (run_one's own file is per launch index)
            straight = None if args.no_straight else run_one(layout, args, out, i, weights_as=f"{name}_straight")
            first = run_one(layout, args, out, i, max_steps=args.steps // 2, ckpt_dir=out / name)
            record = {"straight": straight.losses if straight else None, "first": first.losses}
            if straight is not None:
                record["straight_samples"] = straight.samples
                record["straight_loss_steps"] = straight.loss_steps
        else:
            source = layout.get("from", name)
            second = run_one(
                layout, args, out, i, ckpt_path=str(out / source / "last.ckpt"), weights_as=f"{name}_resumed"
            )
            record = {"resumed": second.losses, "samples": second.samples, "loss_steps": second.loss_steps}
        (out / f"{name}_{args.reshard}_rank{rank}.json").write_text(json.dumps({"layout": layout, **record}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layouts", required=True, help="JSON list of layout dicts")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--model", default="tiny-test")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's num_layers")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--resume-check", action="store_true")
    parser.add_argument("--reshard", choices=["first", "resume"], help="see reshard()")
    parser.add_argument(
        "--no-straight", action="store_true", help="--reshard first: skip the straight run (compared elsewhere)"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.reshard:
        reshard(json.loads(args.layouts), args, out)
    for i, layout in enumerate(json.loads(args.layouts) if not args.reshard else []):
        (resume_check if args.resume_check else run_one)(layout, args, out, i)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # no rank tears gloo down while another still uses it
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    exit_distributed_process(main() or 0)
