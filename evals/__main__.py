"""`python -m evals ...` is the `decodekit` command."""

import sys

from evals.cli import main

if __name__ == "__main__":
    sys.exit(main())
