"""``python -m lmdock``: the same CLI as the ``lmdock`` command."""

from lmdock._cli.main import main

raise SystemExit(main())
