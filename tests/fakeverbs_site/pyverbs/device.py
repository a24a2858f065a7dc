"""pyverbs.device of the fake fabric (see __init__)."""

from pyverbs import MODULES

globals().update(vars(MODULES["device"]))
