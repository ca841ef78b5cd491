"""The test launcher (tests/_launch.py): a launch that overruns its limit fails in that limit with every rank's
Python stack, a failed launch's error keeps each rank's whole traceback, the first printed first, a failed rank ends
the others, and a forked rank sees what a rank of the real ``torchrun`` sees."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time

import pytest

from tests import _launch
from tests._collectives import first_divergence
from tests._launch import rank_tracebacks, run_limited, torchrun

#: prints, as JSON on one line, what a rank reads of its launch: the variables torchrun sets that Lightning's
#: ``TorchElasticEnvironment`` and ``torch.distributed``'s ``env://`` read, its argv, first import path and cwd
_WHO_AM_I = """import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS", "PYTHONPATH"]
line = json.dumps({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv, "path0": sys.path[0],
                   "cwd": os.getcwd()})
os.write(1, (line + "\\n").encode())  # one write: the two ranks share one stdout, and print's may interleave
"""


@pytest.mark.slow
def test_a_hung_launch_fails_with_each_ranks_stack(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\n\n\ndef waits_forever():\n    time.sleep(3600)\n\n\nwaits_forever()\n")
    start = time.monotonic()
    # a forked rank is in its script within a second (the forkserver holds the imports; its start is not timed);
    # under torchrun the limit also covers torchrun's own start (it imports torch: seconds on a loaded machine)
    limit = 8 if _launch.LAUNCHER == "forkserver" else 30
    with pytest.raises(AssertionError, match=f"did not finish in {limit} s") as info:
        torchrun(2, script, timeout=limit)
    assert time.monotonic() - start < limit + 40  # SIGABRT, then at most 30 s for the output
    # both ranks' stacks (faulthandler): the two write to one stderr at once, piece by piece (a frame's file, line and
    # function name are separate writes), so their lines can interleave, but a function's name is one write
    assert str(info.value).count("waits_forever") == 2, str(info.value)


@pytest.mark.slow
def test_a_hung_launcher_fails_with_its_childrens_stacks(tmp_path):
    """A launch that is not torchrun (``lightning-4d fit`` over several devices: Lightning starts the other ranks as
    children of the first): past its limit the child prints its stack too and ends, no orphan left running."""
    child = tmp_path / "child.py"
    child.write_text("import time\n\n\ndef child_waits():\n    time.sleep(3600)\n\n\nchild_waits()\n")
    parent = tmp_path / "parent.py"
    parent.write_text(
        f"import subprocess, sys, time\n\nchild = subprocess.Popen([sys.executable, {str(child)!r}])\n\n\n"
        "def parent_waits():\n    time.sleep(3600)\n\n\nparent_waits()\n"
    )
    with pytest.raises(AssertionError, match="did not finish in 6 s") as info:
        run_limited([sys.executable, str(parent)], timeout=6)
    assert "child_waits" in str(info.value) and "parent_waits" in str(info.value), str(info.value)


def test_rank_tracebacks_gathers_each_ranks_lines():
    stderr = "\n".join(
        [
            "[rank7]: Traceback (most recent call last):",
            "[rank4]:W1202 07:41:52.153000 4170 some warning",
            "[rank7]:   File 'stage.py', line 1, in forward_one_chunk",
            "[rank6]: Traceback (most recent call last):",
            "[rank6]:   File 'schedules.py', line 2, in _step_microbatches",
            "[rank7]: ValueError: the cause",
            "[rank7]: ",
            "[rank7]: RuntimeError: ",
            "[rank7]:             [Stage 3] failed to run forward:",
            "unrelated line",
        ]
    )
    text = rank_tracebacks(stderr)
    assert "ValueError: the cause\n\nRuntimeError: \n            [Stage 3] failed to run forward:" in text
    assert text.endswith("[rank6]: ")  # a later rank: its exception lines (none here)
    assert "some warning" not in text and "unrelated" not in text
    assert rank_tracebacks("no rank lines") == ""


def _trace(folder, rank, rows, groups, thread=1):
    entries = [[g, i + 1, op, [[n]], ["Float"], thread, [f"{op}_site x.py:1"]] for i, (g, op, n) in enumerate(rows)]
    (folder / f"collectives_rank{rank}.json").write_text(json.dumps({"groups": groups, "entries": entries, "kept": 99}))


def test_first_divergence_names_the_collective_where_the_ranks_part(tmp_path):
    """tests/_collectives.py on crafted traces of 3 ranks (group "1": ranks 0 and 1; "2": ranks 1 and 2)."""
    groups = {"1": [0, 1], "2": [1, 2]}
    same = [("1", "gloo:all_reduce", 4), ("2", "gloo:all_gather", 8)]
    for rank in range(3):
        _trace(tmp_path, rank, [r for r in same if rank in groups[r[0]]], groups)
    assert first_divergence(tmp_path) is None
    # rank 2 issues group 2's two collectives in the other order: named with both ranks' sites
    _trace(tmp_path, 1, [("1", "gloo:all_reduce", 4), ("2", "gloo:all_gather", 8), ("2", "gloo:all_reduce", 8)], groups)
    _trace(tmp_path, 2, [("2", "gloo:all_reduce", 8), ("2", "gloo:all_gather", 8)], groups)
    text = first_divergence(tmp_path)
    assert text.startswith("process group 2 (ranks [1, 2]), collective 1:"), text
    assert "rank 1: gloo:all_gather sizes [[8]]" in text and "rank 2: gloo:all_reduce sizes [[8]]" in text, text
    # a rank whose sequence stops short (it failed or hung there) is named; the same again passes
    _trace(tmp_path, 2, [("2", "gloo:all_gather", 8)], groups)
    assert "rank 2: none (its sequence ends before)" in first_divergence(tmp_path)
    _trace(tmp_path, 2, [("2", "gloo:all_gather", 8), ("2", "gloo:all_reduce", 8)], groups)
    assert first_divergence(tmp_path) is None
    # a collective from a second thread
    _trace(tmp_path, 0, [("1", "gloo:all_reduce", 4)], groups)
    rows = json.loads((tmp_path / "collectives_rank0.json").read_text())
    rows["entries"].append(["1", 2, "gloo:barrier", [[1]], ["Float"], 2, []])
    (tmp_path / "collectives_rank0.json").write_text(json.dumps(rows))
    assert first_divergence(tmp_path).startswith("rank 0 issued collectives from 2 threads"), first_divergence(tmp_path)


@pytest.mark.slow
def test_a_forked_rank_sees_what_a_torchrun_rank_sees(tmp_path, monkeypatch):
    script = tmp_path / "who.py"
    script.write_text(_WHO_AM_I)
    seen = {}
    for launcher in ("torchrun", "forkserver"):
        monkeypatch.setattr(_launch, "LAUNCHER", launcher)
        lines = torchrun(2, script, "--flag", "x").stdout.splitlines()
        seen[launcher] = sorted((json.loads(line) for line in lines if line.startswith("{")), key=_rank)
    real, forked = seen["torchrun"], seen["forkserver"]
    assert [_rank(r) for r in real] == [_rank(r) for r in forked] == ["0", "1"]
    for a, b in zip(real, forked):
        for key in ("MASTER_PORT", "TORCHELASTIC_RUN_ID"):  # each launch its own port and run id
            assert a["env"].pop(key) and b["env"].pop(key), key
        assert a == b
    assert forked[0]["argv"] == [str(script), "--flag", "x"] and forked[0]["path0"] == str(tmp_path)


def _rank(record: dict) -> str:
    return record["env"]["RANK"]


@pytest.mark.slow
def test_a_failed_rank_ends_the_others_at_once(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        "import os, time\n\nif os.environ['RANK'] == '1':\n    raise ValueError('rank 1 fails')\ntime.sleep(600)\n"
    )
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 fails") as info:
        torchrun(2, script, timeout=300)
    assert time.monotonic() - start < 60, "rank 0 (asleep for 600 s) should have been ended with the failure"
    assert "failed (1)" in str(info.value)
    if _launch.LAUNCHER == "forkserver":  # torchrun prints its own table of the failed ranks
        assert "first to fail: rank 1 (exit code 1)" in str(info.value)


@pytest.mark.skipif(_launch.LAUNCHER != "forkserver", reason="torchrun names the ranks it saw fail in its own table")
def test_a_launch_names_the_rank_that_failed_first(tmp_path):
    """A rank killed by a signal prints nothing, and the peers that lose their connection to it each print a
    traceback that looks like a cause. The launch's error names the first process to end and how: here rank 2,
    SIGKILL (what the kernel's OOM killer sends), while ranks 0 and 1 sleep (ended after it)."""
    script = tmp_path / "killed.py"
    script.write_text(
        "import os, signal, time\n\nif os.environ['RANK'] == '2':\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(600)\n"
    )
    start = time.monotonic()
    with pytest.raises(AssertionError, match="failed \\(137\\)") as info:
        torchrun(3, script, timeout=300)
    assert time.monotonic() - start < 60, "ranks 0 and 1 (asleep for 600 s) should have been ended after rank 2"
    assert "first to fail: rank 2 (signal SIGKILL)" in str(info.value), str(info.value)[-2000:]
    if _launch.oom_kills() is not None:  # Linux 4.13 and later; the counter is machine-wide: another job's kill
        text = str(info.value)  # meanwhile turns the line into the other one
        assert "not the kernel's OOM killer" in text or "the kernel's OOM killer ended" in text, text[-2000:]


def test_the_oom_kill_counter_and_the_launchs_line_about_it(tmp_path):
    """``oom_kills`` reads ``/proc/vmstat``'s ``oom_kill`` (``None`` without one); a failed launch says the OOM
    killer ended a process when the counter rose, that it did not when a rank ended with SIGKILL and the counter did
    not move, and nothing otherwise."""
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 12\noom_kill 7\nnr_foll_pin_acquired 0\n")
    assert _launch.oom_kills(vmstat) == 7
    vmstat.write_text("nr_free_pages 12\n")
    assert _launch.oom_kills(vmstat) is None
    assert _launch.oom_kills(tmp_path / "absent") is None
    assert "ended 2 process(es)" in _launch._oom_line(7, 9, killed=True)
    assert "ran out of memory" in _launch._oom_line(7, 9, killed=True)
    assert "oom_kill 7 -> 8" in _launch._oom_line(7, 8, killed=False)
    assert "another job" in _launch._oom_line(7, 8, killed=False)
    assert "not the kernel's OOM killer" in _launch._oom_line(7, 7, killed=True)
    assert _launch._oom_line(7, 7, killed=False) == ""
    assert _launch._oom_line(None, 9, killed=True) == _launch._oom_line(7, None, killed=True) == ""


@contextlib.contextmanager
def _memory_cgroup(limit: int):
    """A memory cgroup of its own whose limit is ``limit`` bytes (cgroup v1's ``memory.limit_in_bytes`` or v2's
    ``memory.max``); yields the file a process writes its pid to, to join it. Skips the test where none can be made
    (not root, or no memory controller)."""
    import pathlib

    roots = (
        ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.memsw.limit_in_bytes"),
        ("/sys/fs/cgroup", "memory.max", "memory.swap.max"),
    )
    for root, limit_file, swap_file in roots:
        group = pathlib.Path(root) / f"l4d_oom_test_{os.getpid()}"
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            try:
                (group / limit_file).write_text(str(limit))
                if (group / swap_file).exists():  # no swapping out instead of the kill (v1: memory + swap)
                    (group / swap_file).write_text(str(limit) if swap_file.endswith("in_bytes") else "0")
            except OSError:  # no such file (no memory controller there), or not allowed
                continue
            yield group / "cgroup.procs"
            return
        finally:
            for _ in range(50):  # empty once its process has been reaped
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
    pytest.skip("no memory cgroup could be made here (this needs root and a cgroup memory controller)")


@pytest.mark.slow
@pytest.mark.skipif(_launch.oom_kills() is None, reason="no /proc/vmstat oom_kill counter (Linux 4.13 and later)")
def test_a_launch_says_when_the_oom_killer_ended_a_rank(tmp_path):
    """A real OOM kill: rank 1 joins a memory cgroup of 64 MiB and allocates 512 MiB; the kernel's OOM killer ends
    it with SIGKILL (no traceback), and the launch's error names the rank and says the OOM killer ended it."""
    script = tmp_path / "oom.py"
    script.write_text(
        "import os, sys, time\n\nif os.environ['RANK'] == '1':\n"
        "    with open(sys.argv[1], 'w') as f:\n        f.write(str(os.getpid()))\n"
        "    memory = bytearray(512 * 2**20)\n    print('rank 1 survived', flush=True)\n    sys.exit(3)\n"
        "time.sleep(600)\n"
    )
    with _memory_cgroup(64 * 2**20) as procs:
        start = time.monotonic()
        status = 137 if _launch.LAUNCHER == "forkserver" else 1  # torchrun exits 1 and names the signal in its table
        with pytest.raises(AssertionError, match=f"failed \\({status}\\)") as info:
            torchrun(2, script, str(procs), timeout=300)
    assert time.monotonic() - start < 60, "rank 0 (asleep for 600 s) should have been ended after rank 1"
    text = str(info.value)
    assert "rank 1 survived" not in text
    if _launch.LAUNCHER == "forkserver":
        assert "first to fail: rank 1 (signal SIGKILL)" in text, text[-2000:]
    else:
        assert "Signal 9 (SIGKILL) received by PID" in text, text[-2000:]
    assert re.search(r"the kernel's OOM killer ended \d+ process\(es\).*ran out of memory", text), text[-2000:]


def test_signals_reach_only_the_process_that_was_found():
    """``_abort_pids``' signals name a process by pid and start time: a process whose start time differs (its pid
    reused by another) is not signalled; an ended one is no longer alive."""
    import signal
    import subprocess

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (found,) = _launch._processes([sleeper.pid])
        assert _launch._alive(found)
        _launch._signal((found[0], found[1] + 1), signal.SIGKILL)  # another process with this pid: not hit
        assert [q for q in _launch._descendants(os.getpid()) if q[0] == sleeper.pid] == [found]
        time.sleep(0.2)
        assert sleeper.poll() is None
        _launch._signal(found, signal.SIGKILL)
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        assert not _launch._alive(found)
    finally:
        sleeper.kill()


def test_a_launch_must_agree_with_the_forkserver_on_import_time_variables(monkeypatch):
    """The forkserver imports once, with the first launch's environment less its rendezvous variables; a later
    launch whose ``OMP_NUM_THREADS`` (or another variable read at import) differs is refused with both values named,
    one whose rank and port differ is not."""
    from tests import _forkserver

    server = object()
    env = {"PYTHONPATH": "/x", "OMP_NUM_THREADS": "1"}
    monkeypatch.setattr(_forkserver, "_CONTEXT", server)
    monkeypatch.setattr(_forkserver, "_SERVER_ENV", dict(env))
    assert _forkserver.context({**env, "RANK": "3", "MASTER_PORT": "1234", "TORCHELASTIC_RUN_ID": "r"}) is server
    with pytest.raises(RuntimeError, match="OMP_NUM_THREADS='4' but the test forkserver imported with OMP_NUM_"):
        _forkserver.context({**env, "OMP_NUM_THREADS": "4"})
