"""Mixture-of-Experts layers under ``torch.compile``: a graph break at the host read of the routing counts, or
dynamic shapes (issue 35 item 1). One process, CPU, float32, the ``tiny-moe`` preset, batch ``b x s``:

- ``eager``: no compile;
- ``break``: what ``FourDStrategy(compile=True)`` does (:func:`lightning_4d.parallel.compile.compile_layers`): each
  decoder layer compiled, its MoE feed-forward run eagerly between the compiled parts;
- ``dynamic``: each decoder layer compiled whole, MoE included, with Dynamo tracing the counts' ``.tolist()`` as
  unbacked symbolic sizes (``_compat.compile.dynamo_dynamic_scalars``).

Printed per mode: the first step's seconds (compilation included), the median of the next ``--steps`` forward +
backward steps, the graphs compiled and the loss of the first step (the three must agree to float32 rounding); a
mode whose compilation fails prints its error.

Usage::

    PYTHONPATH=$PWD python benchmarks/compile_moe.py [--steps 10] [--batch 2] [--seq-length 64]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def run(mode: str, b: int, s: int, steps: int) -> dict:
    from lightning_4d.models import LlamaConfig, LlamaModel
    from lightning_4d.parallel._compat.compile import compiled_graph_count, dynamo_dynamic_scalars
    from lightning_4d.parallel.compile import compile_layers
    from lightning_4d.parallel.loss import causal_lm_loss

    torch.compiler.reset()
    model = LlamaModel(LlamaConfig.from_preset("tiny-moe"), init_seed=7)
    if mode == "break":
        compile_layers(list(model.layers.values()))
    elif mode == "dynamic":
        for layer in model.layers.values():
            layer.forward = torch.compile(layer.forward, fullgraph=True)
    ids = torch.randint(0, model.config.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
    graphs = compiled_graph_count()
    times, first_loss = [], None
    with dynamo_dynamic_scalars() if mode == "dynamic" else contextlib.nullcontext():
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            loss = causal_lm_loss(model(ids[:, :-1]), ids[:, 1:])
            loss.backward()
            times.append(time.perf_counter() - t0)
            first_loss = float(loss.detach()) if first_loss is None else first_loss
            model.zero_grad(set_to_none=True)
    return {
        "first_s": times[0],
        "step_ms": 1e3 * statistics.median(times[1:]),
        "graphs": compiled_graph_count() - graphs,
        "loss": first_loss,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=64)
    args = p.parse_args()
    for mode in ("eager", "break", "dynamic"):
        try:
            r = run(mode, args.batch, args.seq_length, args.steps)
        except Exception as e:  # a mode that does not compile: say how it fails  # noqa: BLE001
            print(f"{mode:>8}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        print(
            f"{mode:>8}: first step {r['first_s']:6.1f} s, then {r['step_ms']:7.2f} ms/step, "
            f"{r['graphs']} graphs, loss {r['loss']:.7f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
