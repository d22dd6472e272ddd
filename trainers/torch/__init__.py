"""The PyTorch backends: ddp, tp, fsdp (one module each), what they share (common.py, recipe.py), their Ray Train
backend (backend.py: the process group) and the parallel layers (parallel/). Importing the package imports no
torch: Ray Train's controller unpickles `backend.TorchGroupConfig` without it."""
