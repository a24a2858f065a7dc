"""``python -m benchmarks.sim``: see benchmarks.sim.cli."""

from benchmarks.sim.cli import main

raise SystemExit(main())
