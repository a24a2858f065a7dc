"""``python -m decode``: run one decode worker (see decode/server.py and ``--help``)."""

import sys

from decode.server import main

if __name__ == "__main__":
    sys.exit(main())
