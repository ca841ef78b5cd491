"""The support matrix: which feature combinations lightning_4d runs, defined once.

Every combination a user can ask for (ZeRO 0-3 x precision x tp/sp (+ overlap) x pp (each schedule, uneven split) x cp
(ring, allgather, alltoall) x activation checkpointing x activation offload x compile x Mixture-of-Experts (ep, tp, pp,
ZeRO) x model family) collapsed into the rows (:data:`ROWS`, defined as data in :mod:`lightning_4d.support_rows`) that
exercise distinct code. Each row has an id, a short description, its layout as the options of ``lightning-4d measure``
(:meth:`Row.argv`; presets ``small``, ``small-tied`` and ``tiny-moe``, s <= 2048) and three statuses:

- *refused*: the exact error the project's own validation raises before anything runs (``Row.refused``;
  :func:`validate_row` reproduces it and ``tests/test_support.py`` asserts the text is what it raises);
- *tested on CPU*: the pytest node ids that run the combination (``Row.cpu_tests``; ``tests/test_support.py``
  asserts each exists);
- *run on CUDA*: the card, date and commit of the newest CUDA smoke result under ``benchmarks/results/``
  (``smoke_<device>_<date>.json``, written by :func:`run_smoke` with the record of the code that ran it,
  :func:`lightning_4d.provenance.code_record`; :func:`cuda_results`), marked *changed since* when a file the row
  exercises (:meth:`Row.exercises`) differs from that commit now, and "commit not recorded" for a result written
  without it (:func:`cuda_state`). A GPU check runs the rows nothing backs first (:func:`smoke_plan`).

The same rows parametrize the CUDA smoke matrix (``tests/cuda/test_smoke.py``; ``benchmarks/gpu_check.sh`` runs it
first) and generate ``docs/support.md`` (``lightning-4d support --markdown``), so the three cannot drift.

The smoke run (:func:`run_row`): one rank of the row's layout on torch's fake process group
(:func:`lightning_4d.measure.measure_rank`; what its collectives would receive zero-filled,
:func:`defined_collectives`) for 2 steps, checking that it runs, the loss is finite, no decoder layer
returns a tensor of another dtype than it was given (the residual stream's dtype), and, on CUDA, that the measured
peak is within 5% of the estimate once the CUDA libraries' workspaces (measured before the fit) are counted. On CPU
(a dry run: ``python -m lightning_4d.support --smoke --device cpu --out DIR``) the peak and the estimate are
recorded, not asserted.

This module imports no torch: the CLI lists the matrix without it; the smoke run imports it when it runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

from lightning_4d.features import FEATURES
from lightning_4d.support_rows import (  # noqa: F401 (re-exported: the matrix is read from here)
    DEFAULTS,
    FAMILIES,
    HF_SMOKE_REASON,
    ROWS as OWN_ROWS,
    Row,
    measure_flags,
)

#: every row of the matrix: its own (:mod:`lightning_4d.support_rows`), then each feature's
#: (:attr:`lightning_4d.features.feature.Feature.rows`, in :data:`~lightning_4d.features.FEATURES` order)
ROWS: list[Row] = [*OWN_ROWS, *(row for feature in FEATURES for row in feature.rows)]
ROOT = Path(__file__).resolve().parent.parent
#: where the CUDA smoke results are read from (and gpu_check writes them)
RESULTS = ROOT / "benchmarks" / "results"
#: the largest |measured - (estimate + CUDA library workspaces)| / measured the CUDA smoke matrix accepts
PEAK_TOLERANCE = 0.05
#: decoder layer classes whose input and output dtypes the smoke run compares (ours, transformers')
DECODER_LAYERS = ("TransformerBlock", "LlamaDecoderLayer", "MixtralDecoderLayer")
#: the CPU dry run's sizes (every row's code paths at a size 2 cores run in seconds)
CPU_SEQ_LENGTH = 256
CPU_MICRO_BATCH_SIZE = 1


def row_by_id(row_id: str) -> Row:
    """The row named ``row_id``.

    Raises:
        ValueError: no row has that id (the message lists the ids).
    """
    for row in ROWS:
        if row.id == row_id:
            return row
    raise ValueError(f"support row {row_id!r} does not exist; valid ids: {', '.join(r.id for r in ROWS)}.")


def smoke_rows() -> list[Row]:
    """The rows the CUDA smoke matrix parametrizes: every row that is not refused (those the runner cannot run
    carry ``smoke_skip``)."""
    return [row for row in ROWS if row.refused is None]


# ------------------------------------------------------------------------------------------- a layout's coverage
def layout_features(options: dict[str, Any], moe: bool = False) -> frozenset[str]:
    """The features a layout combines, as the support matrix tells them apart: ``tp``, ``sp off``, ``tp overlap``,
    ``pp`` (and ``pp <schedule>`` for a schedule other than 1F1B), ``cp`` (and ``cp allgather``, ``cp alltoall``),
    ``ZeRO 0/2/3`` (ZeRO 1 is every row's default), ``<mode> checkpointing``, ``offload``, ``optimizer offload``,
    ``compile``, ``async checkpoint``, ``MoE``, ``ep`` (and ``ep over tp`` under tp: ep folded over the tp ranks).

    ``options``: a row's :meth:`Row.options` (``measure``'s names) or one of ``plan``'s layouts (its ``--json``
    names: the layout fields' own, ``context_parallel_method``, ...); sizes absent count as 1. Each feature's labels
    are its record's (``Feature.labels``), the others this function's."""
    get = options.get
    out = set().union(*(feature.labels(options) for feature in FEATURES))
    zero = get("zero_stage", 1)
    if zero != 1:
        out.add(f"ZeRO {zero}")
    ckpt = get("activation_checkpointing") or "none"
    if ckpt != "none":
        out.add(f"{ckpt} checkpointing")
    if get("activation_offload_layers"):
        out.add("offload")
    if get("optimizer_offload"):
        out.add("optimizer offload")
    if get("compile"):
        out.add("compile")
    if get("async_checkpoint"):
        out.add("async checkpoint")
    if moe:
        out.add("MoE")
    return frozenset(out)


def _row_is_moe(row: Row) -> bool:
    return row.family == "hf-mixtral" or row.options()["model"] == "tiny-moe"


def untested_pairs(options: dict[str, Any], moe: bool = False, family: str = "ours") -> list[tuple[str, str]]:
    """The pairs of features of a layout (:func:`layout_features`) that no row of the matrix tested on CPU (of
    ``family``) combines: ``[]`` when every two of its features ran together in some CPU test. The matrix lists
    combinations, not every layout, so this is the honest coarse answer to "has this layout been tested?": a pair
    listed here has not run together in any test the matrix names (``plan`` marks such layouts)."""
    tested = [
        layout_features(r.options(), _row_is_moe(r))
        for r in ROWS
        if r.family == family and r.refused is None and r.cpu_tests
    ]
    features = sorted(layout_features(options, moe))
    return [
        (a, b) for i, a in enumerate(features) for b in features[i + 1 :] if not any(a in t and b in t for t in tested)
    ]


# ------------------------------------------------------------------------------------------------- validation
def _parse(row: Row, **overrides: Any) -> tuple[argparse.Namespace, Any, Any]:
    """``lightning-4d measure``'s arguments, model config and validated layout for ``row`` (as ``measure`` checks
    them before it runs anything)."""
    from lightning_4d.planning.commands import command_parser, layout_from_args, load_model_config

    args = command_parser("measure").parse_args(row.argv(**overrides))
    cfg = load_model_config(args.model)
    pc, _ = layout_from_args(args, cfg)
    pc.validate_sequence(args.seq_length)
    pc.validate_float8_tokens(args.seq_length, args.micro_batch_size)
    pc.validate_microbatches(pc.microbatches)
    return args, cfg, pc


def _transformers_module(family: str, cfg: Any) -> Any:
    """A LightningModule holding a transformers model of ``cfg``'s sizes, built on the meta device."""
    import lightning as L
    import torch
    import transformers

    sizes = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_length,
    )

    class TransformersModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            with torch.device("meta"):
                if family == "hf-mixtral":
                    from lightning_4d.features.moe.hf_mixtral import mixtral_of

                    self.model = mixtral_of(cfg, sizes)
                else:
                    config = transformers.LlamaConfig(**sizes, intermediate_size=cfg.intermediate_size)
                    self.model = transformers.LlamaForCausalLM(config)

    return TransformersModule()


