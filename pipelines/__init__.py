"""Entry points and shared contracts (config, tracking, data) of the training pipelines."""
