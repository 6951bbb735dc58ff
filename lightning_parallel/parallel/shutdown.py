"""Release the process groups before the interpreter shuts down, so that a run that finished exits 0.

Why a finished run aborted (from a core of one: ``gdb``, ``thread apply all bt``): a gloo worker thread
(``ProcessGroupGloo::runLoop``) drops the last reference to a finished collective's work, and with it tensors
that are Python objects; that needs the GIL. A gloo process group sits in reference cycles, so nothing frees
it before the garbage collection inside ``Py_FinalizeEx``: its destructor then joins the worker threads, a
worker that asks for the GIL during finalization is ended by Python (``pthread_exit``) inside C++ code that
cannot unwind, and the process dies with "terminate called without an active exception" (SIGABRT, -6) after
all its work is done: 3 of 40 two-process fits under torchrun here. Under torchrun that turns a finished
job into a failed one (with ``--max-restarts``, a restarted one); under SLURM the job is marked failed.

:func:`release_at_exit` registers, once per process, an ``atexit`` handler that destroys every process group
(the default one and all the mesh's) and collects the garbage that holds them, while the interpreter is still
whole: their destructors join gloo's threads then, and a thread that needs the GIL gets it. ``atexit``
handlers run after ``main`` returned or raised and after non-daemon threads were joined, before finalization.
The exit status is untouched: 0 after a finished run, the code of a ``SystemExit``. A process that an uncaught
exception ends is left as before (its status is non-zero either way): freeing a group joins gloo's threads,
and one still inside a collective with a peer would hold this rank until the timeout, where ending at once
lets the peers see the connection close and fail fast, naming this rank (``failure.py``). torch asks scripts
to call ``destroy_process_group()`` themselves; a Lightning user never does, and Lightning's strategies leave
the groups to interpreter shutdown. Pure torch: no Lightning here.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
import threading
import time

import torch.distributed as dist

from lightning_parallel.parallel import strict

_registered = False
# A group that torch's functional collectives (DTensor) used outlives destroy_process_group (torch 2.13 keeps
# it referenced from C++), so its gloo worker threads live into finalization. A worker drops a finished
# collective's work (tensors that are Python objects: it needs the GIL) after the waiting thread has moved on;
# when the main thread reaches Py_FinalizeEx first, the worker is ended inside C++ and the process aborts
# (seen: 1 of 15 two-rank pp runs, from a core: ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork -> take_gil
# -> pthread_exit -> std::terminate). Sleeping here, the GIL released, lets every such worker finish first.
_DRAIN_S = 0.1


def release_at_exit() -> None:
    """Shut the process groups down when this process exits (registered once, whatever the number of calls)."""
    global _registered
    if not _registered:
        atexit.register(release_process_groups)
        _registered = True


def release_process_groups() -> None:
    """Destroy every process group this process holds and free them (their gloo threads end), with Ctrl+C held
    off; a failure here is reported on stderr and does not change the exit status (the work is done by now)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if _ending_on_an_exception():
        strict.abandon()  # the others' end-of-run check stops waiting for this rank
        return
    _check_strict_traces()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    try:
        dist.destroy_process_group()
        gc.collect()  # the groups live in reference cycles: freed now, not inside finalization
        time.sleep(_DRAIN_S)  # the GIL left free: gloo workers drop their last works now (see _DRAIN_S)
    except Exception as error:  # noqa: BLE001 - nothing is left to protect but the exit status
        print(f"lightning_parallel: releasing the process groups at exit failed: {error!r}", file=sys.stderr)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _check_strict_traces() -> None:
    """Strict mode: compare the traces of the collectives issued since the last check; a difference ends the process
    with status 1 (an exception raised at exit would leave it 0)."""
    try:
        strict.check("the end of the process")
    except strict.StrictCollectiveError as error:
        print(f"lightning_parallel strict mode: {error}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def _ending_on_an_exception() -> bool:
    """Whether an uncaught exception ends the process (Python sets ``sys.last_*`` when it prints it)."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None
