"""The contracts every layer shares, importable by entry points and backends alike without a cycle.

Layering (tests/unit/test_layering.py checks it): `pipelines` (entry points, data preparation, config
validation) -> `trainers` (backends, the shared loop, parallel layers, models) -> `contract` (MLflow tracking,
stop/resume files, the checkpoint schema, the metric set, dataset facts). Nothing here imports a framework
(torch, TensorFlow) or Ray at module level.
"""
