#!/usr/bin/env bash
# `uv pip ARGS...` into the virtual environment of PYTHON, with this machine's pip configuration.
#   usage: uv-pip.sh PYTHON install|uninstall ARGS...
# uv (installed into the environment by pip) installs the project's dependencies about 4x sooner than pip: a fresh
# environment with torch, the project and its dev and vllm extras took 69 s against pip's 275 s on a 2-core machine
# (both compiling bytecode, no cache). uv reads none of pip's configuration, so pip's find-links, extra indexes and
# constraints (a machine's local wheels and version caps: `pip config list`) are handed to it here; like pip, it
# takes the best version across all indexes. A machine without them installs from PyPI alone.
set -euo pipefail
python=$1
shift
conf=$("$python" -m pip config list 2>/dev/null || true)
# every value of one key, from any of pip's files or its environment, once each
values() { printf '%s\n' "$conf" | sed -n "s/^[^=]*\.$1='\(.*\)'\$/\1/p" | tr ' ' '\n' | sed '/^$/d' | sort -u; }
links=$(values find-links | paste -sd, -)
indexes=$(values extra-index-url | paste -sd' ' -)
constraints=$(values constraint | paste -sd' ' -)
index=$(values index-url | head -n1)
[ -z "$links" ] || export UV_FIND_LINKS="$links"
[ -z "$indexes" ] || export UV_EXTRA_INDEX_URL="$indexes"
[ -z "$constraints" ] || export UV_CONSTRAINT="$constraints"
[ -z "$index" ] || export UV_INDEX_URL="$index"
export UV_INDEX_STRATEGY=unsafe-best-match
# pip's no-cache setting carries over (CI sets it: the disk holds one copy of vLLM, not two)
[ -z "${PIP_NO_CACHE_DIR:-}" ] || export UV_NO_CACHE=1
command=$1
shift
if [ "$command" = install ]; then
  # bytecode now, as pip does: where PYTHONDONTWRITEBYTECODE is set, nothing would ever write it
  set -- --compile-bytecode "$@"
fi
exec "$(dirname "$python")/uv" pip "$command" --python "$python" "$@"
