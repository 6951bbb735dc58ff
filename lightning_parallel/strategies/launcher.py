"""Lightning's subprocess launcher, with two changes for the mesh strategies.

- The model is checked in the launching process first: a model the layout cannot split would otherwise re-run
  the whole script on every rank before failing the same way.
- The watcher of the child processes is patient. Lightning's kills every process, the launching one included,
  the moment it sees a child fail (it looks every 5 s), often before the launching rank, whose collective failed
  with it, has said which rank failed and why. Ours gives the launching process ``grace_s`` to end by itself
  (it raises, names the first failure, and ends the children: ``MeshStrategy.on_exception``), and kills only
  what is left after that.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning.pytorch.core.module import LightningModule
from typing_extensions import override

from lightning_parallel._compat import SubprocessScriptLauncher, set_num_threads_if_needed


class PatientObserver(threading.Thread):
    """Watches the child ranks from the launching process; when one fails and the launching process has not ended
    ``grace_s`` later, kills the children and the launching process (so nothing is left waiting forever)."""

    def __init__(self, children: list[subprocess.Popen], grace_s: float, poll_s: float = 0.5) -> None:
        super().__init__(daemon=True, name="lightning-parallel-child-observer")  # ends with the process
        self.children, self.grace_s, self.poll_s = children, grace_s, poll_s
        self.main_pid = os.getpid()

    @override
    def run(self) -> None:
        failed_at: float | None = None
        while True:
            codes = [child.poll() for child in self.children]
            if all(code == 0 for code in codes):
                return
            if failed_at is None and any(code for code in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > self.grace_s:
                for child in self.children:
                    if child.poll() is None:
                        child.send_signal(signal.SIGKILL)
                os.kill(self.main_pid, signal.SIGKILL)
                return
            time.sleep(self.poll_s)


class CheckFirstLauncher(SubprocessScriptLauncher):
    """Lightning's launcher for ``devices=N`` in a plain script; ``strategy`` checks the model first and says
    how long a failed run may take to end (``grace_s``)."""

    def __init__(self, strategy: Any, *args: Any, grace_s: float = 10.0) -> None:
        super().__init__(*args)
        self._strategy = strategy
        self.grace_s = grace_s

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        model = args[0] if args else None  # fit, validate, test and predict take the model first
        if isinstance(model, LightningModule):
            self._strategy.check_model(model)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            PatientObserver(self.procs, self.grace_s).start()
        set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)
