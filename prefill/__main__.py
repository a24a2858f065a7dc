"""``python -m prefill``: run one prefill worker (see prefill/server.py and ``--help``)."""

from mooncake.runtime.process import exit_process
from prefill.server import main

if __name__ == "__main__":
    exit_process(main())
