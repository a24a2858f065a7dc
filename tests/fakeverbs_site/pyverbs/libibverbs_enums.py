"""libibverbs constants of the fake fabric (see __init__)."""

from pyverbs import _fakeverbs

globals().update(vars(_fakeverbs.E))
