"""How close can rank-r gradient compression get on the main job? PowerSGD next to the best rank-r compressor.

    python benchmarks/powersgd_bound.py [--steps 450] [--ranks 4 6 16] [--svd-ranks 4 6] [--start-step 45]

Trains the main job's model, data, optimizer, schedule and clipping (read from configs/tiny.yaml) in one process,
with the global batch of its dp=2 (two micro-batches of ``micro_batch_size`` averaged per step), once per setting,
one after another, and prints the final validation loss (the whole held-out set) next to the uncompressed run:

- ``none``: the gradients as they are;
- ``powersgd`` rank r: every compressible matrix gradient through :class:`lightning_4d.parallel.compression.PowerSGD`
  (over a one-rank process group: error feedback, warm start, one power iteration; the approximation is of this
  rank's gradient, as it would be of the ranks' mean);
- ``exact rank-r SVD``: the same matrices replaced by the best rank-r approximation of gradient + carried error
  (Eckart-Young: truncated SVD), error feedback as PowerSGD's. No rank-r compressor with error feedback passes on more
  of a step's gradient: its loss is what a perfect power iteration would reach.

With each compressed run's mean residual ``sqrt(Σ‖M − approximation‖² / Σ‖M‖²)`` (M = the step's gradient + the
error carried into it: the part of M the step did not pass on) and mean ``‖E‖/‖G‖`` (error carried into a step over
the step's gradient), and for the uncompressed run the share of the step's gradient energy in each matrix's top 4, 6 and
16 singular values at steps 45, 150 and 300 (how low-rank one step's gradient is).

The first ``--start-step`` steps are uncompressed (``powersgd_start_step``). Matrices are whole (tp=1), so a rank-r
approximation keeps a smaller share of them than of the main job's tp=2 shards (half as wide) and saves more bytes:
compare the settings with each other here, and the main job's bytes with ``benchmarks/compression.py``. Not a timed
test; one run per setting, deterministic on CPU.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_4d.data import LMDataModule  # noqa: E402
from lightning_4d.parallel.compression import PowerSGD  # noqa: E402
from lightning_4d.partition import powersgd_compressible  # noqa: E402
from lightning_4d.tasks import CausalLMModule  # noqa: E402
from lightning_4d.tasks.causal_lm import causal_lm_loss  # noqa: E402


class ExactLowRank:
    """Error feedback with the truncated SVD of gradient + error (the best rank-r approximation in Frobenius norm)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.errors: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def reduce(self, matrices: list[tuple[str, torch.Tensor]], vectors: list[torch.Tensor]) -> None:
        for key, g in matrices:
            m = g + self.errors.get(key, 0)
            u, s, vh = torch.linalg.svd(m, full_matrices=False)
            approx = (u[:, : self.rank] * s[: self.rank]) @ vh[: self.rank]
            self.errors[key] = m - approx
            g.copy_(approx)


#: steps of the uncompressed run at which the gradient's singular values are printed
SPECTRUM_STEPS = (45, 150, 300)
SPECTRUM_RANKS = (4, 6, 16)


def top_energy(grads: list[torch.Tensor], rank: int) -> float:
    """The fraction of ``Σ‖G‖²`` (Frobenius, over ``grads``) in each matrix's top ``rank`` singular values."""
    svs = [torch.linalg.svdvals(g.double()).square() for g in grads]
    return float(sum(s[:rank].sum() for s in svs) / sum(s.sum() for s in svs))


