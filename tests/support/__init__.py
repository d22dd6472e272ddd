"""What the tests share beyond conftest.py's fixtures: in-process runs of the shared loop (loop_harness, loop_backends),
gloo rank pools and dense references for parallel code (dist_utils, parallel_checks), fresh-process TensorFlow checks
(tf_recipe_checks, dtensor_checks, tf_ps_servers), Horovod checks and probe, generated IMDb-format data."""