def validate_row(row: Row) -> None:
    """Run every check the project makes of ``row``'s layout before anything is allocated, in the order a run
    makes them: ``measure``'s argument and layout checks (``ParallelConfig``: sizes, model, sequence,
    micro-batches; before them the precision, :func:`~lightning_4d.config.check_training_precision`),
    ``FourDStrategy``'s constructor (compile, checkpoint format), Lightning's ``Trainer`` (the
    precision its ``ModelParallelStrategy`` accepts), the strategy's precision check
    (:func:`~lightning_4d.parallel.sharded_optimizer.validate_precision`, and float8's:
    :func:`~lightning_4d.parallel.float8.validate_float8`) and its check against the LightningModule
    (the model family's :meth:`validate`; a transformers family gets a model of the preset's sizes on the meta device).

    Raises:
        ValueError: the layout is refused.
    """
    import lightning as L

    from lightning_4d.config import check_training_precision
    from lightning_4d.measure import strategy_kwargs
    from lightning_4d.parallel.float8 import validate_float8
    from lightning_4d.parallel.parallelize import validate_against_module
    from lightning_4d.parallel.sharded_optimizer import validate_precision
    from lightning_4d.strategy import FourDStrategy

    # the precision first, as `lightning-4d fit` checks it before the Trainer exists (measure's --precision refuses
    # it while parsing, with the same message)
    check_training_precision(row.layout.get("precision", DEFAULTS["precision"]))
    args, cfg, pc = _parse(row)
    strategy = FourDStrategy(**strategy_kwargs(pc, args.compile), memory_check=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=pc.world_size,
        strategy=strategy,
        precision=args.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    validate_precision(args.precision, pc.zero_stage)
    validate_float8(pc.float8, args.precision)
    if row.family == "ours":
        from lightning_4d.tasks import CausalLMModule

        module = CausalLMModule(cfg)
    else:
        module = _transformers_module(row.family, cfg)
    validate_against_module(trainer.strategy.parallel_config, module)


# ------------------------------------------------------------------------------------------------- smoke run
def _checks_callback() -> Any:
    """A Lightning callback recording each decoder layer whose output dtype differs from its input's, and the
    training losses (the smoke run's checks)."""
    import lightning as L
    import torch

    class SmokeChecks(L.Callback):
        def __init__(self) -> None:
            self.dtype_changes: list[str] = []
            self.losses: list[float] = []
            self.layers = 0
            self._handles: list = []

        def _hook(self, name: str) -> Any:
            def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
                given = args[0] if args and torch.is_tensor(args[0]) else None
                if given is None:
                    given = next((v for v in kwargs.values() if torch.is_tensor(v) and v.is_floating_point()), None)
                out = output[0] if isinstance(output, (tuple, list)) else output
                if torch.is_tensor(given) and torch.is_tensor(out) and given.dtype != out.dtype:
                    change = f"{name} ({type(module).__name__}): {given.dtype} in, {out.dtype} out"
                    if change not in self.dtype_changes:
                        self.dtype_changes.append(change)

            return hook

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            for name, module in pl_module.named_modules():
                # FSDP2 swaps a layer's class for a subclass (FSDPTransformerBlock): match the class or a base
                if any(cls.__name__ in DECODER_LAYERS for cls in type(module).__mro__):
                    self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
            self.layers = len(self._handles)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if torch.is_tensor(loss):
                self.losses.append(float(loss.detach().float().cpu()))

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            for handle in self._handles:
                handle.remove()
            self._handles = []

    return SmokeChecks()


#: collectives whose first argument is written with data from other ranks (c10d's in-place ops)
_WRITES_FIRST_ARG = (
    "recv_",
    "recv_any_source_",
    "_allgather_base_",
    "allgather_",
    "allgather_into_tensor_coalesced_",
    "allgather_coalesced_",
    "_reduce_scatter_base_",
    "reduce_scatter_",
    "reduce_scatter_tensor_coalesced_",
    "alltoall_base_",
    "alltoall_",
    "gather_",
    "scatter_",
)
#: functional collectives that return a new tensor of data from other ranks
_RETURNS_RECEIVED = (
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
)


def defined_collectives() -> Any:
    """A ``TorchDispatchMode`` that zero-fills what the fake process group's collectives would have received.

    torch's fake process group completes every collective at once and writes nothing: a receive buffer, an
    all-gather's or a reduce-scatter's output stay uninitialized memory, which can hold NaN (measured: cp ring, pp
    and tp-overlap rows gave NaN losses on CPU). Filling those outputs with zeros right after each collective
    (the fake group's work is already complete) makes every value the rank computes defined, so the smoke run can
    check that the loss is finite; no tensor is allocated, so the measured memory is unchanged.

    The mode ignores compile internals (``ignore_compile_internals``): Dynamo skips every frame while a mode without
    it is entered (measured on torch 2.13 CPU: a function compiled under a plain mode compiled 0 graphs), so compile
    rows would run eagerly; with it the mode is off while Dynamo traces and sees the collectives the compiled graphs
    call when they run.
    """
    import torch
    from torch.utils._pytree import tree_leaves

    from lightning_4d.parallel._compat.dispatch import TorchDispatchMode

    class DefinedCollectives(TorchDispatchMode):
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True  # Dynamo compiles under it (a mode without it makes Dynamo skip every frame)

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            namespace, name = func.namespace, func.__name__.split(".")[0]
            targets: Any = None
            if namespace == "c10d" and name in _WRITES_FIRST_ARG and args:
                targets = args[0]
            elif namespace == "_c10d_functional" and name in _RETURNS_RECEIVED:
                targets = out
            if targets is not None:
                with torch.no_grad():
                    for t in tree_leaves(targets):
                        if torch.is_tensor(t):
                            t.zero_()
            return out

    return DefinedCollectives()


def _problems(checks: Any, device: str, peak: int, estimate: int, library: int) -> list[str]:
    """The failed checks of a smoke run (:func:`run_row`): ``checks`` is its :func:`_checks_callback` after the run,
    ``peak``, ``estimate`` and ``library`` its measured peak, estimate and CUDA library workspaces (bytes; the peak is
    compared on CUDA only, within :data:`PEAK_TOLERANCE`). Empty when every check passed."""
    problems = []
    if not checks.layers:
        problems.append("no decoder layer found to check the residual stream's dtype")
    if checks.dtype_changes:
        problems.append("decoder layers change the residual stream's dtype: " + "; ".join(checks.dtype_changes))
    if not checks.losses:
        problems.append("no training loss was returned")
    elif not all(math.isfinite(x) for x in checks.losses):
        problems.append(f"loss not finite: {checks.losses}")
    if device == "cuda" and peak and abs(peak - estimate - library) > PEAK_TOLERANCE * peak:
        problems.append(
            f"peak {peak:,} B is not within {PEAK_TOLERANCE:.0%} of the estimate {estimate:,} B + CUDA library "
            f"workspaces {library:,} B (ratio {(estimate + library) / peak:.3f})"
        )
    return problems


def run_row(
    row: Row,
    device: str = "cpu",
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    steps: int = 2,
) -> dict[str, Any]:
    """The smoke run of ``row``: rank ``worst`` of its layout trained ``steps`` steps in this process on torch's
    fake process group (:func:`lightning_4d.measure.measure_rank`), with the checks of the module docstring.

    Args:
        row: a row that is not refused.
        device: ``"cpu"`` or ``"cuda"``.
        seq_length, micro_batch_size: replace the row's (the CPU dry run's smaller sizes).
        steps: optimizer steps (2).

    Returns:
        ``{"status": "ok" | "failed" | "error" | "skipped", "error": text or None, "rank", "peak", "estimate",
        "cuda_library", "ratio": (estimate + cuda_library) / peak, "losses", "decoder_layers", "compiled_graphs",
        "seconds"}`` (``compiled_graphs``: Dynamo's graphs compiled in the run; a compile row that compiled none raises)
        (bytes; "failed": it ran and a check failed; "error": it raised; "skipped": ``row.smoke_skip``).

    Raises:
        ValueError: ``row`` is refused, or ``device`` is neither cpu nor cuda.
    """
    if row.refused is not None:
        raise ValueError(f"support row {row.id!r} is refused ({row.refused}); the smoke matrix runs the others.")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not valid: expected cpu or cuda.")
    if row.smoke_skip:
        return {"status": "skipped", "error": row.smoke_skip}
    overrides = {k: v for k, v in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size)) if v}
    t0 = time.time()
    result: dict[str, Any] = {"status": "error", "error": None}
    try:
        _smoke_run(row, device, steps, overrides, result)
    except Exception as err:  # noqa: BLE001 - recorded per row, the matrix goes on
        result["error"] = f"{type(err).__name__}: {err}"[:2000]
    finally:
        import gc

        gc.collect()
    result["seconds"] = round(time.time() - t0, 1)
    return result


