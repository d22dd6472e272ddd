"""The TensorFlow backends: tf_mwms (mwms.py), tf_dtensor (dtensor/), tf_ps (ps/), what they share (common.py,
recipe.py, keras_fit.py) and MWMS's Ray Train backend (backend.py). Importing the package imports no TensorFlow
(tf-keras must own `tf.keras` from a worker's start: common.py) and never torch."""
