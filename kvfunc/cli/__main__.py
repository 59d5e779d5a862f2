"""``python -m kvfunc.cli`` runs the ``kvfunc`` command."""

import sys

from kvfunc.cli import main

if __name__ == "__main__":
    sys.exit(main())
