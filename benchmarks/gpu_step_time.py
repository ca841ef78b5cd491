"""Single-GPU training step: FourDStrategy against plain PyTorch, side by side in one run; and SDPA against eager
attention in bf16 (``benchmarks/gpu_check.sh`` runs both on a lent GPU).

Step time: for each (preset, b, s), ``--steps`` optimizer steps (the first ``--warmup`` not counted) of

- ``plain``: the same :class:`~lightning_4d.models.LlamaModel` (float32 weights, ``torch.autocast`` bf16), the same
  loss (:func:`~lightning_4d.parallel.loss.causal_lm_loss`), ``torch.optim.AdamW(fused=True)``, a bare loop;
- ``ours``: :class:`~lightning_4d.tasks.CausalLMModule` under ``Trainer(strategy=FourDStrategy(data_parallel_size=1,
  zero_stage=0, activation_checkpointing=...), precision="bf16-mixed")`` (bf16 weights + float32 master weights),
  with ``none`` and ``selective`` checkpointing, and ``offload``: no checkpointing, half the layers' activations in
  host memory (``activation_offload_layers``: its copies overlapped on side streams); ``compile``: no
  checkpointing, ``compile=True`` (each decoder layer ``torch.compile``d, the compilation inside the warm-up steps),
  and ``compile_offload``: that with the offload; ``compile_float8_<recipe>``: ``compile=True`` with
  ``float8="tensorwise"`` / ``"rowwise"`` (torchao's float8 linears, the extra ``lightning-4d[float8]``; set by
  ``--float8``, none with ``--float8`` alone): tokens/s against ``compile`` is float8's gain;

each inside ``sdpa_kernel(FLASH_ATTENTION)`` (the flash backend or an error). Printed: median step time, tokens/s,
MFU (``LlamaConfig.flops_per_token`` / the device's dense bf16 peak, ``lightning_4d.planning.hardware``), peak
allocated GiB, and ours / plain step-time ratio (above 1: our overhead).

SDPA check: logits of the same bf16 model with ``attention_backend="sdpa"`` and ``"eager"`` (max |diff| / max
|logit|), and their float32 versions as the reference.

Usage::

    python benchmarks/gpu_step_time.py --out DIR [--device cuda] [--preset llama3.2-1b] [--shapes 1x4096 2x4096 ...]

With ``--device cpu`` (and a small preset) it dry-runs the same code on CPU (no flash context, no MFU).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

#: the rows of each shape, in the order they run
ROWS = ("plain", "ours_none", "ours_selective", "ours_offload", "ours_compile", "ours_compile_offload")


def _flash(device: str):
    if device != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def batches(vocab: int, b: int, s: int, n: int):
    """``n`` batches of ``b x s`` random tokens (seed 0) with their next-token labels, as ``CausalLMModule`` takes
    them (on the CPU: the Trainer moves them)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        ids = torch.randint(0, vocab, (b, s + 1), generator=g)
        yield {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _reset(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")


def plain(cfg, b: int, s: int, steps: int, warmup: int, device: str) -> dict:
    from lightning_4d.models import LlamaModel
    from lightning_4d.parallel.loss import causal_lm_loss

    _reset(device)
    torch.manual_seed(0)
    model = LlamaModel(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    times = []
    for batch in batches(cfg.vocab_size, b, s, steps):
        ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        _sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = causal_lm_loss(model(ids), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    out = {"step_s": statistics.median(times[warmup:]), "peak_gib": _peak(device), "loss": float(loss.detach())}
    del model, opt
    return out


def timed_fit(
    module: Any,
    strategy: Any,
    data: Iterable[dict],
    device: str,
    precision: str,
    clock: Callable[[], float] = time.perf_counter,
    on_batch_start: Optional[Callable[[int], None]] = None,
) -> tuple[list[float], Any]:
    """Fit ``module`` under ``Trainer(strategy=strategy, precision=precision)`` on one ``device``, one step per batch
    of ``data`` (no validation, logging, checkpointing or progress bar), and time every step from
    ``on_train_batch_start`` to ``on_train_batch_end`` by ``clock`` (seconds; the device synchronized at both ends).
    ``on_batch_start(batch_idx)`` runs before each step's clock starts. Returns (the step times, the Trainer)."""
    import lightning as L
    from torch.utils.data import DataLoader, IterableDataset

    batch_list = list(data)
    times: list[float] = []

    class Tokens(IterableDataset):
        def __iter__(self):
            return iter(batch_list)

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if on_batch_start is not None:
                on_batch_start(batch_idx)
            _sync(device)
            self.t0 = clock()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            _sync(device)
            times.append(clock() - self.t0)

    trainer = L.Trainer(
        accelerator=device,
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=len(batch_list),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[Timer()],
    )
    trainer.fit(module, DataLoader(Tokens(), batch_size=None))
    return times, trainer


def ours(
    cfg,
    b: int,
    s: int,
    steps: int,
    warmup: int,
    device: str,
    ac: str,
    offload: int = 0,
    compile: bool = False,
    float8: str | None = None,
) -> dict:
    from lightning_4d import FourDStrategy
    from lightning_4d.tasks import CausalLMModule

    _reset(device)
    module = CausalLMModule(cfg, learning_rate=1e-4, warmup_steps=1, max_steps=steps)
    strategy = FourDStrategy(
        data_parallel_size=1,
        zero_stage=0,
        activation_checkpointing=ac,
        activation_offload_layers=offload,
        compile=compile,
        float8=float8,
        memory_check=False,
    )
    times, trainer = timed_fit(module, strategy, batches(cfg.vocab_size, b, s, steps), device, "bf16-mixed")
    out = {
        "step_s": statistics.median(times[warmup:]),
        "peak_gib": _peak(device),
        "loss": float(trainer.callback_metrics["train_loss"]),
    }
    del trainer, module
    return out


def sdpa_check(cfg, device: str) -> dict:
    """Max |logits(sdpa) - logits(eager)| / max |logits(eager)| in bf16 and in float32, b=2, s=512."""
    from dataclasses import replace

    from lightning_4d.models import LlamaModel

    ids = torch.randint(0, cfg.vocab_size, (2, 512), generator=torch.Generator().manual_seed(1)).to(device)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits = {}
        for backend in ("eager", "sdpa"):
            torch.manual_seed(0)
            model = LlamaModel(replace(cfg, attention_backend=backend)).to(device=device, dtype=dtype).eval()
            with torch.no_grad():
                logits[backend] = model(ids).float()
            del model
        err = ((logits["sdpa"] - logits["eager"]).abs().max() / logits["eager"].abs().max()).item()
        out[str(dtype).replace("torch.", "")] = err
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for gpu_step_time.json")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--shapes", nargs="+", default=["2x4096", "1x8192", "2x8192"], help="BxS micro-batch shapes")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sdpa-preset", default="small", help="model of the SDPA-vs-eager check")
    p.add_argument(
        "--float8",
        nargs="*",
        default=["tensorwise", "rowwise"],
        choices=["tensorwise", "rowwise"],
        help="the float8 recipes of the compile_float8_<recipe> rows (needs torchao: skipped with the reason printed "
        "when it is missing; none: --float8 alone)",
    )
    args = p.parse_args()

    from lightning_4d.models import LlamaConfig
    from lightning_4d.parallel.float8 import check_float8_device, validate_float8

    if args.float8:
        try:  # torchao missing or too old: the float8 rows are skipped, the others run
            validate_float8(args.float8[0])
            check_float8_device(args.float8[0], torch.device(args.device))
        except ValueError as err:
            print(f"float8 rows {', '.join(args.float8)} skipped: {err}", flush=True)
            args.float8 = []
    from lightning_4d.planning.hardware import peak_flops_of_device
    from lightning_4d.provenance import code_record

    device = args.device
    code = code_record(device)
    name = code["card"]
    peak = peak_flops_of_device(name) if device == "cuda" else None
    result = {"device": name, "code": code, "preset": args.preset, "rows": []}
    out_path = Path(args.out) / "gpu_step_time.json"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result["sdpa_vs_eager"] = sdpa_check(LlamaConfig.from_preset(args.sdpa_preset), device)
    print(f"sdpa vs eager, max |diff| / max |logit|: {result['sdpa_vs_eager']}", flush=True)
    out_path.write_text(json.dumps(result, indent=1))
    cfg = LlamaConfig.from_preset(args.preset, attention_backend="sdpa")
    half = cfg.num_layers // 2
    for shape in args.shapes:
        b, s = map(int, shape.split("x"))
        flops = cfg.flops_per_token(s)
        row = {"b": b, "s": s}
        result["rows"].append(row)  # written after each run: a run stopped from outside keeps what it timed
        runs = {
            "plain": lambda: plain(cfg, b, s, args.steps, args.warmup, device),
            **{
                f"ours_{ac}": (lambda ac=ac: ours(cfg, b, s, args.steps, args.warmup, device, ac))
                for ac in ("none", "selective")
            },
            # half the layers' activations in host memory
            "ours_offload": lambda: ours(cfg, b, s, args.steps, args.warmup, device, "none", half),
            # compile=True (each decoder layer; the first step compiles and falls in the warm-up), alone and with
            # the offload (its hooks outside the compiled graphs)
            "ours_compile": lambda: ours(cfg, b, s, args.steps, args.warmup, device, "none", compile=True),
            "ours_compile_offload": lambda: ours(
                cfg, b, s, args.steps, args.warmup, device, "none", half, compile=True
            ),
            # float8 linears (torchao) under compile, which fuses their casts
            **{
                f"ours_compile_float8_{recipe}": (
                    lambda recipe=recipe: ours(
                        cfg, b, s, args.steps, args.warmup, device, "none", compile=True, float8=recipe
                    )
                )
                for recipe in args.float8
            },
        }
        for key, run in runs.items():
            with _flash(device):
                r = row[key] = run()
            r["tokens_per_s"] = b * s / r["step_s"]
            r["mfu"] = r["tokens_per_s"] * flops / peak if peak else None
            if key != "plain":
                r["ratio_to_plain"] = r["step_s"] / row["plain"]["step_s"]
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
            print(
                f"{args.preset} b={b} s={s} {key:>30}: {r['step_s'] * 1e3:8.1f} ms  "
                f"{r['tokens_per_s']:10,.0f} tok/s  MFU {mfu}  peak {r['peak_gib']:.2f} GiB  "
                f"ratio {r.get('ratio_to_plain', 1.0):.3f}",
                flush=True,
            )
            out_path.write_text(json.dumps(result, indent=1))
    out_path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
