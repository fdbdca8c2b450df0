"""`python -m gradaccum.cli`: the same as the `gradaccum` command."""

from gradaccum.cli import main

raise SystemExit(main())
