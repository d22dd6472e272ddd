"""Moved: `rtp report` (`python -m pipelines.sweep.report`); this name says so in one line."""
import sys

print("error: `python -m pipelines.scaling_report` is now `rtp report` (or `python -m pipelines.sweep.report`)",
      file=sys.stderr)
sys.exit(2)
