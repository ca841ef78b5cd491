"""GPU presets for the memory check and the planner, and the measured overhead allowance.

Each preset gives the device memory (bytes), the dense bf16 peak (FLOP/s, without sparsity), the per-GPU
bandwidth inside a node (NVLink, bytes/s, one direction) and across nodes (InfiniBand / RoCE NIC, bytes/s, one
direction) and the memory (HBM / GDDR) bandwidth (bytes/s). Sources: NVIDIA A100 datasheet (2021: 312 TFLOP/s bf16,
NVLink 3 600 GB/s bidirectional = 300 GB/s per direction, HDR InfiniBand 200 Gb/s = 25 GB/s per GPU, 1,555 GB/s
(40GB) and 2,039 GB/s (80GB SXM) memory bandwidth), NVIDIA H100 datasheet (2023: SXM 989 TFLOP/s bf16 dense,
NVLink 4 900 GB/s bidirectional = 450 GB/s per direction, NDR 400 Gb/s = 50 GB/s per GPU, 3.35 TB/s HBM3; H100 NVL
94 GB, 3.9 TB/s), the H100 96GB HBM2e of Meta's Grand Teton hosts that torchtitan's published runs used (torchtitan
``docs/performance.md``: 96 GB, 2.4 TB/s, SXM compute and NVLink, run at a 500 W power limit of the 700 W TDP),
NVIDIA H200 datasheet (2024: 141 GB HBM3e,
4.8 TB/s, same compute and NVLink as H100 SXM), NVIDIA L40S datasheet (2023: 48 GB, 362 TFLOP/s bf16 dense,
864 GB/s, no NVLink: PCIe Gen4 x16, 64 GB/s bidirectional = 32 GB/s per direction), NVIDIA A10 datasheet (2021:
24 GB, 125 TFLOP/s bf16 dense, 600 GB/s, PCIe Gen4 x16). The NIC of the two PCIe cards is not part of the card:
25 GB/s per GPU (as A100's HDR) is assumed. The host link (activation offload's copies): PCIe Gen5 x16 on H100 and
H200 (datasheets: 128 GB/s bidirectional = 64 GB/s per direction), PCIe Gen4 x16 on the others (64 GB/s
bidirectional = 32 GB/s per direction).

This is the one table of GPU figures: :func:`peak_flops_of_device` reads the dense bf16 peak of a CUDA device name
from it (for the MFU the task logs).

The *overhead allowance* (CUDA context, NCCL buffers and allocator fragmentation: what ``nvidia-smi`` shows beyond
``torch.cuda.max_memory_allocated``) is read from ``overhead.json`` next to this file, which
``benchmarks/memory_accuracy.py`` writes on a CUDA machine with the GPU's name. A GPU without a measured entry gets
the ``"default"`` entry, which says in its ``source`` field that it is not a measurement.

Pure Python: no torch import.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

__all__ = [
    "GPU_PRESETS",
    "GpuSpec",
    "OverheadAllowance",
    "gpu_spec",
    "overhead_allowance",
    "parse_bytes",
    "peak_flops_of_device",
]

GIB = 2**30
GB = 10**9
OVERHEAD_FILE = Path(__file__).with_name("overhead.json")


@dataclass(frozen=True)
class GpuSpec:
    """One GPU kind: ``memory`` bytes, ``peak_flops`` dense bf16 FLOP/s, ``intra_node_bandwidth`` and
    ``inter_node_bandwidth`` in bytes/s per GPU and direction, ``memory_bandwidth`` bytes/s of its device memory,
    ``compute_fraction`` the fraction of ``peak_flops`` its tensor cores can sustain under the power limit it runs
    at: 1 at the datasheet TDP; below it, the ratio of the limit to the TDP (an assumption of the step-time model:
    large GEMMs are power-bound on H100, so their throughput follows the power limit). ``peak_flops`` stays the
    datasheet figure, the MFU denominator. ``host_bandwidth``: bytes/s per direction of the link to host memory
    (PCIe)."""

    name: str
    memory: int
    peak_flops: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    memory_bandwidth: float
    compute_fraction: float = 1.0
    host_bandwidth: float = 32e9


GPU_PRESETS: dict[str, GpuSpec] = {
    "A100-40GB": GpuSpec("A100-40GB", 40 * GIB, 312e12, 300e9, 25e9, 1555e9),
    "A100-80GB": GpuSpec("A100-80GB", 80 * GIB, 312e12, 300e9, 25e9, 2039e9),
    "H100-80GB": GpuSpec("H100-80GB", 80 * GIB, 989e12, 450e9, 50e9, 3350e9, host_bandwidth=64e9),
    "H100-94GB": GpuSpec("H100-94GB", 94 * GB, 989e12, 450e9, 50e9, 3900e9, host_bandwidth=64e9),
    "H100-96GB": GpuSpec("H100-96GB", 96 * GB, 989e12, 450e9, 50e9, 2400e9, 500 / 700, 64e9),
    "H200": GpuSpec("H200", 141 * GB, 989e12, 450e9, 50e9, 4800e9, host_bandwidth=64e9),
    "L40S": GpuSpec("L40S", 48 * GIB, 362e12, 32e9, 25e9, 864e9),
    "A10": GpuSpec("A10", 24 * GIB, 125e12, 32e9, 25e9, 600e9),
}

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def physical_memory() -> int:
    """Bytes of physical memory of this machine (``sysconf``: pages x page size): the default host memory per node
    of the pre-fit check (:class:`~lightning_4d.memory_check.MemoryEstimatorCallback`) and of ``lightning-4d
    estimate|plan --host-memory``."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_bytes(value: Union[int, float, str]) -> int:
    """Bytes from ``80GiB`` (2^30), ``94GB`` (10^9), ``512MiB``, ``"85899345920"`` or a number of bytes.

    Raises:
        ValueError: an unparsable string, an unknown unit, or a value that is not positive.
    """
    if isinstance(value, bool):
        raise ValueError(f"device memory {value!r} is not valid: expected bytes or a size such as '80GiB' or '94GB'.")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"device memory {value!r} is not valid: expected bytes or a number with one of the units "
                f"{sorted(u for u in _UNITS if u)} (e.g. '80GiB', '94GB')."
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    result = int(number * _UNITS[unit])
    if result <= 0:
        raise ValueError(f"device memory {value!r} is not valid: it must be positive.")
    return result