def train(config: dict, steps: int, start_step: int, compressor=None) -> dict:
    """One run: the final validation loss, the mean residual and mean ``‖E‖/‖G‖`` (the error carried into a step
    relative to the step's gradient, compressible matrices) over the compressed steps, and for the uncompressed run the
    top-r energy of the step's gradient at :data:`SPECTRUM_STEPS`."""
    torch.manual_seed(config["seed_everything"])
    data = LMDataModule(**config["data"])
    data.setup("fit")
    module = CausalLMModule(**config["model"], max_steps=steps)
    module.configure_model()
    opt = module.configure_optimizers()
    optimizer, scheduler = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
    micro_batches = config["trainer"]["strategy"]["init_args"]["data_parallel_size"]
    clip = config["trainer"]["gradient_clip_val"]
    batches = iter(data.train_dataloader())
    residuals, carried, spectrum = [], [], {}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(micro_batches):
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(data.train_dataloader())
                batch = next(batches)
            (causal_lm_loss(module(batch["input_ids"]), batch["labels"]) / micro_batches).backward()
        params = list(module.named_parameters())
        if compressor is None and step in SPECTRUM_STEPS:
            grads = [p.grad for _, p in params if p.ndim == 2]
            spectrum[step] = {r: top_energy(grads, r) for r in SPECTRUM_RANKS}
        if compressor is not None and step >= start_step:
            matrices = [(n, p.grad) for n, p in params if powersgd_compressible(p.shape, compressor.rank)]
            errors = [compressor.errors.get(n, torch.zeros_like(g)) for n, g in matrices]
            carried.append(
                math.sqrt(
                    sum(float(e.square().sum()) for e in errors) / sum(float(g.square().sum()) for _, g in matrices)
                )
            )
            input_sq = sum(float((g + e).square().sum()) for (_, g), e in zip(matrices, errors))  # ‖M‖², M = G + E
            compressor.reduce(
                matrices, [p.grad for n, p in params if not powersgd_compressible(p.shape, compressor.rank)]
            )
            left_sq = sum(float(compressor.errors[n].square().sum()) for n, _ in matrices)  # ‖M − approximation‖²
            residuals.append(math.sqrt(left_sq / input_sq))
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        scheduler.step()
    with torch.no_grad():
        losses = [float(causal_lm_loss(module(b["input_ids"]), b["labels"])) for b in data.val_dataloader()]
    return {
        "val_loss": sum(losses) / len(losses),
        "residual": sum(residuals) / len(residuals) if residuals else None,
        "carried": sum(carried) / len(carried) if carried else None,
        "spectrum": spectrum,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--ranks", type=int, nargs="*", default=[4, 6, 16], help="PowerSGD ranks")
    parser.add_argument("--svd-ranks", type=int, nargs="*", default=[4, 6], help="exact truncated-SVD ranks")
    parser.add_argument("--start-step", type=int, default=45)
    args = parser.parse_args()
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{Path(tmp) / 'pg'}", rank=0, world_size=1)
        try:
            runs = [("none", None)]
            runs += [(f"powersgd rank {r}", PowerSGD(r, dist.group.WORLD)) for r in args.ranks]
            runs += [(f"exact rank-{r} SVD", ExactLowRank(r)) for r in args.svd_ranks]
            results = {}
            for name, compressor in runs:
                results[name] = train(config, args.steps, args.start_step, compressor)
                print(f"  {name}: {results[name]['val_loss']:.4f}", file=sys.stderr, flush=True)
        finally:
            dist.destroy_process_group()
    base = results["none"]["val_loss"]
    print(
        f"main job's model, data and optimizer (configs/tiny.yaml), one process, {args.steps} steps, "
        "compression from "
        f"step {args.start_step}, error feedback"
    )
    print("| gradients | mean residual | mean ‖E‖/‖G‖ | final val_loss | vs none |")
    print("|---|---:|---:|---:|---:|")
    for name, result in results.items():
        res, car = (f"{result[k]:.3f}" if result[k] is not None else "-" for k in ("residual", "carried"))
        print(f"| {name} | {res} | {car} | {result['val_loss']:.4f} | {(result['val_loss'] - base) / base:+.2%} |")
    print(
        "Residual: sqrt(Σ‖M − approximation‖² / Σ‖M‖²), M = gradient + carried error E; ‖E‖/‖G‖: the error carried "
        "into a step relative to its gradient; both means over the compressed steps."
    )
    for step, energy in results["none"]["spectrum"].items():
        print(
            f"uncompressed run, step {step}: the top "
            + ", ".join(f"{r}: {e:.1%}" for r, e in energy.items())
            + " singular values of each matrix hold that share of the step's gradient energy"
        )


if __name__ == "__main__":
    main()
