"""Record a rank's exit status where a test can read it: torchrun runs this in place of the user's script.

    torchrun ... exit_status.py STATUS_DIR SCRIPT [ARGS...]

runs ``python SCRIPT ARGS...`` as a child with this process's environment, passes SIGTERM and SIGINT on to it
(torchrun signals only the processes it started), waits, writes the child's exit status to
``STATUS_DIR/rank<RANK>.status`` (``-N``: killed by signal N) and exits with it. torchrun itself reports no
statuses once it was signalled, and a shell would add a process of its own: this adds nothing else.

Kept a script, not a case of run.py: it is a launcher's shim around the user's command (a process torchrun starts
that exits with its child's status), not code run on a rank for a result.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def main() -> None:
    status_dir, script, *args = sys.argv[1:]
    child = subprocess.Popen([sys.executable, script, *args])
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    status = child.wait()
    Path(status_dir, f"rank{os.environ.get('RANK', '0')}.status").write_text(str(status))
    sys.exit(status if status >= 0 else 128 - status)


if __name__ == "__main__":
    main()
