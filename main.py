"""`python main.py ...` is the same as the `offspec` command."""

import sys

from offspec.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
