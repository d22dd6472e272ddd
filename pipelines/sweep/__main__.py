"""`python -m pipelines.sweep`: the sweep driver (pipelines/sweep/run.py)."""
import sys

from pipelines.sweep.run import main

sys.exit(main())