def _smoke_run(row: Row, device: str, steps: int, overrides: dict[str, int], result: dict[str, Any]) -> None:
    """:func:`run_row`'s run of ``row`` (its sizes replaced by ``overrides``), its figures and verdict written into
    ``result`` as they come (what was measured stays there if a later check raises)."""
    from lightning_4d.measure import measure_rank, worst_rank
    from lightning_4d.planning.commands import workload_from_args

    args, cfg, pc = _parse(row, **overrides)
    b, s = args.micro_batch_size, args.seq_length
    work = workload_from_args(args, cfg)  # the row's document masking (--document-tokens) and MoE load
    rank = worst_rank(work, pc, device_type=device)
    checks = _checks_callback()
    with defined_collectives():
        out = measure_rank(work, pc, rank, steps=steps, device=device, compile=args.compile, callbacks=[checks])
    peak = out["measured"]["peak_allocated"]
    estimate = out["estimate"]["total"]
    library = out["measured"].get("cuda_library", 0) or 0
    result.update(
        rank=rank,
        seq_length=s,
        micro_batch_size=b,
        peak=peak,
        estimate=estimate,
        cuda_library=library,
        ratio=(estimate + library) / peak if peak else None,
        losses=checks.losses,
        decoder_layers=checks.layers,
        compiled_graphs=out["measured"]["compiled_graphs"],
    )
    problems = _problems(checks, device, peak, estimate, library)
    result.update(status="failed" if problems else "ok", error="; ".join(problems) or None)


