"""The Hydra config: conf/config.yaml and one folder per config group (trainer/, data/, model/, sweep/), a YAML file per
choice. A package only so that an installed copy ships the YAML files beside `pipelines` (pipelines/config.py)."""
