"""``lightning-4d plan --plot FILE.png``: predicted step time against memory per GPU for a job's layouts.

matplotlib is an optional extra (``pip install 'lightning-4d[plot]'``), imported only here and only when plotting,
with the non-interactive Agg backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence, Union

from lightning_4d.planning.hardware import GIB

__all__ = ["plot_plan"]


def plot_plan(
    candidates: Sequence[Any], gpu_memory: int, budget: float, path: Union[str, Path], title: str = ""
) -> dict[str, Any]:
    """Draw ``candidates`` (:class:`~lightning_4d.planning.planner.Candidate`: ``memory`` bytes, ``step_time``
    seconds, ``fits``) as points, those that fit highlighted, the budget (``budget · gpu_memory``) and the device
    memory as vertical lines, the fastest fitting layout annotated; write a PNG to ``path``.

    Returns:
        ``{"fitting": [(GiB, s), ...], "not_fitting": [...], "path": str}``: the points drawn.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plan --plot needs matplotlib: pip install 'lightning-4d[plot]'") from None
    fit = [(c.memory / GIB, c.step_time) for c in candidates if c.fits]
    unfit = [(c.memory / GIB, c.step_time) for c in candidates if not c.fits]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    if unfit:
        ax.scatter(*zip(*unfit), s=10, color="0.7", label="does not fit")
    if fit:
        ax.scatter(*zip(*fit), s=14, color="tab:blue", label="fits")
    ax.axvline(
        budget * gpu_memory / GIB, color="tab:orange", linestyle="--", label=f"budget ({100 * budget:.0f}% of the GPU)"
    )
    ax.axvline(gpu_memory / GIB, color="tab:red", linestyle=":", label="GPU memory")
    best = next((c for c in candidates if c.fits), None)
    if best is not None:
        ax.annotate(
            f"tp{best.tp} pp{best.pp} cp{best.cp} dp{best.dp} b{best.micro_batch_size} ZeRO {best.zero_stage} "
            f"{best.activation_checkpointing}",
            (best.memory / GIB, best.step_time),
            xytext=(10, 10),
            textcoords="offset points",
            fontsize=8,
            arrowprops=dict(arrowstyle="->", lw=0.8),
        )
    ax.set_xlabel("memory per GPU (GiB, estimated)")
    ax.set_ylabel("step time (s, predicted)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path))
    plt.close(fig)
    return {"fitting": fit, "not_fitting": unfit, "path": str(path)}
