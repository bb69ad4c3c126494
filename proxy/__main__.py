"""``python -m proxy`` runs the ``opgate`` command."""

from proxy.cli import main

raise SystemExit(main())
