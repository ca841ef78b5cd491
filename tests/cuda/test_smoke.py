"""The CUDA smoke matrix (issue 32): every row of the support matrix that is not refused
(:func:`lightning_4d.support.smoke_rows`), one rank of its layout on torch's fake process group for 2 steps on the
GPU: it runs, the loss is finite, no decoder layer changes the residual stream's dtype, and the measured peak is
within 5% of the estimate plus the CUDA libraries' workspaces (:func:`lightning_4d.support.run_row`).

Skipped without a CUDA device (``make test`` on CPU collects and skips it); the CPU dry run of the same rows is
``tests/test_support.py::test_cpu_dry_run_of_representative_rows`` and ``python -m lightning_4d.support --smoke
--device cpu``. ``benchmarks/gpu_check.sh`` runs the rows first on a lent GPU and writes their results under
``benchmarks/results/`` (docs/support.md reads them)."""

from __future__ import annotations

import pytest

from lightning_4d.support import run_row, smoke_rows

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA smoke matrix needs a CUDA device")


def _params() -> list:
    """One pytest param per row not refused; a row the runner cannot run is skipped with the row's reason."""
    return [
        pytest.param(row, id=row.id, marks=[pytest.mark.skip(reason=row.smoke_skip)] if row.smoke_skip else [])
        for row in smoke_rows()
    ]


@pytest.mark.parametrize("row", _params())
def test_smoke_row_runs_on_cuda(row):
    result = run_row(row, "cuda")
    assert result["status"] == "ok", f"{row.id} ({row.command()} --device cuda): {result['error']}"
