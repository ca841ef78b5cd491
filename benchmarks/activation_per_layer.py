"""Bytes one Llama 3 8B layer saves for backward per token, by activation checkpointing mode and tp.

``python benchmarks/activation_per_layer.py`` prints the table of docs/memory.md ("Activation checkpointing"):
``saved_activation_bytes(...)["layers"] / (num_layers · seq_length)`` at bf16-true, micro-batch 1, s = 8192, sp on
when tp > 1. A model figure (no training runs): instant on any machine.
"""

from __future__ import annotations

from lightning_4d.config import ParallelConfig
from lightning_4d.models import LlamaConfig
from lightning_4d.planning.model import saved_activation_bytes
from lightning_4d.planning.workload import Workload


def main() -> None:
    mc = LlamaConfig.from_preset("llama3-8b")
    s = 8192
    print("| tp (sp) | none | selective | full | selective / none |")
    print("|---|---:|---:|---:|---:|")
    for tp in (1, 2, 8):
        row = {}
        for mode in ("none", "selective", "full"):
            pc = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=1, activation_checkpointing=mode)
            row[mode] = saved_activation_bytes(Workload(mc, 1, s, "bf16-true"), pc)["layers"] / (mc.num_layers * s)
        print(
            f"| {tp} ({'on' if tp > 1 else 'off'}) | {row['none']:,.0f} | {row['selective']:,.0f} | "
            f"{row['full']:,.0f} | {row['selective'] / row['none']:.0%} |"
        )


if __name__ == "__main__":
    main()
