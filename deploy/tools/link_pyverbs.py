"""Make the distribution's pyverbs importable in this virtual environment (``make rdma`` runs it).

pyverbs ships with rdma-core, not PyPI. Debian and Ubuntu package it as python3-pyverbs,
built for their own python3 and installed where only that interpreter looks
(/usr/lib/python3/dist-packages). Its extension modules only need the same CPython
version (their file names carry it, e.g. ``cpython-311``), so when this environment's
Python matches, linking the package directory into site-packages is enough. When it
does not, build pyverbs from rdma-core's source against libibverbs-dev with this
interpreter (rdma-core's build.sh, then install its ``pyverbs`` directory).

    python deploy/tools/link_pyverbs.py [--source /usr/lib/python3/dist-packages/pyverbs]
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, default=Path("/usr/lib/python3/dist-packages/pyverbs"))
    args = p.parse_args(argv)
    if not (args.source / "__init__.py").is_file():
        print(
            f"error: no pyverbs at {args.source}: install python3-pyverbs (apt-get install python3-pyverbs)",
            file=sys.stderr,
        )
        return 2
    tag = sys.implementation.cache_tag  # e.g. cpython-311
    built = sorted({f.name.split(".")[1] for f in args.source.glob("*.so")})
    if built and not any(b.startswith(tag) for b in built):
        print(
            f"error: {args.source} is built for {', '.join(built)}, this Python is {tag}: build pyverbs from "
            "rdma-core's source with this interpreter instead (see this script's --help)",
            file=sys.stderr,
        )
        return 2
    target = Path(sysconfig.get_paths()["purelib"]) / "pyverbs"
    if target.is_symlink() or target.exists():
        if target.resolve() == args.source.resolve():
            print(f"pyverbs already linked: {target} -> {args.source}")
            return 0
        print(f"error: {target} exists and is not a link to {args.source}; remove it first", file=sys.stderr)
        return 2
    target.symlink_to(args.source, target_is_directory=True)
    print(f"linked {target} -> {args.source}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
