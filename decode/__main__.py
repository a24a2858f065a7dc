"""``python -m decode``: run one decode worker (see decode/server.py and ``--help``)."""

from decode.server import main
from mooncake.runtime.process import exit_process

if __name__ == "__main__":
    exit_process(main())
