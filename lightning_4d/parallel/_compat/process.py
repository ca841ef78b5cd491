"""The process: leaving it without interpreter finalization, recording its CUDA allocator's events and its
collectives, the store of a worker torchrun restarted, and a process group's timeout."""

from __future__ import annotations

import atexit
from typing import TYPE_CHECKING, Any, NoReturn, Optional

if TYPE_CHECKING:
    from datetime import timedelta

    from torch.distributed import Store


def exit_distributed_process(code: int = 0) -> NoReturn:
    """End a process that used gloo process groups without CPython's interpreter finalization.

    Why: a gloo worker thread drops its reference to a finished collective *after* the caller's ``wait()`` returns;
    when that is the last reference it releases the collective's tensors, which needs the GIL. A thread that asks for
    the GIL while CPython finalizes is ended by ``pthread_exit``, whose unwinding through torch's ``noexcept`` work
    destructor calls ``std::terminate``: the process aborts with SIGABRT ("terminate called without an active
    exception") after a correct run. Core dump of one such abort (torch 2.13.0, Python 3.11, a 2-rank Lightning fit,
    1 run in 5 on 2 busy cores): main thread in ``Py_FinalizeEx``'s last garbage collection, a
    ``ProcessGroupGloo::runLoop`` thread in ``~AsyncAllgatherWork`` -> ``take_gil`` -> ``PyThread_exit_thread``
    (pytorch/pytorch#179291 describes the same). ``destroy_process_group`` does not join those threads (measured:
    they live until the last Python reference to the group, e.g. a ``DeviceMesh``, dies).

    So this flushes ``sys.stdout``/``sys.stderr``, runs the ``atexit`` handlers (Lightning's destroys the process
    group, ``logging`` flushes its handlers) while the interpreter is whole, and leaves with ``os._exit(code)``.

    Args:
        code: the process exit status.

    Raises:
        Nothing: it does not return.
    """
    import os
    import sys

    atexit._run_exitfuncs()  # the registered exit handlers, now, last registered first (CPython, undocumented)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # a closed or replaced stream has nothing left to write
            pass
    os._exit(code)


def record_cuda_memory_history(enabled: bool, max_entries: int = 200_000) -> None:
    """Start (``enabled``) or stop recording every CUDA caching-allocator event with its Python and C++ stack:
    ``torch.cuda.memory._record_memory_history`` (PyTorch's "Understanding CUDA Memory Usage" guide; private name).
    ``max_entries``: the newest events kept."""
    from torch.cuda import memory

    if enabled:
        memory._record_memory_history(enabled="all", max_entries=max_entries)
    else:
        memory._record_memory_history(enabled=None)


def cuda_memory_snapshot() -> dict:
    """The recorded allocator state and event trace: ``torch.cuda.memory._snapshot()`` (private name), a dict with
    ``segments`` and ``device_traces`` (per device, events with ``action`` ("alloc", "free_completed", ...), ``addr``,
    ``size`` in bytes and ``frames``)."""
    from torch.cuda import memory

    return memory._snapshot()


def set_process_group_timeout(group: Any, timeout: "timedelta") -> None:
    """Make ``timeout`` the limit of every later operation of ``group`` (this rank's gloo or NCCL backend of it):
    ``torch.distributed.distributed_c10d._set_pg_timeout`` (private name; torchtitan's ``set_pg_timeouts`` calls it
    for each group of its mesh).

    Why: ``init_process_group(timeout=...)`` sets the default group's limit only; ``new_group`` and ``DeviceMesh``
    give every other group torch's default (30 minutes for gloo, 10 for NCCL; measured on 4 gloo ranks of a 2 x 2
    mesh with a 3-s default group: a tp all-reduce waited 10 s for a sleeping peer, and failed after 3.0 s once set).

    Raises:
        ValueError: this rank is not in ``group`` (torch's check).
    """
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def process_group_timeout(group: Any) -> "timedelta":
    """The limit of each operation on ``group`` (what :func:`set_process_group_timeout` or ``init_process_group``
    set): its backend's ``options._timeout`` (private name) for the group's first device type; the tests read it.

    Raises:
        AttributeError: a backend without ``options`` (a fake or a custom one).
    """
    return group._get_backend(group._device_types[0]).options._timeout


def process_group_count() -> int:
    """How many process groups this process has made and not destroyed: ``torch.distributed.distributed_c10d
    ._world.pg_map`` (private name; the default group and every ``new_group`` and ``DeviceMesh`` dimension's). 0
    before ``init_process_group``."""
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


#: the environment variable that makes torch's flight recorder keep this many of each process group's newest
#: collectives (read when a group is made: set it before ``init_process_group``)
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"


def collective_trace() -> tuple[bytes, dict[str, list[int]]]:
    """This process's collectives as torch's flight recorder kept them (:data:`FLIGHT_RECORDER_ENV` set before the
    process groups were made; gloo records collectives, not send/recv), as the pickle of a dict of plain data whose
    ``"entries"`` are oldest first (read it with :func:`lightning_4d.safe_load.loads_plain`: the package unpickles
    through ``safe_load`` only), and the global ranks of each live process group by name.

    Each entry: ``process_group`` ``(name, description)``, ``collective_seq_id`` (1, 2, ... per group),
    ``profiling_name`` (``"gloo:all_reduce"``), ``input_sizes`` / ``input_dtypes``, ``thread_name`` (the thread that
    issued it) and ``frames`` (its Python stack, innermost first: ``name``, ``filename``, ``line``).
    ``torch._C._distributed_c10d._dump_fr_trace`` (a pickled dict) and ``distributed_c10d._world.pg_names`` (private
    names)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace
    from torch.distributed import distributed_c10d

    groups = {name: dist.get_process_group_ranks(pg) for pg, name in distributed_c10d._world.pg_names.items()}
    return _dump_fr_trace(), groups


def restarted_worker_store(timeout: "timedelta") -> Optional["Store"]:
    """A store of this torchrun attempt's own for ``init_process_group`` in a worker torchrun restarted
    (``--max-restarts``: ``TORCHELASTIC_RESTART_COUNT`` > 0, with torchrun's agent store); ``None`` otherwise (the
    first attempt, or another launcher: the default ``env://`` rendezvous applies).

    Why: torchrun (torch 2.13, ``--standalone`` / c10d rendezvous) hands its workers the agent's ``TCPStore``
    (``TORCHELASTIC_USE_AGENT_STORE=True``), and ``torch.distributed.rendezvous._create_c10d_store`` no longer prefixes
    the keys per attempt ("We create a new TCPStore for every retry"), yet the agent keeps the same store across
    restarts: a restarted gloo rank reads the previous attempt's peer addresses and fails ("Gloo connectFullMesh
    failed ... Connection refused"; measured with a plain 4-rank ``init_process_group("gloo")`` script whose rank 1
    exits once). Keys prefixed by the attempt (``/lightning_4d/attempt_<n>/``, as earlier torch versions did with
    ``/worker/attempt_<n>``) are fresh on every restart.

    Args:
        timeout: the store's timeout (the process group's).
    """
    import os

    from torch.distributed import PrefixStore, TCPStore

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restart == 0:
        return None
    world_size = int(os.environ["WORLD_SIZE"])
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, False, timeout=timeout)
    return PrefixStore(f"/lightning_4d/attempt_{restart}", store)
