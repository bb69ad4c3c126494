"""``python -m proxy`` runs the ``opgate`` command."""

import signal
import sys

if sys.argv[1:2] == ["serve"]:  # SIGHUP never ends it: from before opgate's imports (cli.main)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

from proxy.cli import main

raise SystemExit(main())
