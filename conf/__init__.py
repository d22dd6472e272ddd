"""The Hydra config: conf/config.yaml (the groups a run starts from), presets of a model (model/) and the sweep
presets (sweep/). Every choice's keys and defaults come from its registered spec (pipelines/config.py
`store_config_groups`). A package only so that an installed copy ships the YAML files beside `pipelines`."""
