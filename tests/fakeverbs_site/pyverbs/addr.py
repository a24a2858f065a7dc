"""pyverbs.addr of the fake fabric (see __init__)."""

from pyverbs import MODULES

GID, AHAttr, GlobalRoute = MODULES["GID"], MODULES["AHAttr"], MODULES["GlobalRoute"]
