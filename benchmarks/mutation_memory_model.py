"""Mutation testing of the memory model with mutmut: how many small edits of its formula modules the quick tier
catches.

``python benchmarks/mutation_memory_model.py [--modules states params ...] [--dir DIR] [--max-children N]
[--functions NAME ...]``
(``pip install mutmut``, 3.8 or later; not a project dependency):

1. copies the working tree (tracked files, no ``.git``) into ``--dir`` (default: a temporary folder, kept when given);
2. writes mutmut's ``setup.cfg`` there: the modules of ``lightning_4d/planning/`` named by ``--modules`` (default:
   ``states params activations buffers``, the model-state, parameter, activation and buffer terms) are mutated, and
   each mutant is run against the quick-tier tests of the memory model (:data:`TESTS`, ``-m "not slow"``) that call
   the mutated function;
3. writes a pytest plugin that clears every ``functools.lru_cache`` of ``lightning_4d.planning`` before each test:
   mutmut forks each mutant's run from a process that already ran the tests, so a cached result (``zero1_owned``,
   ``first_bucket_elements``, the planner's and the step-time model's caches) would hide the mutated function from
   both the test-to-function map and the run (measured: without it every mutant of ``bucket_owned`` "survived"; with
   it the first one planted by hand fails ``test_model_states_zero_stages_shard_what_they_should``);
4. runs ``mutmut run`` (``--functions``: only the mutants of those functions of the mutated modules, e.g.
   ``saved_bytes _fsdp_units``: mutmut's name patterns ``lightning_4d.planning.<module>.x_<function>__mutmut_*``)
   and prints, per module, the mutants killed, survived, not reached by any quick test, timed out,
   and the score ``killed / (killed + survived + not reached)``, then each survivor's diff (``mutmut show``).

Not a test (minutes to hours: about 2,200 mutants over the four default modules). A surviving mutant is either a
missing test (add one that fails on it) or an equivalent edit (justify it in one line in the closing note).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the quick-tier test files that exercise the memory model (run with ``-m "not slow"``; the plan-405B timing test left
#: out: mutmut's trampolines make every call slower)
TESTS = (
    "test_memory_model.py",
    "test_memory_terms_exact.py",
    "test_memory_model_states.py",
    "test_fujii2024.py",
    "test_memory_check.py",
    "test_expert_planning.py",
    "test_activation_checkpointing.py",
    "test_layout.py",
    "test_hsdp.py",
    "test_optimizer_offload.py",
    "test_tied_pipeline.py",
    "test_document_masking.py",
    "test_context_parallel.py",
    "test_moe_tensor_parallel.py",
    "test_float8.py",
    "test_activation_offload.py",
    "test_compression.py",
    "test_measure.py",
    "test_mixed_precision.py",
    "test_moe.py",
    "test_expert_parallel.py",
)

PLUGIN = '''"""Clear lightning_4d.planning's lru caches before each test (benchmarks/mutation_memory_model.py)."""
import functools
import sys

import pytest


@pytest.fixture(autouse=True)
def _fresh_planning_caches():
    for name, module in list(sys.modules.items()):
        if name.startswith("lightning_4d.planning") or name.startswith("lightning_4d.features"):
            for value in list(vars(module).values()):
                if isinstance(value, functools._lru_cache_wrapper):
                    value.cache_clear()
    yield
'''


def write_config(tree: Path, modules: list[str]) -> None:
    """mutmut's ``setup.cfg`` and the cache-clearing plugin in ``tree``."""
    lines = ["[mutmut]", "source_paths=", "    lightning_4d", "only_mutate="]
    lines += [f"    lightning_4d/planning/{m}.py" for m in modules]
    lines += ["pytest_add_cli_args_test_selection="] + [f"    tests/{t}" for t in TESTS]
    lines += ["pytest_add_cli_args="] + [f"    {a}" for a in ("-m", "not slow", "-k", "not 16384_gpus")]
    lines += [f"    {a}" for a in ("-p", "no:cacheprovider", "-p", "mutation_fresh_caches")]
    lines += ["also_copy=", "    configs/", "    examples/", "    docs/", "    benchmarks/", "    README.md"]
    lines += ["    mutation_fresh_caches.py", "track_dependencies=false", "forkserver_warmup=none"]
    (tree / "setup.cfg").write_text("\n".join(lines) + "\n")
    (tree / "mutation_fresh_caches.py").write_text(PLUGIN)


def summary(tree: Path, mutmut: str) -> int:
    """Print the counts per module and every survivor's diff; returns the number of survivors."""
    out = subprocess.run([mutmut, "results", "--all", "true"], cwd=tree, capture_output=True, text=True).stdout
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    survivors = []
    for line in out.splitlines():
        if ":" not in line:
            continue
        name, status = (part.strip() for part in line.rsplit(":", 1))
        counts[name.split(".")[2]][status] += 1
        if status in ("survived", "no tests"):
            survivors.append((name, status))
    print("| module | killed | survived | no tests | timeout | not checked | score |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for module, c in sorted(counts.items()):
        judged = c["killed"] + c["survived"] + c["no tests"]
        score = f"{c['killed'] / judged:.3f}" if judged else "n/a"
        row = [c["killed"], c["survived"], c["no tests"], c["timeout"], c["not checked"], score]
        print(f"| {module} | " + " | ".join(str(x) for x in row) + " |")
    for name, status in survivors:
        shown = subprocess.run([mutmut, "show", name], cwd=tree, capture_output=True, text=True).stdout
        print(f"\n## {name} ({status})\n" + "\n".join(shown.splitlines()[1:]))
    return len(survivors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", nargs="+", default=["states", "params", "activations", "buffers"])
    parser.add_argument("--dir", type=Path, help="working folder (kept; a rerun there continues the run)")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--summary-only", action="store_true", help="print the results of a run in --dir")
    parser.add_argument("--functions", nargs="+", default=[], help="mutate only these functions of --modules")
    args = parser.parse_args(argv)
    mutmut = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or shutil.which("mutmut")
    if mutmut is None:
        print("mutation_memory_model: mutmut is not installed (pip install 'mutmut>=3.8')", file=sys.stderr)
        return 2
    unknown = [m for m in args.modules if not (ROOT / "lightning_4d" / "planning" / f"{m}.py").exists()]
    if unknown:
        print(f"mutation_memory_model: no module lightning_4d/planning/{unknown[0]}.py", file=sys.stderr)
        return 2
    tree = args.dir or Path(tempfile.mkdtemp(prefix="mutation_"))
    if not args.summary_only and not (tree / "setup.cfg").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        write_config(tree, args.modules)
    if not args.summary_only:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the mutants, not this checkout
        env["OMP_NUM_THREADS"] = "1"
        names = [f"lightning_4d.planning.{m}.x_{f}__mutmut_*" for m in args.modules for f in args.functions]
        subprocess.run([mutmut, "run", "--max-children", str(args.max_children), *names], cwd=tree, env=env)
    summary(tree, mutmut)
    return 0


if __name__ == "__main__":
    sys.exit(main())
