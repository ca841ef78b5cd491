"""Plant known bugs in a scratch copy of the package and see whether the tests of each bug's feature catch it.

For each bug of :data:`BUGS` (one per concern: the bf16-mixed master write-back, the data-parallel gradient reduction, a
gradient bucket offset, the pipeline's micro-batch order and loss scaling, a context-parallel chunk index, the expert-
major row order, the ZeRO-1 checkpoint slice, a memory-model term, the global gradient norm under tp, pp, ep and ZeRO 3,
document masking's ring skip and loss normalization, HSDP's replica reduction and norm, optimizer offload's host
gradient, data blends and resume, tied embeddings under pp, Ulysses' kv heads, all-gather cp, MoE under tp, activation
offload, compile, float8), this copies the working tree (without ``.git``) to a scratch folder, replaces one exact
snippet of one file (it must occur exactly once, so an edit of the package that moves the code fails here loudly instead
of planting nothing), and runs the whole test files of that feature in one pytest run in the copy (``PYTHONPATH`` = the
copy: the torchrun workers the tests launch import the planted package too; the working tree itself is never edited).
The run stops at the first failing test (pytest's ``-x``) and the bug's result names it: ``caught (first failure: TEST
ID; N ran)``; with ``--every`` every test runs and the result counts the failures: ``caught by F of N``. A bug that no
test fails is ``NOT CAUGHT``.

Not a test (it runs whole test files once per bug: minutes): ``python benchmarks/planted_bugs.py`` (``--only NAME``
for some bugs, ``--every`` to run every test, ``--tests ARGS`` to run them against other pytest arguments,
``--baseline`` to run the same files without a bug first, ``--list`` to print the bugs).
Every bug must be caught; add the bugs found in the wild to :data:`BUGS`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bug:
    name: str
    what: str
    path: str  # file of the package, relative to the repository root
    old: str  # the exact snippet replaced (occurs exactly once in ``path``)
    new: str
    tests: tuple[str, ...]  # the whole test files of the feature (one pytest run)


BUGS: tuple[Bug, ...] = (
    Bug(
        "master-write-back",
        "bf16-mixed: the updated fp32 masters of 1-D parameters (norm weights) are not copied into the bf16 weights",
        "lightning_4d/parallel/sharded_optimizer.py",
        "                if end > start:  # with offload, host to device",
        "                if end > start and p.ndim > 1:  # with offload, host to device",
        ("tests/test_parity.py",),
    ),
    Bug(
        "dp-gradient-not-reduced",
        "ZeRO 0/1: the first gradient bucket is never reduced over dp (each rank keeps its own gradient, divided by D)",
        "lightning_4d/parallel/grad_buffers.py",
        "        if b.world == 1:  # a gradient group of one rank",
        "        if b.world == 1 or i == 0:  # a gradient group of one rank",
        ("tests/test_parity.py",),
    ),
    Bug(
        "gradient-bucket-offset",
        "ZeRO 0/1: each parameter's gradient slice starts one element early in its bucket (slices overlap by one)",
        "lightning_4d/parallel/grad_buffers.py",
        "            self.offsets[id(p)] = n\n",
        "            self.offsets[id(p)] = max(n - 1, 0)\n",
        ("tests/test_parity.py",),
    ),
    Bug(
        "pp-microbatch-order",
        "pipeline: the labels' batch order reversed, so micro-batch i's outputs are scored against micro-batch "
        "m - 1 - i's labels",
        "lightning_4d/features/pipeline/runtime.py",
        "schedule.step(*args, target=labels if self.is_last else None, losses=losses, return_outputs=False)",
        "schedule.step(*args, target=labels.flip(0) if self.is_last else None, losses=losses, return_outputs=False)",
        ("tests/test_pipeline.py",),
    ),
    Bug(
        "pp-loss-scale",
        "pipeline: each micro-batch's loss divided by m + 1 instead of m",
        "lightning_4d/features/pipeline/runtime.py",
        "loss = loss_fn(output, target) / m",
        "loss = loss_fn(output, target) / (m + 1)",
        ("tests/test_pipeline.py",),
    ),
    Bug(
        "cp-chunk-index",
        "ring attention: a block from an earlier cp rank is attended through its second chunk instead of its first",
        "lightning_4d/features/context_parallel/runtime.py",
        "        return slice(0, local), slice(0, half)\n",
        "        return slice(0, local), slice(half, local)\n",
        ("tests/test_context_parallel.py",),
    ),
    Bug(
        "expert-routing-index",
        "expert parallelism: received rows regrouped with the source-major block starts (no transpose)",
        "lightning_4d/features/moe/expert.py",
        "starts = (torch.cumsum(flat, 0) - flat).view(counts.shape).t().reshape(-1)",
        "starts = (torch.cumsum(flat, 0) - flat).view(counts.shape).reshape(-1)",
        ("tests/test_expert_parallel.py",),
    ),
    Bug(
        "checkpoint-reshard-slice",
        "ZeRO 1 resume: every rank reads the first rank's slice of each optimizer state",
        "lightning_4d/parallel/sharded_optimizer.py",
        "else value.reshape(-1)[start:end].to(device=shard.device, copy=True)",
        "else value.reshape(-1)[: end - start].to(device=shard.device, copy=True)",
        # test_reshard: float32 resumes on another layout, caught by their final weights (not by their losses)
        ("tests/test_checkpoint.py", "tests/test_reshard.py"),
    ),
    Bug(
        "memory-swiglu-term",
        "memory model: a SwiGLU layer saves 3 tensors of [b, s, f/t] instead of 4",
        "lightning_4d/planning/activations.py",
        '"swiglu": moe_costs.saved_bytes(cfg, dt, b, s_moe, *moe) if moe_layer else 4 * c * b * s * (f // tp),',
        '"swiglu": moe_costs.saved_bytes(cfg, dt, b, s_moe, *moe) if moe_layer else 3 * c * b * s * (f // tp),',
        ("tests/test_memory_model.py", "tests/test_activation_offload.py"),
    ),
    Bug(
        "clip-norm-tp-replicated",
        "gradient clipping under ZeRO 0/1 with tp: a tp-replicated parameter (the norm weights) is counted on every tp "
        "rank in the global gradient norm instead of once",
        "lightning_4d/parallel/clipping.py",
        "    if tp_rank == 0:\n        return False\n    if not isinstance(p, DTensor):",
        "    if tp_rank >= 0:\n        return False\n    if not isinstance(p, DTensor):",
        # the clipped layouts' global norm against the reference's (their losses and weights move too little)
        ("tests/test_parity.py",),
    ),
    Bug(
        "clip-norm-pp-stages-not-summed",
        "gradient clipping under pp with the gradients in .grad (no sharded optimizer): each stage clips by its own "
        "stages' norm, the norms not summed over the pipeline stages",
        "lightning_4d/parallel/clipping.py",
        "        group = pp_group\n",
        "        group = None\n",
        ("tests/test_pipeline.py",),
    ),
    Bug(
        "clip-norm-expert-group-size",
        "gradient clipping under ep at ZeRO 0: every gradient group's power sum divided by the default group's size "
        "(the experts' group is smaller), so the experts' gradients are undercounted in the global norm",
        "lightning_4d/parallel/clipping.py",
        "    sizes = [1 if sharded.sharded else dist.get_world_size(g.group) for g in groups]",
        "    sizes = [1 if sharded.sharded else dist.get_world_size(groups[0].group) for g in groups]",
        ("tests/test_expert_parallel.py",),
    ),
    Bug(
        "clip-norm-zero3-shard-only",
        "gradient clipping at ZeRO 2/3 (FSDP2's sharded DTensor gradients): each rank's norm taken over its own shards "
        "(the DTensors' local tensors), not over the whole gradients",
        "lightning_4d/parallel/clipping.py",
        "        groups.setdefault(key, []).append(g)",
        "        groups.setdefault(key, []).append(g.to_local() if isinstance(g, DTensor) else g)",
        ("tests/test_parity.py",),
    ),
    Bug(
        "ring-skips-spanned-block",
        "document masking under the cp ring: the blocks of earlier ranks are skipped even where a document spans them",
        "lightning_4d/features/context_parallel/runtime.py",
        "    return rows, cols, False, mask, mask is None",
        "    return rows, cols, False, mask, mask is None or source < rank",
        ("tests/test_document_masking.py",),
    ),
    Bug(
        "eod-loss-mean-of-means",
        "eod_mask_loss: each rank's loss is its own token mean (the global batch's mean of per-rank means), not its "
        "share of the global token mean",
        "lightning_4d/tasks/documents.py",
        "        return dist.get_world_size(group) / count.clamp_min(1.0)",
        "        return 1.0 / (labels != -100).sum().float()",
        ("tests/test_document_masking.py",),
    ),
    Bug(
        "hsdp-shard-not-reduced-over-replicas",
        "HSDP at ZeRO 0/1: the owned shard of the default gradient group is never all-reduced over the replicas (each "
        "replica steps with its own nodes' gradient, divided by every rank's count)",
        "lightning_4d/parallel/grad_buffers.py",
        "if self.num_replicas > 1 and b.index == 0:",
        "if self.num_replicas > 1 and b.index < 0:",
        ("tests/test_hsdp.py",),
    ),
    Bug(
        "hsdp-clip-norm-replicas",
        "HSDP clipping: the global gradient norm counts every replica's copy of the shard group's pieces",
        "lightning_4d/parallel/clipping.py",
        "    sizes[0] *= buckets.num_replicas",
        "    sizes[0] *= 1",
        ("tests/test_hsdp.py",),
    ),
    Bug(
        "optimizer-offload-stale-gradient",
        "optimizer offload at ZeRO 0/1: the host step reads its host gradient tensor without the device gradient "
        "copied into it",
        "lightning_4d/parallel/sharded_optimizer.py",
        "        host.copy_(grad, non_blocking=True)\n        return host",
        "        return host",
        ("tests/test_optimizer_offload.py",),
    ),
    Bug(
        "blend-sample-index",
        "data blends: each component's draws start at its second sample (the per-dataset sample index one ahead)",
        "lightning_4d/data/datasets.py",
        "        samples[i] = counts[best]",
        "        samples[i] = counts[best] + 1",
        ("tests/test_data.py",),
    ),
    Bug(
        "resume-mid-pass-offset",
        "resume: a pass resumed mid-epoch skips its first local batches a second time (the batch offset counted "
        "from the pass's start instead of the resume point)",
        "lightning_4d/data/datasets.py",
        "            base = start + (t - first_batch) * stride + self.rank",
        "            base = start + t * stride + self.rank",
        ("tests/test_data.py",),
    ),
    Bug(
        "tied-copies-max-not-sum",
        "tied embeddings under pp: the two copies' gradients are combined with a max instead of summed",
        "lightning_4d/features/pipeline/runtime.py",
        "            dist.all_reduce(g, group=self.group)",
        "            dist.all_reduce(g, op=dist.ReduceOp.MAX, group=self.group)",
        ("tests/test_tied_pipeline.py",),
    ),
    Bug(
        "ulysses-kv-head-order",
        "all-to-all (Ulysses) cp with fewer kv heads than cp ranks: the kv heads repeated in turn instead of each "
        "one in place, so a rank receives another query group's kv head",
        "lightning_4d/features/context_parallel/runtime.py",
        "k, v = (t.repeat_interleave(size // t.shape[2], dim=2) for t in (k, v))",
        "k, v = (t.repeat(1, 1, size // t.shape[2], 1) for t in (k, v))",
        ("tests/test_context_parallel.py",),
    ),
    Bug(
        "allgather-drops-first-chunk",
        "all-gather cp: the second query chunk does not attend to the first chunk's keys",
        "lightning_4d/features/context_parallel/runtime.py",
        "([(slice(0, index * chunk), False, None)] if index > 0 else [])",
        "([(slice(0, index * chunk), False, None)] if index > 1 else [])",
        ("tests/test_context_parallel.py",),
    ),
    Bug(
        "moe-tp-router-gradient-not-summed",
        "MoE layers under tp (run token parallel): the router's and shared experts' gradients are reduced over dp x cp "
        "only, not summed over the tp ranks' tokens",
        "lightning_4d/features/moe/runtime.py",
        '    if mesh.get("dp_cp_tp") is not None:\n        tokens',
        '    if mesh.get("dp_cp_tp") is None:\n        tokens',
        ("tests/test_moe_tensor_parallel.py",),
    ),
    Bug(
        "offload-host-copy-skipped",
        "activation offload: the host copy of a saved tensor is zeroed instead of copied (backward brings back zeros)",
        "lightning_4d/parallel/offload.py",
        "                host.copy_(flat)",
        "                host.zero_()",
        ("tests/test_activation_offload.py",),
    ),
    Bug(
        "compile-not-applied",
        "compile=True: the decoder layers keep their eager forward (nothing is compiled, silently)",
        "lightning_4d/parallel/compile.py",
        "        inner.forward = _compiled_forward(inner.forward)",
        "        inner.forward = inner.forward",
        ("tests/test_compile.py",),
    ),
    Bug(
        "float8-nothing-converted",
        "float8: no linear is converted to torchao's Float8Linear (the run trains in bf16, silently)",
        "lightning_4d/parallel/float8.py",
        "module_filter_fn=lambda _, fqn: fqn in chosen,",
        "module_filter_fn=lambda _, fqn: False,",
        ("tests/test_float8.py",),
    ),
)


def _copy_tree(dest: Path) -> None:
    """The working tree (tracked and untracked files, not ``.git``, virtual environments or caches) into ``dest``."""
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "site")
    shutil.copytree(ROOT, dest, ignore=ignore)


def _plant(tree: Path, bug: Bug) -> None:
    path = tree / bug.path
    text = path.read_text()
    count = text.count(bug.old)
    if count != 1:
        raise SystemExit(f"{bug.name}: the snippet occurs {count} times in {bug.path} (expected once): update BUGS")
    path.write_text(text.replace(bug.old, bug.new))


def _run_tests(tree: Path, tests: tuple[str, ...], timeout: float, every: bool) -> tuple[list[str], int, float]:
    """(the ids of the tests that failed or errored, how many ran, seconds) of ``pytest tests`` in ``tree``, stopped
    at the first failure (pytest's ``-x``) unless ``every``; ran is -1 when pytest timed out or wrote no report."""
    report = tree / f"report_{len(list(tree.glob('report_*.xml')))}.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(tree)
    env["OMP_NUM_THREADS"] = "1"
    stop = [] if every else ["-x"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *stop, f"--junitxml={report}", *tests]
    start = time.time()
    try:
        subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [], -1, time.time() - start
    seconds = time.time() - start
    if not report.exists():
        return [], -1, seconds
    failed, ran = [], 0
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        ran += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{Path(case.get('classname', '').replace('.', '/')).name}::{case.get('name')}")
    return failed, ran, seconds


def run(bug: Bug | None, tests: tuple[str, ...], timeout: float, every: bool = False) -> tuple[list[str], int, float]:
    """Plant ``bug`` (``None``: nothing) in a scratch copy and run ``tests`` there in one pytest run (stopped at the
    first failure unless ``every``): (failed tests, ran, seconds)."""
    with tempfile.TemporaryDirectory(prefix="planted_") as scratch:
        tree = Path(scratch) / "repo"
        _copy_tree(tree)
        if bug is not None:
            _plant(tree, bug)
        return _run_tests(tree, tests, timeout, every)


def verdict(failed: list[str], ran: int, every: bool) -> str:
    """The result of one bug's run: ``caught by N of M`` (every test ran), ``caught (first failure: ID; M ran)``
    (stopped at the first failure), ``NOT CAUGHT (0 of M)`` or ``timed out / no report``."""
    if ran < 0:
        return "timed out / no report"
    if not failed:
        return f"NOT CAUGHT (0 of {ran})"
    return f"caught by {len(failed)} of {ran}" if every else f"caught (first failure: {failed[0]}; {ran} ran)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="names of the bugs to plant (default: all)")
    parser.add_argument("--baseline", action="store_true", help="first run each bug's tests without a bug")
    parser.add_argument("--every", action="store_true", help="run every test (count the failures), not -x")
    parser.add_argument("--list", action="store_true", help="print the bugs and exit")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run")
    parser.add_argument(
        "--tests",
        nargs=argparse.REMAINDER,
        help="run the bugs against these pytest arguments instead of their own test files (last option: everything "
        "after it is pytest's, e.g. --only checkpoint-reshard-slice --tests tests/test_reshard.py -k dp2z1)",
    )
    args = parser.parse_args(argv)
    bugs = [b for b in BUGS if not args.only or b.name in args.only]
    if args.tests:
        bugs = [replace(b, tests=tuple(args.tests)) for b in bugs]
    if args.list:
        for b in bugs:
            print(f"{b.name}: {b.what} ({b.path}; tests: {' '.join(b.tests)})")
        return 0
    for b in bugs:  # every snippet still there before anything runs
        text = (ROOT / b.path).read_text()
        if text.count(b.old) != 1:
            raise SystemExit(f"{b.name}: the snippet occurs {text.count(b.old)} times in {b.path}: update BUGS")
    rows = []
    for b in bugs:
        if args.baseline:
            failed, ran, seconds = run(None, b.tests, args.timeout, every=True)
            print(f"baseline {b.name}: {len(failed)} of {ran} failed ({seconds:.0f} s) {failed or ''}", flush=True)
            if failed or ran < 0:
                print(f"  the tests fail without a bug: {b.name}'s result below means nothing", flush=True)
        failed, ran, seconds = run(b, b.tests, args.timeout, args.every)
        rows.append((b, verdict(failed, ran, args.every), seconds))
        print(f"{b.name}: {rows[-1][1]} ({seconds:.0f} s)", flush=True)
        for name in failed if args.every else ():
            print(f"    {name}", flush=True)
    print()
    print("| bug | planted in | tests run | result | seconds |\n|---|---|---|---|---|")
    for b, result, seconds in rows:
        print(f"| {b.name}: {b.what} | {b.path} | `{' '.join(b.tests)}` | {result} | {seconds:.0f} |")
    missed = [b.name for b, result, _ in rows if not result.startswith("caught")]
    total = sum(seconds for _, _, seconds in rows)
    caught = f"{len(rows) - len(missed)} of {len(rows)} planted bugs caught in {total:.0f} s"
    print(f"\n{caught}" + (f"; missed: {missed}" if missed else ""))
    if not args.baseline:  # a failure without the bug (a flake, a test already failing) would read as a catch
        print("(no --baseline: this assumes each bug's test files pass without it)")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
