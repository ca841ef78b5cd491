"""What ``lightning-4d estimate`` and ``lightning-4d plan`` print without ``--json``: the estimate's table of
memory components with its lines on the peak phase and host memory (:func:`print_estimate`), and the plan's table of
ranked layouts with its lines on optimizer offload, checkpoint interval, HSDP and untested feature pairs
(:func:`print_plan`). Both read the dictionary :mod:`lightning_4d.planning.commands` computes (the one ``--json``
prints); neither computes anything.
"""

from __future__ import annotations

from typing import Any

from lightning_4d.features import moe, tensor_parallel
from lightning_4d.planning.hardware import GIB


def print_estimate(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    lay = out["layout"]
    title = (
        f"{out['formula']} estimate per GPU: tp={lay['tp']} pp={lay['pp']} cp={lay['cp']} dp={lay['dp']} "
        + moe.estimate_title(lay)
        + f"ZeRO {lay['zero_stage']} "
        + (f"HSDP={lay['data_parallel_replicate_size']}x " if lay["data_parallel_replicate_size"] > 1 else "")
        + f"b={lay['micro_batch_size']} s={lay['seq_length']} {lay['precision']} "
        f"checkpointing={lay['activation_checkpointing']}"
    )
    table = Table(title=title)
    table.add_column("component")
    table.add_column("GiB", justify="right")
    table.add_column("bytes", justify="right")
    keys = (
        ("parameters", "gradients", "optimizer_states", "activations", "logits", "buffers", "overhead")
        if out["formula"] == "lightning_4d"
        else ("model_states", "activations")
    )
    for k in keys:
        table.add_row(k, f"{out[k] / GIB:.2f}", f"{int(out[k]):,}")
    table.add_row("total (peak)", f"{out['total_gib']:.2f}", f"{int(out['total']):,}", style="bold")
    console = Console(width=max(Console().width, 150))
    console.print(table)
    if out["pipeline_layer_split_proposed"]:
        console.print(
            f"pipeline_layer_split={lay['pipeline_layer_split']}: the planner's split ({out['num_layers']} "
            f"layers do not divide into {len(lay['pipeline_layer_split'])} equal stages; the first and last "
            "stages, which also hold the embedding and the LM head, get the fewer); --pipeline-layer-split "
            "overrides it.",
            soft_wrap=True,
            markup=False,
        )
    if out["formula"] == "lightning_4d":
        console.print(
            f"peak phase: {out['peak_phase']} (total = parameters + optimizer_states + overhead + the "
            "largest phase; see docs/memory.md)"
        )
        _print_host_memory(console, out)
    verdict = "fits" if out["fits"] else "does NOT fit"
    console.print(
        f"{out['total_gib']:.2f} GiB = {100 * out['fraction']:.1f}% of {out['gpu']} "
        f"({out['gpu_memory'] / GIB:.1f} GiB): {verdict} within the {100 * out['budget']:.0f}% budget."
    )
    _print_hsdp_proposal(console, out)
    if "suggestions" in out:
        from lightning_4d.planning.planner import fitting_layout_lines

        world_size = lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"]
        for line in fitting_layout_lines([(s["line"], s["total"]) for s in out["suggestions"]], world_size):
            console.print(line, soft_wrap=True, markup=False, highlight=False)


def _print_hsdp_proposal(console: Any, out: dict[str, Any]) -> None:
    """``estimate``'s HSDP line (``out["hsdp_proposal"]``: the replica count, both predicted steps, its memory)."""
    hsdp, lay = out.get("hsdp_proposal"), out["layout"]
    if not hsdp:
        return
    r = hsdp["data_parallel_replicate_size"]
    shard = lay["dp"] * lay["cp"] // r
    console.print(
        f"HSDP: --dp-replicate {r} (data_parallel_replicate_size={r}: {r} replicas of a ZeRO shard group of "
        f"{shard} ranks) is predicted faster: {hsdp['step_time']:.3f} s per step against "
        f"{hsdp['flat_zero_step_time']:.3f} s with flat ZeRO {lay['zero_stage']} over all dp*cp ranks, "
        f"{hsdp['total_gib']:.2f} GiB (the step-time model of docs/step_time.md, not measured).",
        soft_wrap=True,
        markup=False,
    )


def _print_host_memory(console: Any, out: dict[str, Any]) -> None:
    """``estimate``'s lines on host memory: the offloaded activations, the offloaded model states per rank and the
    host memory per node against ``--host-memory``."""
    lay = out["layout"]
    host = out["details"].get("host_offloaded_activations", 0)
    if lay.get("activation_offload_layers"):
        console.print(
            f"host memory: {host / GIB:.2f} GiB of offloaded activations ({lay['activation_offload_layers']} "
            "layers per pipeline stage), not in the total above"
        )
    if lay.get("optimizer_offload"):
        console.print(
            f"host memory: {out['details']['host_model_states'] / GIB:.2f} GiB of model states per rank "
            "(optimizer_offload: docs/offload.md), not in the total above"
        )
    if out["host"]:
        verdict = "fits" if out["fits_host"] else "does NOT fit"
        console.print(
            f"host memory per node: {out['host_per_node'] / GIB:.2f} GiB ({out['host'] / GIB:.2f} GiB per rank x "
            f"{out['host_per_node'] // out['host']} ranks) of {out['host_memory'] / GIB:.1f} GiB "
            f"(--host-memory): {verdict} within the {100 * out['budget']:.0f}% budget."
        )


#: The columns of ``plan``'s table (:func:`_plan_cells`).
_PLAN_COLUMNS = (
    "#",
    "tp",
    "pp",
    "cp",
    "dp",
    "ep",
    "b",
    "m",
    "ZeRO",
    "ckpt",
    "sp",
    "schedule",
    "GiB",
    "mem %",
    "step s",
    "tokens/s",
    "MFU",
    "bubble",
    "comm",
    "recomp",
    "tested",
)


def print_plan(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{out['model']} on {out['num_gpus']} x {out['gpu']}, s={out['seq_length']}, global batch "
        f"{out['global_batch_size']}: layouts within {100 * out['budget']:.0f}% of memory, fastest "
        "predicted first"
    )
    for col in _PLAN_COLUMNS:
        table.add_column(col, justify="right")
    for i, c in enumerate(out["layouts"], 1):
        table.add_row(*_plan_cells(i, c))
    console = Console(width=max(Console().width, 180))
    console.print(table)
    if not out["layouts"]:
        console.print("No layout fits: use more GPUs, a shorter sequence, or a larger GPU.")
    _print_optimizer_offload(console, out)
    for i, c in enumerate(out["layouts"], 1):
        if c["pipeline_layer_split"]:
            console.print(f"#{i}: pipeline_layer_split={c['pipeline_layer_split']}")
            break
    _print_plan_notes(console, out)


def _print_optimizer_offload(console: Any, out: dict[str, Any]) -> None:
    """Under ``plan``'s table, when its layouts keep the optimizer states on the host (no layout fits without): say
    so, and the host memory per node each needs."""
    offloaded = [(i, c) for i, c in enumerate(out["layouts"], 1) if c.get("optimizer_offload")]
    if not offloaded:
        return
    needs = ", ".join(f"#{i} {c['host_memory'] / GIB:,.0f} GiB" for i, c in offloaded)
    console.print(
        "No layout fits with the optimizer states on the GPUs: these keep them on the host "
        f"(FourDStrategy(optimizer_offload=True): fp32 masters and Adam's m, v in host memory, the step on the CPU; "
        f"docs/offload.md). Host memory per node ({out['gpus_per_node']} GPUs): {needs}"
        + (
            f" (within {100 * out['budget']:.0f}% of --host-memory)."
            if out.get("host_memory")
            else "; check it against your nodes with --host-memory."
        ),
        soft_wrap=True,
        markup=False,
        highlight=False,
    )


def _plan_cells(i: int, c: dict[str, Any]) -> list[str]:
    """The cells of row ``i`` (layout ``c``) of ``plan``'s table, one per column of :data:`_PLAN_COLUMNS`."""
    schedule = (
        "-"
        if c["pp"] == 1
        else (
            c["pipeline_schedule"]
            + (f" v{c['virtual_pipeline_stages']}" if c["pipeline_schedule"] == "interleaved_1f1b" else "")
        )
    )
    cp = str(c["cp"]) + ("" if c["cp"] == 1 else f" {c['context_parallel_method']}")
    return [
        str(i),
        str(c["tp"]),
        str(c["pp"]),
        cp,
        str(c["dp"]),
        moe.plan_cell(c),
        str(c["micro_batch_size"]),
        str(c["num_microbatches"]),
        str(c["zero_stage"])
        + (f" HSDP×{c['data_parallel_replicate_size']}" if c["data_parallel_replicate_size"] > 1 else "")
        + (" offload" if c.get("optimizer_offload") else ""),
        c["activation_checkpointing"],
        tensor_parallel.plan_cell(c),
        schedule,
        f"{c['memory_gib']:.1f}",
        f"{100 * c['fraction']:.0f}",
        f"{c['step_time']:.3f}",
        f"{c['tokens_per_sec']:,.0f}",
        f"{100 * c['mfu']:.1f}%",
        f"{100 * c['bubble_fraction']:.0f}%",
        f"{100 * c['communication_fraction']:.0f}%",
        f"{100 * c['recompute_fraction']:.0f}%",
        "-" if c["untested_pairs"] is None else ("no*" if c["untested_pairs"] else "yes"),
    ]


def _blocking_words(c: dict[str, Any]) -> str:
    """What a save of the plan row ``c`` blocks: the write, or with ``--async-checkpoint`` the staging (and the
    write it overlaps)."""
    if c["checkpoint_blocking_s"] == c["checkpoint_write_s"]:
        return f"write {c['checkpoint_write_s']:.3g} s"
    return f"blocking {c['checkpoint_blocking_s']:.3g} s (async; write {c['checkpoint_write_s']:.3g} s)"


def _print_plan_notes(console: Any, out: dict[str, Any]) -> None:
    """The lines under ``plan``'s table: the first pick's checkpoint interval, the untested feature pairs, the plot
    and what the columns mean."""
    if out["layouts"]:
        c = out["layouts"][0]
        console.print(
            f"#1: checkpoint every {c['checkpoint_interval_steps']:,} steps "
            f"({c['checkpoint_interval_s'] / 60:.0f}"
            f" min; Young: sqrt(2 x {_blocking_words(c)} x job MTBF "
            f"{c['job_mtbf_s'] / 3600:.1f} h)), ~{100 * c['checkpoint_lost_fraction']:.1f}% of the time "
            f"lost to writing and redone work (at {out['checkpoint_write_gbps']:g} GB/s per node, "
            f"{out['mtbf_gpu_hours']:,.0f} GPU-hours MTBF per GPU)."
        )
    hybrid = next(((i, c) for i, c in enumerate(out["layouts"], 1) if c["flat_zero_step_time"]), None)
    if hybrid:
        i, c = hybrid
        r, flat, shard = (
            c["data_parallel_replicate_size"],
            c["flat_zero_step_time"],
            c["dp"] * c["cp"] // c["data_parallel_replicate_size"],
        )
        gpus = shard * c["tp"]
        where = "inside a node" if gpus <= out["gpus_per_node"] else f"{gpus} GPUs"
        gain = flat / c["step_time"] - 1
        console.print(
            f"ZeRO HSDP×{r}: hybrid sharding, {r} replicas of a ZeRO shard group of {shard} ranks ({where}; "
            f"data_parallel_replicate_size={r}); #{i} with flat ZeRO over all dp*cp ranks: {flat:.3f} s predicted, "
            f"HSDP {abs(100 * gain):.1f}% {'faster' if gain >= 0 else 'slower'}.",
            soft_wrap=True,
        )
    untested = [(i, c["untested_pairs"]) for i, c in enumerate(out["layouts"], 1) if c.get("untested_pairs")]
    if untested:
        first, pairs = untested[0]
        console.print(
            f"* tested: no = the layout combines features that no CPU test of the support matrix runs together "
            f"(docs/support.md; `lightning-4d support`), e.g. #{first}: "
            + ", ".join(f"{a} + {b}" for a, b in pairs)
            + " (all pairs: --json, untested_pairs).",
            soft_wrap=True,
        )
    if out.get("document_tokens") and out["layouts"]:
        console.print(
            f"Document masking (documents of {out['document_tokens']:,} tokens): the step time charges the attention "
            "FLOPs the masked kernels compute, masked tiles included "
            f"(#1: {out['layouts'][0]['attention_work']:.2f}x causal attention's; JSON: attention_work); MFU counts "
            "only the documents' own attention FLOPs (sum of n^2 over the documents, the full-square convention).",
            soft_wrap=True,
        )
    if out.get("plot"):
        console.print(f"plot: {out['plot']}")
    console.print(
        "bubble, comm (exposed communication) and recomp (recomputation): fractions of the predicted step. "
        "Step time, tokens/s and MFU are predicted by the step-time model of docs/step_time.md (calibrated on "
        "published runs), not measured."
    )
