"""Multi-node: ``Trainer(num_nodes=2, devices=2)`` with ``FourDStrategy(tensor_parallel_size=2, zero_stage=1)`` run as
two "nodes" on this machine: two torchrun agents (``--nnodes 2 --node-rank 0|1``, 2 processes each) meeting at a
static localhost rendezvous, CPU, gloo, float32 (``tests/scripts/multinode_fit.py``).

Checks: Lightning reads the node rank from the torchrun environment; the mesh keeps every tp group inside one node
(tp innermost: ranks 2n, 2n+1 are node n) while the dp group spans both nodes; and the per-step losses and final
weights equal the single-process reference run of ``tests/test_parity.py`` (same model, data and seed) to its
tolerances (loss 1e-5 relative).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests._launch import FLOAT32_STEPS, ROOT, SCRIPTS, _abort, worker_env
from tests.test_parity import _check_parity, shared

NUM_NODES = 2
DEVICES = 2
TIMEOUT_S = 300  # both nodes together; the process group timeout inside is 120 s, so a hang fails here


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_command(node_rank: int, port: int, out) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={NUM_NODES}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={DEVICES}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(SCRIPTS / "multinode_fit.py"),
        "--out",
        str(out),
        "--steps",
        str(FLOAT32_STEPS),
    ]


def _run_two_nodes(out) -> float:
    """Start both node agents, wait for both; raise with their output on failure or timeout. Returns seconds."""
    port = _free_port()
    logs, procs = [], []
    start = time.monotonic()
    try:
        for node in range(NUM_NODES):
            log = open(out / f"node{node}.log", "w+")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    _node_command(node, port, out),
                    env=worker_env(),
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        deadline = start + TIMEOUT_S
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
        for p in procs:  # every worker prints its Python stacks into its node's log, then ends (SIGABRT)
            if p.poll() is None:
                _abort(p)
    finally:
        for p in procs:  # only the sessions started above
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    elapsed = time.monotonic() - start
    if codes is None or any(codes):
        text = []
        for node, log in enumerate(logs):
            log.seek(0)
            text.append(f"--- node {node} ---\n{log.read()[-(30000 if codes is None else 6000) :]}")
        what = f"timed out after {TIMEOUT_S} s" if codes is None else f"exit codes {codes}"
        raise AssertionError(f"two-node fit {what}:\n" + "\n".join(text))
    for log in logs:
        log.close()
    return elapsed


@pytest.mark.slow
def test_two_nodes_dp2_tp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("multinode")
    elapsed = _run_two_nodes(out)
    print(f"\ntwo-node fit (2 nodes x 2 processes, {FLOAT32_STEPS} steps): {elapsed:.1f} s")
    ranks = [json.loads((out / f"layout0_rank{r}.json").read_text()) for r in range(NUM_NODES * DEVICES)]

    # Lightning took the layout from torchrun's environment
    for r, rec in enumerate(ranks):
        assert rec["rank"] == r
        assert rec["cluster_environment"] == "TorchElasticEnvironment"
        assert (rec["world_size"], rec["num_nodes"], rec["num_devices"]) == (4, 2, 2)
        assert rec["node_rank"] == r // DEVICES == int(rec["env"]["GROUP_RANK"])
        assert rec["local_rank"] == r % DEVICES == int(rec["env"]["LOCAL_RANK"])
        assert rec["mesh_shape"] == [1, 2, 1, 2]  # (pp, dp, cp, tp)

    # (a) each tp group inside one node; the dp group (= dp_cp, cp=1) across both nodes
    for r, rec in enumerate(ranks):
        assert r in rec["tp_ranks"] and len(rec["tp_ranks"]) == 2
        assert {t // DEVICES for t in rec["tp_ranks"]} == {r // DEVICES}, rec["tp_ranks"]
        assert r in rec["dp_ranks"] and len(rec["dp_ranks"]) == 2
        assert {d // DEVICES for d in rec["dp_ranks"]} == {0, 1}, rec["dp_ranks"]
        assert rec["dp_cp_ranks"] == rec["dp_ranks"]

    # (b) the single-process losses (and weights), with test_parity's reference run and comparison
    reference = shared(tmp_path_factory, "reference")[0]  # test_parity's: one launch
    result = (ranks[0]["layout"], ranks, torch.load(out / "layout0_weights.pt"))
    _check_parity(reference, result)