def device_name(device: str) -> str:
    """The card's name (``torch.cuda.get_device_name()``) for ``cuda``, ``cpu`` for the CPU."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    return "cpu"


def run_smoke(
    rows: list[Row],
    device: str,
    out_dir: Path,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    budget_s: Optional[float] = None,
) -> Path:
    """Run :func:`run_row` for each of ``rows``, in their order, in this process and write
    ``smoke_<device name>_<date>.json`` into ``out_dir`` after every row (``{"device", "device_name", "date",
    "code", "seq_length", "micro_batch_size", "rows": {id: run_row's dict}}``; ``code``: which code ran them,
    :func:`lightning_4d.provenance.code_record`), so a run stopped from outside keeps every row it finished. Rows
    left when ``budget_s`` seconds have passed are recorded as skipped. On CPU the sizes default to
    :data:`CPU_SEQ_LENGTH` and :data:`CPU_MICRO_BATCH_SIZE`. Returns the file."""
    from lightning_4d.provenance import code_record

    if device == "cpu":
        seq_length = seq_length or CPU_SEQ_LENGTH
        micro_batch_size = micro_batch_size or CPU_MICRO_BATCH_SIZE
    code = code_record(device)
    name = code["card"]
    date = datetime.date.today().isoformat()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"smoke_{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_')}_{date}.json"
    if path.exists():  # a second run of the day (a later call, another commit): its own file
        path = path.with_name(f"{path.stem}_{code['time'][11:19].replace(':', '')}.json")
    record: dict[str, Any] = {
        "device": device,
        "device_name": name,
        "date": date,
        "code": code,
        "seq_length": seq_length,
        "micro_batch_size": micro_batch_size,
        "rows": {},
    }
    start = time.time()
    for row in rows:
        if budget_s is not None and time.time() - start > budget_s:
            result = {"status": "skipped", "error": f"out of time (budget {budget_s:.0f} s)"}
        else:
            result = run_row(row, device, seq_length, micro_batch_size)
        record["rows"][row.id] = result
        ratio = result.get("ratio")
        print(
            f"smoke {row.id}: {result['status']}"
            + (f" ({result['seconds']} s, estimate/peak {ratio:.3f})" if ratio else "")
            + (f": {result['error'][:300]}" if result.get("error") and result["status"] != "skipped" else ""),
            flush=True,
        )
        path.write_text(json.dumps(record, indent=1))
    record["seconds"] = round(time.time() - start, 1)
    path.write_text(json.dumps(record, indent=1))
    return path


# ------------------------------------------------------------------------------------------------- CUDA results
def cuda_results(results_dir: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """Per row id, its newest CUDA smoke result under ``results_dir`` (``smoke_*.json`` whose ``device`` is
    ``cuda``): ``{"card", "date", "time", "commit", "clean", "changed", "status", "error", ...}`` (``commit``
    ``None``: a result written before results recorded their code). CPU dry runs are not read."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(results_dir).glob("smoke_*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("device") != "cuda":
            continue
        code = data.get("code") or {}
        for row_id, result in data.get("rows", {}).items():
            if result.get("status") == "skipped":
                continue
            entry = {
                "card": data.get("device_name"),
                "date": data.get("date", ""),
                "time": code.get("time") or "",
                "commit": code.get("commit"),
                "clean": code.get("clean"),
                "changed": code.get("changed") or [],
                **result,
            }
            newest = found.get(row_id)
            if newest is None or (entry["date"], entry["time"]) >= (newest["date"], newest["time"]):
                found[row_id] = entry
    return found


#: how many changed files a row's CUDA cell names
CHANGED_SHOWN = 3


def cuda_state(row: Row, results: dict[str, dict[str, Any]], history: Optional[dict] = None) -> dict[str, Any]:
    """Where ``row`` stands on CUDA, from its newest result (:func:`cuda_results`) and the files it exercises
    (:meth:`Row.exercises`): ``{"kind", "text", "changed"}``. ``kind``:

    - ``refused``, ``not smoke-run`` (``row.smoke_skip``), ``not run`` (no CUDA result);
    - ``unrecorded``: a result written without its commit ("ran on <card>, <date> (<status>), commit not
      recorded": it claims nothing of the code now);
    - ``current``: run at a commit none of whose exercised files differ from this checkout (``git diff --name-only
      <commit>``, :func:`lightning_4d.provenance.changed_files`), its tree clean in those files;
    - ``changed``: some of them differ (``changed`` lists them; the text says *changed since*);
    - ``unknown``: git cannot say (no git history here, or the commit is not in it).

    ``history``: a cache of :func:`~lightning_4d.provenance.changed_files` per commit, shared across rows.
    """
    from lightning_4d import provenance

    if row.refused is not None:
        return {"kind": "refused", "text": "-", "changed": []}
    got = results.get(row.id)
    if got is None:
        if row.smoke_skip:
            return {"kind": "not smoke-run", "text": "not smoke-run: " + row.smoke_skip, "changed": []}
        return {"kind": "not run", "text": "not run on CUDA yet", "changed": []}
    status = got.get("status")
    error = f": {(got.get('error') or '')[:200]}" if status != "ok" else ""
    where = f"on {got['card']}, {got['date']}"
    commit = got.get("commit")
    history = {} if history is None else history
    if not commit:
        return {"kind": "unrecorded", "text": _unrecorded_text(row, got, where, error, history), "changed": []}
    if commit not in history:
        history[commit] = provenance.changed_files(commit)
    since = history[commit]
    files = row.exercises()
    dirty = provenance.touched(got.get("changed") or [], files) if got.get("clean") is False else []
    at = f"{status} at {commit[:10]}" + (" with uncommitted changes" if dirty else "")
    if since is None:
        why = "no git history here" if not provenance.git_available() else "the commit is not in this clone's history"
        return {"kind": "unknown", "text": f"{at} {where}; changed since: unknown ({why}){error}", "changed": []}
    changed = sorted(set(provenance.touched(since, files)) | set(dirty))
    if not changed:
        return {"kind": "current", "text": f"{at} {where}{error}", "changed": []}
    shown = ", ".join(f.removeprefix("lightning_4d/") for f in changed[:CHANGED_SHOWN])
    more = f" and {len(changed) - CHANGED_SHOWN} more" if len(changed) > CHANGED_SHOWN else ""
    return {"kind": "changed", "text": f"{at} {where}; *changed since*: {shown}{more}{error}", "changed": changed}


def _unrecorded_text(row: Row, got: dict[str, Any], where: str, error: str, history: dict) -> str:
    """The CUDA cell of a result written without its commit: where it ran, its status and ``error``, and whether a
    file the row exercises changed on or after the result's date (:func:`~lightning_4d.provenance.changed_since_date`;
    not listed, so the page does not change with every later edit): a failure there may have been fixed since, an ok
    may no longer hold."""
    from lightning_4d import provenance

    key = f"date {got['date']}"
    if key not in history:
        history[key] = provenance.changed_since_date(got["date"]) if got["date"] else None
    since = history[key]
    note = ""
    if since is not None and provenance.touched(since, row.exercises()):
        note = "; *code it exercises changed on or after that date*"
    return f"ran {where} ({got.get('status')}), commit not recorded{error}{note}"


def _cuda_cell(row: Row, results: dict[str, dict[str, Any]], history: Optional[dict] = None) -> str:
    return cuda_state(row, results, history)["text"]


#: the order the smoke rows are run in on a GPU: never run first, then failed, then run at code that changed since
#: (or whose commit is not recorded or cannot be checked), then those ok at their current code
PLAN_ORDER = {"not run": 0, "failed": 1, "changed": 2, "unrecorded": 2, "unknown": 2, "current": 3}
#: why a row has its place in the plan, by the same keys
PLAN_REASONS = {
    "not run": "never run on CUDA",
    "failed": "failed on CUDA",
    "changed": "changed since its CUDA run",
    "unrecorded": "its CUDA run recorded no commit",
    "unknown": "whether it changed since its CUDA run is unknown",
    "current": "ok on CUDA at its current code",
}


def smoke_plan(results_dir: Path = RESULTS) -> list[tuple[Row, str]]:
    """The rows the smoke matrix runs on a GPU (every row not refused and not ``smoke_skip``), in the order a
    time-limited run takes them (:data:`PLAN_ORDER`; the matrix's order within each group), each with its reason
    (:data:`PLAN_REASONS`): the claims nothing backs come first, the rows ok at their current code last."""
    results = cuda_results(results_dir)
    history: dict = {}
    planned = []
    for index, row in enumerate(ROWS):
        if row.refused is not None or row.smoke_skip:
            continue
        kind = cuda_state(row, results, history)["kind"]
        if kind == "current" and results[row.id].get("status") != "ok":
            kind = "failed"
        planned.append((PLAN_ORDER[kind], index, row, PLAN_REASONS[kind]))
    return [(row, reason) for _, _, row, reason in sorted(planned, key=lambda x: x[:2])]


def _layout_text(row: Row) -> str:
    """The row's options that differ from :data:`DEFAULTS`, as ``measure`` flags."""
    return " ".join(measure_flags(row.layout)) or "(defaults)"


def summary(results: Optional[dict] = None, history: Optional[dict] = None) -> dict[str, int]:
    """Row counts: total, refused, tested on CPU, not tested on CPU, smoke-run rows; on CUDA (:func:`cuda_state`):
    ok at their current code, ok before their code changed, ran without a recorded commit."""
    results = cuda_results() if results is None else results
    history = {} if history is None else history
    states = [(r, cuda_state(r, results, history)["kind"]) for r in ROWS if r.refused is None]

    def ok(kind: str) -> int:
        return sum(k == kind and results[r.id].get("status") == "ok" for r, k in states)

    return {
        "rows": len(ROWS),
        "refused": sum(r.refused is not None for r in ROWS),
        "tested on CPU": sum(r.status == "tested on CPU" for r in ROWS),
        "not tested on CPU": sum(r.status == "not tested on CPU" for r in ROWS),
        "smoke-run": sum(r.refused is None and not r.smoke_skip for r in ROWS),
        "ok on CUDA": ok("current"),
        "ok on CUDA, changed since": ok("changed") + ok("unknown"),
        "ran on CUDA, commit not recorded": sum(k == "unrecorded" for _, k in states),
    }


def to_json(results_dir: Path = RESULTS) -> dict[str, Any]:
    """The matrix as one JSON-able object (``lightning-4d support --json``)."""
    results = cuda_results(results_dir)
    history: dict = {}
    return {
        "defaults": DEFAULTS,
        "summary": summary(results, history),
        "rows": [
            {
                "id": r.id,
                "description": r.description,
                "family": r.family,
                "layout": r.layout,
                "command": r.command(),
                "status": r.status,
                "refused": r.refused,
                "error_type": r.error_type if r.refused is not None else None,
                "cpu_tests": list(r.cpu_tests),
                "smoke_skip": r.smoke_skip,
                "cuda": _cuda_cell(r, results, history),
                "cuda_state": cuda_state(r, results, history)["kind"],
                "exercises": list(r.exercises()),
            }
            for r in ROWS
        ],
    }


def _status_text(row: Row) -> str:
    if row.refused is not None:
        return f"refused ({row.error_type}): {row.refused}"
    return row.status


def _test_names(row: Row) -> list[str]:
    return [t.replace("tests/", "").replace(".py::", "::") for t in row.cpu_tests]


def _no_results_note(results_dir: Path) -> list[str]:
    """A note for a page made where ``results_dir`` does not exist (an installed package carries no results)."""
    if Path(results_dir).is_dir():
        return []
    return [
        f"No results folder at {results_dir} (an installed package carries none): the CUDA column cannot tell what "
        "ran here; the repository's docs/support.md shows it.",
        "",
    ]


def markdown(results_dir: Path = RESULTS) -> str:
    """The matrix as a Markdown table (``lightning-4d support --markdown``; docs/support.md)."""
    results = cuda_results(results_dir)
    history: dict = {}
    counts = summary(results, history)
    defaults = " ".join(measure_flags(DEFAULTS))
    lines = [
        f"{counts['rows']} rows: {counts['refused']} refused, {counts['tested on CPU']} tested on CPU, "
        f"{counts['not tested on CPU']} not tested on CPU; {counts['smoke-run']} run by the smoke matrix; on CUDA "
        f"{counts['ok on CUDA']} ok at their current code, {counts['ok on CUDA, changed since']} ok before their "
        f"code changed, {counts['ran on CUDA, commit not recorded']} ran without a recorded commit. Every row's "
        f"layout is `lightning-4d measure {defaults}` with the options shown.",
        "",
        *_no_results_note(results_dir),
        "| id | combination | family | options | status | CPU tests | CUDA |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in ROWS:
        status = _status_text(row).replace("|", "\\|")
        tests = "<br>".join(f"`{t}`" for t in _test_names(row)) or "-"
        cuda = _cuda_cell(row, results, history)
        lines.append(
            f"| `{row.id}` | {row.description} | {FAMILIES[row.family]} | `{_layout_text(row)}` | {status} | "
            f"{tests} | {cuda.replace('|', chr(92) + '|')} |"
        )
    return "\n".join(lines) + "\n"


def print_table(results_dir: Path = RESULTS) -> None:
    """The matrix as a rich table (``lightning-4d support``)."""
    from rich.console import Console
    from rich.table import Table

    results = cuda_results(results_dir)
    history: dict = {}
    counts = summary(results, history)
    table = Table(title=f"lightning_4d support matrix: {', '.join(f'{v} {k}' for k, v in counts.items())}")
    for col in ("id", "family", "options", "status", "CPU tests", "CUDA"):
        table.add_column(col, overflow="fold")
    for row in ROWS:
        table.add_row(
            row.id,
            row.family,
            _layout_text(row),
            _status_text(row),
            "\n".join(_test_names(row)) or "-",
            _cuda_cell(row, results, history),
        )
    console = Console(width=max(Console().width, 150))
    console.print(table)
    console.print(f"Defaults of every row: lightning-4d measure {' '.join(measure_flags(DEFAULTS))}")


def main(argv: Optional[list[str]] = None) -> int:
    """``lightning-4d support`` (also ``python -m lightning_4d.support``): print the matrix, or with ``--smoke``
    run the smoke matrix and write its JSON. Returns the exit code (0; 1 when a smoke row failed or raised; 2 bad
    input)."""
    p = argparse.ArgumentParser(prog="lightning-4d support", description=__doc__.split("\n")[0])
    p.add_argument("--markdown", action="store_true", help="print the matrix as Markdown (docs/support.md)")
    p.add_argument("--json", action="store_true", help="print the matrix as one JSON object")
    p.add_argument("--results", default=str(RESULTS), help="folder of smoke_*.json results (benchmarks/results)")
    p.add_argument("--smoke", action="store_true", help="run the smoke matrix (every row not refused)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="--smoke: where (cpu: a dry run)")
    p.add_argument("--out", default=str(RESULTS), help="--smoke: the folder to write smoke_<device>_<date>.json to")
    p.add_argument("--rows", default=None, help="--smoke: comma-separated row ids (default: every row not refused)")
    p.add_argument("--seq-length", type=int, default=None, help=f"--smoke: override s (cpu: {CPU_SEQ_LENGTH})")
    p.add_argument("--micro-batch-size", type=int, default=None, help="--smoke: override b (cpu: 1)")
    p.add_argument("--budget-s", type=float, default=None, help="--smoke: seconds after which rows are skipped")
    p.add_argument("--plan", action="store_true", help="print the order a GPU runs the smoke rows in, and why")
    args = p.parse_args(argv)
    if args.plan:
        for row, reason in smoke_plan(Path(args.results)):
            print(f"{row.id}\t{reason}")
        return 0
    if args.smoke:
        try:
            rows = [row_by_id(x) for x in args.rows.split(",")] if args.rows else smoke_rows()
            refused = [r.id for r in rows if r.refused is not None]
            if refused:
                raise ValueError(f"--rows {','.join(refused)}: refused rows are not smoke-run.")
        except ValueError as err:
            print(f"lightning-4d support: error: {err}", file=sys.stderr)
            return 2
        path = run_smoke(rows, args.device, Path(args.out), args.seq_length, args.micro_batch_size, args.budget_s)
        data = json.loads(path.read_text())
        bad = [k for k, v in data["rows"].items() if v["status"] in ("failed", "error")]
        print(
            f"wrote {path} ({data['seconds']} s); {len(bad)} of {len(rows)} rows failed{': ' if bad else ''}"
            + ", ".join(bad)
        )
        return 1 if bad else 0
    if args.json:
        print(json.dumps(to_json(Path(args.results))))
    elif args.markdown:
        print(markdown(Path(args.results)), end="")
    else:
        print_table(Path(args.results))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
