"""Moved: `rtp screenshots` (`python -m pipelines.sweep.screenshots`); this name says so in one line."""
import sys

print("error: `python -m pipelines.ui_screenshots` is now `rtp screenshots` "
      "(or `python -m pipelines.sweep.screenshots`)", file=sys.stderr)
sys.exit(2)
