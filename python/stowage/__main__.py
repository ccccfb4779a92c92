"""``python -m stowage ...``: the ``stowage`` command line (``unit``,
``local``, ``bench``, ``stats``), run by the extension module, so that a
Python installation needs no separate binary.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import List, Optional

from . import _native


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``) and
    return its exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    # `stowage local` and `stowage bench` start units as child processes:
    # with this interpreter, not with the (absent) `stowage` binary.
    if " " not in sys.executable:
        os.environ.setdefault("STOWAGE_UNIT_COMMAND", f"{sys.executable} -m stowage unit")
    # The command runs in Rust without the GIL, so Python's SIGINT handler
    # would never get to raise KeyboardInterrupt: let Ctrl-C end the
    # process as it ends the native binary.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return _native.main(["stowage", *args])


def console() -> None:
    """Entry point of the ``stowage`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    console()
