"""Start the ranks of a test launch as children of a process that imported torch, Lightning and lightning_4d once per
pytest session: the standard library's ``multiprocessing`` forkserver with ``set_forkserver_preload``.

Why: a fresh interpreter pays ~5.8 CPU-s to import ``lightning_4d.strategy`` and ``lightning.pytorch`` (torch 1.5 s,
Lightning, torchmetrics and Dynamo ~3.7 s), so a 4-rank launch under ``torchrun`` paid ~23 CPU-s of imports plus the
launcher's own interpreter before its first step; a forked child starts with them imported.

Each rank is a forked child of the forkserver (never of pytest: it inherits no pytest state, no capture, no
monkeypatch) that sets what ``torchrun --standalone`` gives a worker (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` on a free port, ``TORCHELASTIC_RUN_ID``:
Lightning then picks its ``TorchElasticEnvironment``), points its fds 1 and 2 at the launch's output files (opened
for appending, so the ranks' lines interleave in the order written, as they do in torchrun's one stdout and stderr)
and runs the script as ``__main__`` with ``runpy.run_path``.

Fork safety: the forkserver only imports (``preload``); it runs no torch op, so no OpenMP or intra-op thread pool
exists when it forks (measured: one thread after the imports, ``/proc/<pid>/task``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import resource
import runpy
import signal
import socket
import sys
import uuid
from multiprocessing.connection import wait
from pathlib import Path

#: what the forkserver imports before its first fork: what the launched scripts import (``tests/scripts``)
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "lightning",
    "lightning.pytorch",
    "lightning_4d",
    "lightning_4d.strategy",
    "lightning_4d.tasks",
    "lightning_4d.data",
    "lightning_4d.measure",
    "lightning_4d.models.llama",
    "lightning_4d.cli",
    # imported by some launches' ranks only: once here instead of once per rank (measured on 2 cores, after the
    # modules above: 0.65 CPU-s, 0.9 CPU-s and 0.3 CPU-s per rank); the forkserver skips a module it cannot import
    # (an extra not installed), and none of the three starts a thread (checked: one thread after them). Their
    # objects made every rank's garbage collections longer: test_reshard's dp2z1 -> dp4z3 took 64.3 s and 65.0 s
    # with them, 56.5 s and 53.8 s without, 53.9 s with them frozen (the last module)
    "transformers.models.llama.modeling_llama",  # the transformers Llama launches (tests/scripts/hf_llama_4d.py)
    "torch._inductor.compile_fx",  # compile=True
    "torchao.float8",  # float8=...
    "tests._forkserver_frozen",  # last: gc.freeze() over all of the above
]

#: the variables read when the interpreter starts or torch and lightning_4d are imported: a forked rank inherits
#: the forkserver's imports, so a launch must agree with the forkserver on each (checked at every launch). A chosen
#: list: others torch reads at import (``TORCH_LOGS``, ``TORCHINDUCTOR_*``) are not checked, and no test sets them
#: per launch
IMPORT_TIME = ("PYTHONPATH", "PYTHONWARNINGS", "PYTHONHASHSEED", "OMP_NUM_THREADS", "MKL_NUM_THREADS")

#: what :func:`rank_envs` sets per launch or per rank, beside the ``GROUP_*``, ``ROLE_*`` and ``TORCHELASTIC_*``
#: variables (never given to the forkserver)
LAUNCH_KEYS = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def without_launch_variables(env: dict[str, str]) -> dict[str, str]:
    """``env`` less what is particular to one launch or rank (:data:`LAUNCH_KEYS`, ``GROUP_*``, ``ROLE_*``,
    ``TORCHELASTIC_*``)."""
    prefixes = ("GROUP_", "ROLE_", "TORCHELASTIC_")
    return {k: v for k, v in env.items() if k not in LAUNCH_KEYS and not k.startswith(prefixes)}


_CONTEXT: multiprocessing.context.BaseContext | None = None
_SERVER_ENV: dict[str, str] = {}


def context(env: dict[str, str]) -> multiprocessing.context.BaseContext:
    """The forkserver context, its server started (once per process) with the launch's environment ``env`` less what
    is particular to one launch or rank (:func:`without_launch_variables`): the workers' own, as
    ``OMP_NUM_THREADS=1`` and ``PYTHONPATH`` must hold when it imports torch and lightning_4d.

    Raises:
        RuntimeError: a later launch's ``env`` differs from the server's in a variable of :data:`IMPORT_TIME` (its
            ranks would run with the server's imports, not the ones asked for).
    """
    global _CONTEXT, _SERVER_ENV
    server_env = without_launch_variables(env)
    if _CONTEXT is None:
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(server_env)
        try:
            with _no_main():
                forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _CONTEXT, _SERVER_ENV = ctx, server_env
    differ = [k for k in IMPORT_TIME if env.get(k) != _SERVER_ENV.get(k)]
    if differ:
        raise RuntimeError(
            f"a forked launch asks for {', '.join(f'{k}={env.get(k)!r}' for k in differ)} but the test forkserver "
            f"imported with {', '.join(f'{k}={_SERVER_ENV.get(k)!r}' for k in differ)}: launch it with "
            "subprocess (a fresh interpreter) or L4D_TEST_LAUNCHER=torchrun."
        )
    return _CONTEXT


def free_port() -> int:
    """A TCP port free on this host now (the kernel's pick, as ``torchrun --standalone`` does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_envs(nproc: int, env: dict[str, str]) -> list[dict[str, str]]:
    """Each rank's environment: ``env`` plus what torchrun ``--standalone --nproc-per-node nproc`` sets for a worker
    (none of it for ``nproc == 1``: a plain ``python script``)."""
    if nproc == 1:
        return [dict(env)]
    common = {
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(nproc),
        "TORCHELASTIC_RUN_ID": str(uuid.uuid4()),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }
    return [{**env, **common, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(nproc)]


def run_rank(argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """The body of one forked rank: ``python ARGV`` (``argv[0]``: the script, ``-m`` and a module, or ``-c`` and
    code) with environment ``env`` in ``cwd``, its output appended to the files ``stdout`` and ``stderr``. Never
    returns."""
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file from the SIGABRT of a launch's limit
    faulthandler.enable()  # PYTHONFAULTHANDLER is read at interpreter start: a fatal signal prints every stack
    sys.argv = list(argv)
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, cwd)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))  # what ``python script`` puts first
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = _exit_status(e.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # torch.distributed's: each line prefixed with "[rank<r>]: "
        code = 1
    from lightning_4d.parallel._compat.process import exit_distributed_process

    exit_distributed_process(code)


def _exit_status(code: object) -> int:
    """The exit status of ``sys.exit(code)``, as the interpreter makes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def start(argvs: list[list[str]], envs: list[dict[str, str]], cwd: Path, out: Path) -> list:
    """Start one forked rank per ``argvs[i]``/``envs[i]``, all appending to ``out/stdout`` and ``out/stderr``;
    returns the started ``multiprocessing`` processes."""
    ctx = context(envs[0])
    procs = []
    for argv, env in zip(argvs, envs):
        p = ctx.Process(target=run_rank, args=(argv, env, str(cwd), str(out / "stdout"), str(out / "stderr")))
        with _no_main():
            p.start()
        procs.append(p)
    return procs


@contextlib.contextmanager
def _no_main():
    """An empty ``__main__`` while ``multiprocessing`` reads it: a child re-imports the parent's main module (pytest's
    entry script) unless it has neither a ``__spec__`` nor a ``__file__``."""
    import types

    saved = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = saved


def join(procs: list, timeout: float, deadline_clock) -> tuple[int | None, str]:
    """Wait for every process of ``procs`` (``procs[i]`` is rank ``i``); the first to fail ends the others (SIGTERM,
    SIGKILL 30 s later), as torchrun does. Returns the launch's exit status (0, or the first failure's: a signal's as
    ``128 + signum``), ``None`` when ``timeout`` seconds (``deadline_clock``: ``time.monotonic``) passed first, and
    which process failed first (``"rank 3 (signal SIGKILL)"``, ``"rank 1 (exit code 1)"``; ``""`` when none did):
    the others' errors are usually the lost connection to it."""
    end = deadline_clock() + timeout
    failed: int | None = None
    first = ""
    left = list(procs)
    while left:
        remaining = end - deadline_clock()
        if remaining <= 0 and failed is None:
            return None, first
        if remaining <= 0:  # the others outlived the 30 s after the first failure
            for q in left:
                with contextlib.suppress(ProcessLookupError):
                    q.kill()
            remaining = None
        for sentinel in wait([p.sentinel for p in left], timeout=remaining):
            p = next(q for q in left if q.sentinel == sentinel)
            p.join()
            left.remove(p)
            if p.exitcode != 0 and failed is None:
                failed = p.exitcode if p.exitcode > 0 else 128 - p.exitcode
                how = f"exit code {p.exitcode}" if p.exitcode > 0 else f"signal {signal.Signals(-p.exitcode).name}"
                first = f"rank {procs.index(p)} ({how})"
                for q in left:
                    with contextlib.suppress(ProcessLookupError):
                        q.terminate()
                end = min(end, deadline_clock() + 30)
    return failed or 0, first
