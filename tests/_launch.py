"""Helpers to launch multi-process jobs from tests: each job its own process group of ranks, forked from a server
that imported torch, Lightning and lightning_4d once per session (``tests/_forkserver.py``), never pytest itself (so
Lightning never re-runs pytest)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"


#: what a distributed run in this process (an in-process fit, a launcher) leaves in ``os.environ``: a child must not
#: inherit it (measured: a 1-process child took the pytest process's MASTER_PORT, still bound by a process group
#: another test left there, and failed with EADDRINUSE)
def worker_env() -> dict[str, str]:
    from tests._forkserver import without_launch_variables

    env = without_launch_variables(dict(os.environ))
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    # a fatal signal (SIGSEGV, the SIGABRT of :func:`torchrun`'s limit) prints every thread's Python stack first: a
    # rank that dies without a traceback (its peers then fail with "Connection closed by peer") shows where it was
    env["PYTHONFAULTHANDLER"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


#: how :func:`torchrun` and :func:`python_run` start a process: ``"forkserver"`` (a child forked from a server that
#: imported torch, Lightning and lightning_4d once per session: ``tests/_forkserver.py``) or ``"torchrun"`` (a fresh
#: interpreter per process, under ``torch.distributed.run``): ``L4D_TEST_LAUNCHER=torchrun pytest ...``
LAUNCHER = os.environ.get("L4D_TEST_LAUNCHER", "forkserver")


def torchrun(
    nproc: int, script: Path | str, *args: str, timeout: float = 600, check: bool = True, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """Run ``script`` as ``torchrun --standalone --nproc-per-node nproc`` would (``nproc == 1``: as ``python
    script``; ``script`` ``"-m"``: the module that ``args`` starts with, as ``torchrun -m`` runs it); raise with its
    output on failure (each rank's traceback; not with ``check=False``), or when it overruns ``timeout`` seconds
    (with each rank's Python stacks); ``cwd``: the ranks' working directory. Returns its exit status and output (the
    ranks' lines interleaved)."""
    if LAUNCHER == "torchrun":
        return _torchrun_fresh(nproc, script, *args, timeout=timeout, check=check, cwd=cwd)
    return _torchrun_forked(nproc, script, *args, timeout=timeout, check=check, cwd=cwd)


def _torchrun_forked(
    nproc: int, script: Path | str, *args: str, timeout: float, check: bool, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """:func:`torchrun` with each rank forked from the test forkserver (``tests/_forkserver.py``)."""
    from tests import _forkserver

    cmd = [sys.executable, str(script), *args]
    if nproc > 1:
        cmd = [f"torchrun --standalone --nproc-per-node={nproc} (forked ranks)", *cmd[1:]]
    envs = _forkserver.rank_envs(nproc, worker_env())
    oom_before = oom_kills()
    code, stdout, stderr, first = _forked([[str(script), *args]] * nproc, envs, cwd, cmd, timeout)
    if code is None:
        raise AssertionError(_overran(cmd, timeout, stdout, stderr)) from None
    if first and nproc > 1:  # last in stderr, so in the tail a failed launch's error keeps
        stderr += f"\n[launch] first to fail: {first}; the other ranks were ended after it\n"
    if code:
        stderr += _oom_line(oom_before, oom_kills(), killed="SIGKILL" in first)
    proc = subprocess.CompletedProcess(cmd, code, stdout, stderr)
    return _checked(proc) if check else proc


def python_run(*argv: str, env: dict | None = None, cwd: Path = ROOT, timeout: float = 300):
    """``subprocess.run([python, *argv], env=env or worker_env(), cwd=cwd, capture_output=True, text=True,
    timeout=timeout)`` (``argv``: a script and its arguments, ``-m``, a module and its arguments, or ``-c`` and
    code), its process forked from the test forkserver (see :data:`LAUNCHER`). Raises ``subprocess.TimeoutExpired``
    past ``timeout`` (its output: the Python stacks of the process, SIGABRT)."""
    env = worker_env() if env is None else env
    cmd = [sys.executable, *argv]
    if LAUNCHER == "torchrun":
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    code, stdout, stderr, _ = _forked([list(argv)], [env], Path(cwd), cmd, timeout)
    if code is None:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def _forked(argvs: list, envs: list, cwd: Path, cmd: list, timeout: float) -> tuple[int | None, str, str, str]:
    """Fork one process per ``argvs[i]`` (environment ``envs[i]``) from the test forkserver; wait for all (the first
    failure ends the others). Returns ``(exit status or None past timeout, stdout, stderr, the first process to
    fail)`` (:func:`tests._forkserver.join`); an overrun's processes end with SIGABRT (each prints its Python
    stacks)."""
    import tempfile

    from tests import _forkserver

    with tempfile.TemporaryDirectory(prefix="l4d_launch") as folder:
        out = Path(folder)
        procs = _forkserver.start(argvs, envs, cwd, out)
        try:
            code, first = _forkserver.join(procs, timeout, time.monotonic)
        except BaseException:  # interrupted (pytest-timeout's limit, Ctrl-C): the stacks go to this process's stderr
            _abort_pids([p.pid for p in procs])
            stdout, stderr = _outputs(out)
            sys.stderr.write(f"{' '.join(cmd)} interrupted:\n{stdout[-6000:]}\n{stderr[-30000:]}\n")
            raise
        if code is None:
            _abort_pids([p.pid for p in procs])
        for p in procs:
            p.join()
        stdout, stderr = _outputs(out)
    return code, stdout, stderr, first


def _outputs(out: Path) -> tuple[str, str]:
    """What the processes of a forked launch wrote to ``out/stdout`` and ``out/stderr`` (empty: nothing, or none
    started)."""
    return tuple((out / n).read_text(errors="replace") if (out / n).exists() else "" for n in ("stdout", "stderr"))


def _torchrun_fresh(
    nproc: int, script: Path | str, *args: str, timeout: float, check: bool, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """:func:`torchrun` with a fresh interpreter per rank: ``torch.distributed.run`` (``nproc == 1``: ``python``)."""
    if nproc == 1:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(script),
            *args,
        ]
    proc = run_limited(cmd, timeout, cwd=cwd)
    return _checked(proc) if check else proc


def run_limited(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """Run ``cmd`` in ``cwd`` (``env``: :func:`worker_env` by default) with its output captured, and
    return it finished, its return code unchecked. For every launch that starts processes of its own (torchrun, a
    ``lightning-4d fit`` over several devices): past ``timeout`` seconds every process below it prints its Python
    stacks and ends (:func:`_abort`) and an ``AssertionError`` carries them; interrupted (pytest-timeout's limit,
    Ctrl-C), the stacks go to this process's stderr. ``subprocess.run(timeout=)`` would kill the launcher alone: its
    workers would run on, and where they waited would not be shown."""
    oom_before = oom_kills()
    popen = subprocess.Popen(
        cmd,
        env=worker_env() if env is None else env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_no_core_files,
    )
    try:
        stdout, stderr = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _abort(popen)
        raise AssertionError(_overran(cmd, timeout, stdout, stderr)) from None
    except BaseException:  # interrupted (pytest-timeout's limit, Ctrl-C): the stacks go to this process's stderr
        stdout, stderr = _abort(popen)
        sys.stderr.write(f"{' '.join(cmd)} interrupted:\n{stdout[-6000:]}\n{stderr[-30000:]}\n")
        raise
    if popen.returncode:  # torchrun's table names a worker's signal ("Signal 9 (SIGKILL) received by PID ...")
        stderr += _oom_line(oom_before, oom_kills(), killed="SIGKILL" in stderr or popen.returncode == -signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)


def oom_kills(vmstat: Path = Path("/proc/vmstat")) -> int | None:
    """How many processes the kernel's OOM killer has ended on this machine since it booted: ``/proc/vmstat``'s
    ``oom_kill`` (Linux 4.13 and later; a kill inside a memory cgroup counts too), ``None`` where there is no such
    counter (another system, an older kernel)."""
    try:
        text = vmstat.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill":
            return int(value)
    return None


def _oom_line(before: int | None, after: int | None, killed: bool) -> str:
    """What a failed launch adds to its ``stderr`` about the kernel's OOM killer, from :func:`oom_kills` read
    before (``before``) and after it (``after``); ``killed``: a process of the launch ended with SIGKILL, which is
    what the OOM killer sends (and a rank ended so prints no traceback; its peers each print a lost connection).

    Why: the 8-rank launch once failed with only its peers' errors in the log, and the first rank's cause was lost. The
    counter is machine-wide: a kill of another job's process while the launch ran counts too, so the line says "on
    this machine". Empty when the counter is unavailable, or when nothing was killed and the counter did not move."""
    if before is None or after is None:
        return ""
    if after > before:
        why = (
            "the rank that ended with SIGKILL most likely ran out of memory (the host's or its cgroup's)"
            if killed
            else "no rank ended with SIGKILL, so most likely a process of another job"
        )
        return (
            f"\n[launch] the kernel's OOM killer ended {after - before} process(es) on this machine while the launch "
            f"ran (/proc/vmstat oom_kill {before} -> {after}): {why}\n"
        )
    if killed:
        return (
            f"\n[launch] not the kernel's OOM killer: it ended no process on this machine while the launch ran "
            f"(/proc/vmstat oom_kill stayed {after}); the SIGKILL came from elsewhere\n"
        )
    return ""


def _overran(cmd: list, timeout: float, stdout: str, stderr: str) -> str:
    return (
        f"{' '.join(cmd)} did not finish in {timeout} s; each process's Python stacks (faulthandler, SIGABRT) "
        f"end its output:\n{stdout[-6000:]}\n{stderr[-30000:]}"
    )


def _checked(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(proc.args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
            f"{rank_tracebacks(proc.stderr)}"
        )
    return proc


def rank_tracebacks(stderr: str, limit: int = 12000) -> str:
    """The uncaught exceptions of the ranks in a launch's ``stderr``, in the order their first line reached
    ``stderr``: the first rank's whole traceback (its last ``limit`` characters), then each other rank's exception
    lines.

    Why: torch.distributed's ``sys.excepthook`` prefixes each line of a rank's traceback with ``[rank<r>]: ``, and the
    ranks' lines interleave with each other's and with warnings, so the tail of ``stderr`` can hold the end of one
    rank's traceback without its cause. ``torch.distributed.pipelining`` re-raises an error of a stage's forward or
    backward as a ``RuntimeError`` whose message starts with a newline (its first line reads ``RuntimeError: ``): the
    error itself is the chained exception above it. And the rank torchrun names as the root cause is not the first
    to fail when several fail within a second (without an error file it orders them by the second they were seen):
    the first traceback printed is the likelier root cause, the others' ranks lost their connection to it."""
    by_rank: dict[str, list[str]] = {}
    for line in stderr.splitlines():
        if line.startswith("[rank") and "]: " in line[:12]:
            rank, _, rest = line.partition("]: ")
            by_rank.setdefault(rank + "]", []).append(rest)
    if not by_rank:
        return ""
    (first, lines), *others = by_rank.items()
    text = f"{first}:\n" + "\n".join(lines)[-limit:]
    for rank, lines in others:  # their exceptions' lines only (not the frames)
        text += f"\n{rank}: " + " | ".join(x for x in lines if x and not x.startswith((" ", "Traceback ")))
    return f"\n\nthe ranks' tracebacks, the first printed first (the others: their exceptions):\n{text}"


def _descendants(pid: int) -> list[tuple[int, int]]:
    """The processes below ``pid`` as ``(pid, start time)``, read from ``/proc`` in one pass (each process's parent
    and start time from the same read of its ``stat``): torchrun starts each worker in a session of its own, so a
    signal to torchrun's process group misses them."""
    parents: dict[int, list[tuple[int, int]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses; field 22 the start time
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append((int(stat.parent.name), int(fields[19])))
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += [child for child, _ in children]
    return found


def _abort_pids(pids: list[int]) -> None:
    """SIGABRT to each process of ``pids`` and to everything below them (``PYTHONFAULTHANDLER`` or
    ``faulthandler.enable()``: each prints all its threads' Python stacks before it dies: where a hung rank waits);
    SIGKILL to whatever of them is left 30 s later (a process is signalled only while it is the one found: same pid
    and start time, so a pid the kernel reused meanwhile is never hit)."""
    found = [q for pid in pids for q in _descendants(pid)] + _processes(pids)
    for proc in found:
        _signal(proc, signal.SIGABRT)
    end = time.monotonic() + 30
    while time.monotonic() < end and any(_alive(proc) for proc in found):
        time.sleep(0.2)
    for proc in found:
        _signal(proc, signal.SIGKILL)


def _abort(popen: subprocess.Popen) -> tuple[str, str]:
    """End a launch that overran: SIGABRT to every worker, then to the launcher (``PYTHONFAULTHANDLER`` makes each
    print all its threads' Python stacks before it dies: where a hung rank waits), SIGKILL to whatever is left 30 s
    later (the workers still the processes found, :func:`_abort_pids`); returns the launch's stdout and stderr."""
    workers = _descendants(popen.pid)
    for proc in workers:
        _signal(proc, signal.SIGABRT)
    time.sleep(2)  # the workers' stacks before the launcher's
    popen.send_signal(signal.SIGABRT)
    try:
        return popen.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        for proc in workers:
            _signal(proc, signal.SIGKILL)
        popen.kill()
        return popen.communicate()


def _no_core_files() -> None:
    """No core file from the SIGABRT of :func:`_abort` (inherited by the workers)."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks after boot, ``/proc/<pid>/stat`` field 22), ``None`` when no
    such process exists or it has ended (a zombie): with the pid, what names one process (a pid alone may be reused
    once it ended)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _processes(pids: list[int]) -> list[tuple[int, int]]:
    """``(pid, start time)`` of each process of ``pids`` that exists now."""
    return [(pid, t) for pid in pids if (t := _start_time(pid)) is not None]


def _alive(proc: tuple[int, int]) -> bool:
    """Whether the process ``(pid, start time)`` still runs (its pid neither ended nor reused by another)."""
    return _start_time(proc[0]) == proc[1]


def _signal(proc: tuple[int, int], signum: int) -> None:
    """Send ``signum`` to the process ``(pid, start time)`` if it is still that process: through a pidfd opened
    first and checked after (``os.pidfd_open``, Linux 5.3), so a pid reused between the check and the signal is never
    hit."""
    try:
        fd = os.pidfd_open(proc[0])
    except ProcessLookupError:  # ended
        return
    try:
        if _alive(proc):  # the pidfd names the process found, not one started later under its pid
            signal.pidfd_send_signal(fd, signum)
    except ProcessLookupError:  # ended after the check
        pass
    finally:
        os.close(fd)


#: the AdamW steps of a launch whose runs are all float32 (and of its references): a step is ~0.25 s per layout of a
#: 4-process tiny launch on 2 cores, ~2/3 of a 10-step launch; each file writes the largest difference it measured
#: beside its tolerance. A launch with bf16 runs trains tests/test_parity.py's STEPS (10): in fewer a bf16 norm
#: weight does not move by one bf16 spacing
FLOAT32_STEPS = 5
#: the AdamW steps of a launch with bf16 runs, and of the float32 reference they are compared with
BF16_STEPS = 10


def max_relative(values: list[float], ref: list[float], steps: int) -> float:
    """The largest ``|v − r| / |r|`` over per-step values (losses, aux losses, gradient norms) of a run and its
    reference, after checking that both hold ``steps`` values."""
    assert len(values) == len(ref) == steps, (len(values), len(ref), steps)
    return max(abs(x - y) / abs(y) for x, y in zip(values, ref))


def run_layouts(
    out: Path, nproc: int, layouts: list[dict], *extra: str, steps: int = 10, layers: int | None = None
) -> Path:
    """Train every layout of ``layouts`` (``run_layouts.py`` layout dicts) in one launch of ``nproc`` processes
    (``nproc == 1``: one process, no torchrun), ``steps`` steps of the tiny-test Llama (``layers``: its
    ``--layers``), ``extra``: more ``run_layouts.py`` arguments (``--resume-check``). Returns ``out``, the folder of
    the records (:func:`layout_results` reads them)."""
    import json

    args = ["--out", str(out), "--steps", str(steps), *(["--layers", str(layers)] if layers else [])]
    torchrun(nproc, SCRIPTS / "run_layouts.py", *args, "--layouts", json.dumps(layouts), *extra, timeout=900)
    return out


def layout_world(layout: dict) -> int:
    """The number of processes of a ``run_layouts.py`` layout: pp·dp·cp·tp (ep is carved out of dp·cp), 1 for the
    reference."""
    if layout.get("reference"):
        return 1
    return layout.get("pp", 1) * layout.get("dp", 1) * layout.get("cp", 1) * layout.get("tp", 1)


def layout_results(out: Path, layouts: list[dict], head_copies: bool = False) -> list[tuple]:
    """``(layout, rank records, full final weights)`` per layout of a :func:`run_layouts` launch in ``out``, after
    checking one record per rank and, under pp, one weight file per rank (each pipeline rank saved the layers it
    holds; a tensor held by several ranks (dp/tp replicas) must be identical on each). ``head_copies``: tied
    embeddings: the last stage's copy of the tied weight (``output.weight`` under pp) is kept apart, the tuples get a
    fourth element, the list of those copies."""
    import json

    results = []
    for i, layout in enumerate(layouts):
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob(f"layout{i}_rank*.json"))]
        world = layout_world(layout)
        assert sorted(r["rank"] for r in ranks) == list(range(world)), (layout, len(ranks))
        weights, copies = merged_weights(out, f"layout{i}", layout, head_copies)
        results.append((layout, ranks, weights, copies) if head_copies else (layout, ranks, weights))
    return results


def merged_weights(out: Path, prefix: str, layout: dict, head_copies: bool = False) -> tuple[dict, list]:
    """The full final weights ``run_layouts.py`` saved as ``<prefix>_weights.pt`` (rank 0), or under pp as one
    ``<prefix>_weights_rank<r>.pt`` per rank (each rank's stages; asserted: one per rank of ``layout``), merged: a
    tensor held by several ranks (dp/tp replicas) must be identical on each. Returns ``(weights by canonical name,
    the last stage's copies of a tied weight)``: with ``head_copies``, ``output.weight`` under pp goes to the copies."""
    import torch

    stage_files = sorted(out.glob(f"{prefix}_weights_rank*.pt"))
    assert len(stage_files) == (layout_world(layout) if layout.get("pp", 1) > 1 else 0), (layout, len(stage_files))
    weights: dict[str, torch.Tensor] = {}
    copies: list[torch.Tensor] = []
    for path in stage_files or [out / f"{prefix}_weights.pt"]:
        for key, value in torch.load(path).items():
            if head_copies and key == "output.weight" and layout.get("pp", 1) > 1:
                copies.append(value)
                continue
            if key in weights:  # the same parameter on another dp/tp rank of the stage: identical
                assert torch.equal(weights[key], value), key
            weights[key] = value
    return weights, copies


#: the folders of :func:`launched`, by its arguments
_LAUNCHED: dict[str, Path] = {}


def launched(tmp_path_factory, name: str, nproc: int, *args: str) -> Path:
    """``run_layouts.py ARGS`` on ``nproc`` processes in a new folder named ``name``, launched once per pytest
    session for the same arguments (several files compare with the same single-process reference runs); returns the
    folder (its files must not be modified)."""
    import json

    key = json.dumps([nproc, args])
    if key not in _LAUNCHED:
        out = tmp_path_factory.mktemp(name)
        torchrun(nproc, SCRIPTS / "run_layouts.py", "--out", str(out), *args, timeout=900)
        _LAUNCHED[key] = out
    return _LAUNCHED[key]


def launched_by_precision(
    tmp_path_factory, name: str, nproc: int, layouts: list[dict], bf16_steps: int, *args: str
) -> list[tuple[Path, int]]:
    """:func:`launched` of ``run_layouts.py ARGS --steps N --layouts ...`` split by precision: the float32 rows of
    ``layouts`` train FLOAT32_STEPS in one launch, the bf16 rows ``bf16_steps`` in another (named ``name_bf16``; in
    fewer steps a bf16 norm weight does not move by one bf16 spacing); no launch for no row. Returns ``(folder, index
    of the layout in that folder's launch)`` per layout of ``layouts``, in their order."""
    import json

    def bf16(layout: dict) -> bool:
        return layout.get("precision", "32-true").startswith("bf16")

    where: list[tuple[bool, int]] = []
    rows: dict[bool, list[dict]] = {False: [], True: []}
    for layout in layouts:
        where.append((bf16(layout), len(rows[bf16(layout)])))
        rows[bf16(layout)].append(layout)
    folders = {
        half: launched(
            tmp_path_factory,
            name + ("_bf16" if half else ""),
            nproc,
            *args,
            "--steps",
            str(bf16_steps if half else FLOAT32_STEPS),
            "--layouts",
            json.dumps(group),
        )
        for half, group in rows.items()
        if group
    }
    return [(folders[half], i) for half, i in where]


#: the results of :func:`trained`, by its arguments: one launch per pytest session for the same runs
_TRAINED: dict[str, list[tuple]] = {}


def trained(tmp_path_factory, name: str, nproc: int, layouts: list[dict], *extra: str, **kw) -> list[tuple]:
    """:func:`layout_results` of :func:`run_layouts` (``kw``: its ``steps``, ``layers``; ``head_copies``) in a new
    folder named ``name``, launched once per pytest session for the same arguments: several test files compare with
    the same single-process reference runs, which run once (the results must not be modified)."""
    import json

    head_copies = kw.pop("head_copies", False)
    key = json.dumps([nproc, layouts, extra, sorted(kw.items()), head_copies])
    if key not in _TRAINED:
        out = run_layouts(tmp_path_factory.mktemp(name), nproc, layouts, *extra, **kw)
        _TRAINED[key] = layout_results(out, layouts, head_copies=head_copies)
    return _TRAINED[key]


def resume_on_layouts(
    out: Path,
    saved: dict,
    other: dict | list[dict],
    model: str,
    steps: int,
    nproc: int = 2,
    resume_saved: bool = True,
) -> list[tuple]:
    """Train ``steps`` steps straight on layout ``saved`` (a ``run_layouts.py`` layout dict with a ``"name"``), and
    ``steps // 2`` with a sharded checkpoint; resume that checkpoint on ``other`` (a layout, or several, each with a
    ``"name"`` of its own) and, with ``resume_saved``, on ``saved`` too, to ``steps``. Returns ``(layout, rank,
    resumed losses, the straight run's losses of the same steps)`` per resumed layout and rank."""
    import json
    import shutil

    others = [other] if isinstance(other, dict) else list(other)
    resumed = ([saved] if resume_saved else []) + others
    common = ["--model", model, "--steps", str(steps), "--out", str(out)]
    torchrun(nproc, SCRIPTS / "run_layouts.py", *common, "--reshard", "first", "--layouts", json.dumps([saved]))
    for layout in others:
        shutil.copytree(out / saved["name"], out / layout["name"])
    torchrun(nproc, SCRIPTS / "run_layouts.py", *common, "--reshard", "resume", "--layouts", json.dumps(resumed))
    rows = []
    for rank in range(nproc):
        tail = json.loads((out / f"{saved['name']}_first_rank{rank}.json").read_text())["straight"][steps // 2 :]
        for layout in resumed:
            second = json.loads((out / f"{layout['name']}_resume_rank{rank}.json").read_text())
            rows.append((second["layout"], rank, second["resumed"], tail))
    return rows


def measure_json(*args: str) -> tuple[dict, dict]:
    """Run ``lightning-4d measure ARGS --json`` (one rank on the fake process group, live CPU tensor bytes); return
    its JSON object and its rows by component, after checking that the model states are estimated exactly."""
    import json

    proc = python_run("-m", "lightning_4d", "measure", *args, "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    rows = {r["component"]: r for r in out["rows"]}
    for key in ("parameters", "gradients", "optimizer_states"):
        assert rows[key]["estimated"] == rows[key]["measured"], key
    return out, rows


def final_weights(out: Path, index: int) -> dict:
    """The final full float32 weights rank 0 of ``run_layouts.py`` saved for layout ``index`` in ``out``, by
    canonical name."""
    import torch

    path = out / f"layout{index}_weights.pt"
    assert path.is_file(), f"{path} missing: run_layouts.py saves it on rank 0 after training"
    return torch.load(path)


def initial_weights(model: str, config: dict | None = None) -> dict:
    """The float32 weights before the first step of ``run_layouts.py``'s model (init seed 7) with the model-config
    overrides ``config``, by canonical name."""
    from lightning_4d.models import LlamaConfig
    from lightning_4d.models.llama import LlamaModel, canonical_name

    built = LlamaModel(LlamaConfig.from_preset(model, **(config or {})), init_seed=7)
    return {canonical_name(n): p.detach().clone() for n, p in built.named_parameters()}


def update_errors(weights: dict, ref: dict, initial: dict, bf16: bool = False) -> dict:
    """How far ``weights`` are from ``ref``, both trained from ``initial`` (the same names and shapes), per parameter:
    ``‖w − w_ref‖ / ‖w_ref − w0‖`` (L2 over the parameter's elements): the difference relative to the reference's
    update, so 1 for a parameter that never trained, whatever its scale (norm weights near 1.0 move by 0.4% in 10
    steps). ``bf16``: ``w`` and ``w_ref`` rounded to bfloat16 first (ZeRO 3 keeps float32 masters where ZeRO 0/1
    keep bf16 weights)."""
    import torch

    assert set(weights) == set(ref) == set(initial), set(weights) ^ set(ref) ^ set(initial)
    errors = {}
    for name, r in ref.items():
        w = weights[name]
        assert w.shape == r.shape == initial[name].shape, (name, w.shape, r.shape)
        if bf16:
            w, r = w.to(torch.bfloat16).float(), r.to(torch.bfloat16).float()
        update = (r - initial[name]).norm().item()
        assert update > 0, f"{name}: the reference never trained it"
        errors[name] = (w - r).norm().item() / update
    return errors


def check_final_weights(
    out: Path, index: int, ref_out: Path, ref_index: int, initial: dict, rtol: float, vector_rtol: float | None = None
) -> None:
    """Layout ``index``'s final weights in ``out`` against the reference run's (``ref_index`` in ``ref_out``), both
    from ``initial``: every matrix's :func:`update_errors` within ``rtol``, every vector's (1-D: norm weights)
    within ``vector_rtol`` (default ``rtol``); ``vector_rtol`` given means a bf16 run (both rounded to bf16). Prints
    the largest of each kind."""
    bf16 = vector_rtol is not None
    errors = update_errors(final_weights(out, index), final_weights(ref_out, ref_index), initial, bf16)
    line = f"{out.name} layout {index}: final weights' difference relative to the reference's update:"
    for kind, bound in (("matrix", rtol), ("vector", rtol if vector_rtol is None else vector_rtol)):
        names = [k for k in errors if (initial[k].ndim > 1) == (kind == "matrix")]
        worst = max(names, key=errors.get)
        print(f"{line} max {kind} {errors[worst]:.2e} ({worst})")
        assert errors[worst] <= bound, (worst, errors[worst], bound)