def gpu_spec(
    name_or_memory: Union[str, int, float],
    peak_flops: Optional[float] = None,
    intra_node_bandwidth: Optional[float] = None,
    inter_node_bandwidth: Optional[float] = None,
    memory_bandwidth: Optional[float] = None,
) -> GpuSpec:
    """A preset by name (case-insensitive: ``"h100-80gb"``), or a custom GPU from a memory size (``"64GiB"``) whose
    missing figures default to the H100-80GB preset's.

    Raises:
        ValueError: neither a preset name nor a memory size (the message lists the presets).
    """
    if isinstance(name_or_memory, str):
        for key, spec in GPU_PRESETS.items():
            if key.lower() == name_or_memory.strip().lower():
                return spec
    try:
        memory = parse_bytes(name_or_memory)
    except ValueError as err:
        reason = " (a memory size must be positive)" if "positive" in str(err) else ""
        raise ValueError(
            f"GPU {name_or_memory!r} is not valid{reason}: expected a preset ({', '.join(GPU_PRESETS)}) or a memory "
            "size such as '80GiB' (a custom GPU)."
        ) from None
    base = GPU_PRESETS["H100-80GB"]
    return GpuSpec(
        f"custom-{memory / GIB:.4g}GiB",
        memory,
        peak_flops if peak_flops is not None else base.peak_flops,
        intra_node_bandwidth if intra_node_bandwidth is not None else base.intra_node_bandwidth,
        inter_node_bandwidth if inter_node_bandwidth is not None else base.inter_node_bandwidth,
        memory_bandwidth if memory_bandwidth is not None else base.memory_bandwidth,
        host_bandwidth=base.host_bandwidth,
    )


def peak_flops_of_device(device_name: str) -> Optional[float]:
    """The dense bf16 peak (FLOP/s) of a CUDA device name such as ``torch.cuda.get_device_name()``'s
    ``"NVIDIA H100 80GB HBM3"`` or ``"NVIDIA A100-SXM4-40GB"``, from :data:`GPU_PRESETS`; ``None`` for a GPU the
    table does not have.

    A preset's family is its name up to the first ``-`` (``"H100"``, ``"A100"``, ``"A10"``, ...); it matches when it
    appears in ``device_name`` as a word of its own (``"A10"`` does not match ``"A100"``, nor ``"H200"`` ``"GH200"``),
    the longest family first. Every preset of one family has the same peak (H100 PCIe, whose peak is lower, is
    counted as the SXM part, as the table's H100 presets are).
    """
    families: dict[str, float] = {}
    for key, spec in GPU_PRESETS.items():
        families.setdefault(key.split("-")[0].lower(), spec.peak_flops)
    name = device_name.lower()
    for family in sorted(families, key=len, reverse=True):
        if re.search(rf"(?<![a-z0-9]){re.escape(family)}(?![a-z0-9])", name):
            return families[family]
    return None


@dataclass(frozen=True)
class OverheadAllowance:
    """Memory a training process uses beyond PyTorch's allocated tensors.

    ``fixed`` bytes (CUDA context, cuBLAS workspaces, NCCL buffers) plus ``fraction`` of the estimated tensor bytes
    (allocator fragmentation: reserved minus allocated). ``source`` says where the figures come from (a measured
    GPU name and date, or "default, not measured").
    """

    fixed: int
    fraction: float
    source: str

    def bytes_for(self, tensor_bytes: float) -> int:
        """``fixed + fraction * tensor_bytes`` (bytes)."""
        return int(self.fixed + self.fraction * tensor_bytes)


@functools.lru_cache(maxsize=1)
def _overhead_table() -> dict[str, Any]:
    """``overhead.json``, read once per process (the planner asks for it once per layout)."""
    return json.loads(OVERHEAD_FILE.read_text())


def overhead_allowance(gpu_name: Optional[str] = None, device_type: str = "cuda") -> OverheadAllowance:
    """The allowance for ``gpu_name`` (``torch.cuda.get_device_name()``, e.g. "NVIDIA H100 80GB HBM3", or a preset
    of :data:`GPU_PRESETS` such as ``"H200"``) from ``overhead.json``: the entry whose key is contained in the name,
    or whose key holds the preset's family (its name up to the first ``-``) as a word (longest match), else
    ``"default"``. On a CPU (``device_type="cpu"``) there is no CUDA context: zero."""
    if device_type != "cuda":
        return OverheadAllowance(0, 0.0, "cpu: no CUDA context, no caching allocator")
    table = _overhead_table()
    key = "default"
    if gpu_name:
        name = gpu_name.lower()
        family = name.split("-")[0] if gpu_name in GPU_PRESETS else None
        matches = [
            k
            for k in table
            if k != "default"
            and (
                k.lower() in name or (family and re.search(rf"(?<![a-z0-9]){re.escape(family)}(?![a-z0-9])", k.lower()))
            )
        ]
        if matches:
            key = max(matches, key=len)
    entry = table[key]
    return OverheadAllowance(int(entry["fixed_bytes"]), float(entry["fraction"]), str(entry["source"]))
