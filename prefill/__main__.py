"""``python -m prefill``: run one prefill worker (see prefill/server.py and ``--help``)."""

import sys

from prefill.server import main

if __name__ == "__main__":
    sys.exit(main())
