"""Tensor parallelism for the plain models: mesh/ranks, f/g collectives, Megatron-style layers, plans."""
