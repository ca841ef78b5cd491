"""Can several ranks share one GPU? Which collectives each backend accepts with two processes on the same device.

Issue 32, item 4: the parity suite's small layouts (dp2 x tp2, pp2 x dp2, cp2 x dp2, ep2) could run on CUDA on a
single lent GPU only if two or more processes on ``cuda:0`` can run our collectives. NCCL is known to refuse two
ranks on one device ("Duplicate GPU detected"); gloo takes CUDA tensors for some collectives only (it stages them
through host memory). This program tries each backend and collective with ``--world-size`` processes on one device
and writes, per (backend, collective), ``ok`` or the first line of the error, as JSON (``--out``).

Usage::

    python benchmarks/ranks_on_one_gpu.py --out benchmarks/results [--device cpu]   # cpu: gloo only, a dry run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: the collectives our strategy uses (DTensor tp/sp, FSDP2, the pipeline, expert all-to-all, cp ring)
COLLECTIVES = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
    "send_recv",
)


def _try(name: str, device: torch.device, rank: int, world: int) -> None:
    x = torch.full((8,), float(rank + 1), device=device)
    if name == "all_reduce":
        dist.all_reduce(x)
        assert x[0].item() == world * (world + 1) / 2
    elif name == "all_gather_into_tensor":
        out = torch.empty(8 * world, device=device)
        dist.all_gather_into_tensor(out, x)
        assert out[8].item() == 2
    elif name == "reduce_scatter_tensor":
        out = torch.empty(8 // world, device=device)
        dist.reduce_scatter_tensor(out, x)
        assert out[0].item() == world * (world + 1) / 2
    elif name == "all_to_all_single":
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        assert out[-1].item() == world
    elif name == "broadcast":
        dist.broadcast(x, src=0)
        assert x[0].item() == 1
    elif name == "send_recv":
        peer = (rank + 1) % world
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, torch.empty_like(x), (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(rank: int, world: int, backend: str, device_type: str, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    results: dict[str, str] = {}
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30), device_id=None
        )
    except Exception as err:  # noqa: BLE001 - the error is the result
        queue.put((rank, {"init": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}))
        return
    results["init"] = "ok"
    for name in COLLECTIVES:
        try:
            _try(name, device, rank, world)
            results[name] = "ok"
        except Exception as err:  # noqa: BLE001 - the error is the result
            results[name] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
            break  # a failed collective can leave the group unusable: the rest are not tried
    queue.put((rank, results))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(backend: str, device_type: str, world: int, timeout: float = 120.0) -> dict[str, str]:
    """``{step: "ok" | error}`` of ``world`` processes of ``backend`` on one ``device_type`` device (rank 0's view,
    or the first rank that reported an error)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, backend, device_type, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    reports: dict[int, dict[str, str]] = {}
    try:
        for _ in procs:
            rank, res = queue.get(timeout=timeout)
            reports[rank] = res
    except Exception:  # noqa: BLE001 - a hang is a result too
        reports.setdefault(-1, {"timeout": f"no report within {timeout:.0f} s (a collective hung)"})
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    bad = [r for r in reports.values() if any(v != "ok" for v in r.values())]
    return bad[0] if bad else reports.get(0, {})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu for a dry run", file=sys.stderr)
        return 2
    backends = ["gloo", "nccl"] if args.device == "cuda" else ["gloo"]
    from lightning_4d.provenance import code_record

    results = {b: run(b, args.device, args.world_size) for b in backends}
    name = torch.cuda.get_device_name(0).replace(" ", "_") if args.device == "cuda" else "cpu"
    record = {
        "device": name,
        "code": code_record(args.device),  # which code ran it
        "world_size": args.world_size,
        "date": datetime.date.today().isoformat(),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ranks_on_one_gpu_{name}_{record['date']}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    for backend, res in results.items():
        for step, verdict in res.items():
            print(f"{backend:5} {step:24} {verdict}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
