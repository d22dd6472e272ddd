"""tf_ps: TensorFlow ParameterServerStrategy (trainer.py), its cluster as a Ray Train backend (backend.py) and one
server process of it (server.py)."""
