"""Run ``lightning-4d fit`` argument lists (JSON, argv[1]) through ``lightning_4d.cli.main`` in this process, each
with stderr captured, and print ``[[exit code, stderr], ...]`` as one JSON line (tests/test_cli_inputs.py).

``Trainer.fit`` is replaced by a refusal: a list that is not refused before training returns its own error instead
of starting processes (Lightning's launcher would re-run this script in each)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402

from lightning_4d.cli import main  # noqa: E402


def _refusing(method):
    @functools.wraps(method)  # the same signature: LightningCLI reads its arguments (ckpt_path, weights_only) from it
    def refuse(*args, **kwargs):
        raise RuntimeError(f"reached Trainer.{method.__name__}: the input was not refused before training")

    return refuse


L.Trainer.fit = _refusing(L.Trainer.fit)
L.Trainer.validate = _refusing(L.Trainer.validate)

results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    handler = logging.StreamHandler(err)
    logging.getLogger("lightning").addHandler(handler)
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        except BaseException as e:  # noqa: BLE001 (reported, the test names it)
            code = f"raised {type(e).__name__}: {e}"
    logging.getLogger("lightning").removeHandler(handler)
    results.append([code, err.getvalue()])
print(json.dumps(results))
