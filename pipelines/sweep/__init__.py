"""Sweeps: a grid or search space of runs (space.py), each trial one training run (trial.py), on Ray Tune
(run.py; population-based training: pbt.py), the scaling report of a sweep's trials (report.py) and screenshots of
a sweep in the MLflow UI (screenshots.py). `python -m pipelines.sweep` runs run.py's `main`."""
