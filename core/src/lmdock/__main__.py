"""``python -m lmdock``: the same CLI as the ``lmdock`` command."""

from lmdock._cli import main

raise SystemExit(main())
