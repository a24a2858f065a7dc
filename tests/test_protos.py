"""The generated gRPC modules in protos/ match their .proto files (regenerate with `make protos`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROTOS = sorted((REPO / "protos").glob("*.proto"))


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_generated_code_is_up_to_date(proto, tmp_path):
    (tmp_path / "protos").mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{REPO}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            str(proto.relative_to(REPO)),
        ],
        check=True,
        cwd=REPO,
    )
    for generated in sorted((tmp_path / "protos").iterdir()):
        committed = REPO / "protos" / generated.name
        assert committed.exists(), f"{committed.name} is missing: run `make protos`"
        assert committed.read_text() == generated.read_text(), f"{committed.name} is stale: run `make protos`"
