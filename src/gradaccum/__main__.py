"""`python -m gradaccum`: the same as the `gradaccum` command."""

from gradaccum.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
