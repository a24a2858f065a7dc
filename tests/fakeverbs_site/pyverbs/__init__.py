"""tests/fakeverbs.py's fabric under pyverbs' name, for processes the tests start (PYTHONPATH=tests/fakeverbs_site).

Every process importing it joins the fabric in ``$FAKEVERBS_DIR``: their queue pairs
reach each other's memory regions (tests/conftest.py, the ``fake-rdma`` group).
"""

import importlib.util
import os
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "fakeverbs.py"
_spec = importlib.util.spec_from_file_location("_fakeverbs", _path)
_fakeverbs = importlib.util.module_from_spec(_spec)
sys.modules["_fakeverbs"] = _fakeverbs  # dataclasses look their module up by name
_spec.loader.exec_module(_fakeverbs)

FABRIC = _fakeverbs.Fabric(shared=Path(os.environ["FAKEVERBS_DIR"]))
MODULES = FABRIC.modules()
