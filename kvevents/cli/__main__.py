"""``python -m kvevents.cli``: the same as the ``kvevents`` command."""

from kvevents.cli.main import main

raise SystemExit(main())
