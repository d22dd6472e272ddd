"""tf_dtensor: multi-client TensorFlow DTensor (trainer.py), its Ray Train backend connecting the clients
(backend.py), the mesh and layout plan (layout.py, framework-free) and the models laid out on it (mesh.py)."""
