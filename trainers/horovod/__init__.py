"""horovod: Horovod (Gloo) on Ray Train V2 (trainer.py), its rendezvous as a Ray Train backend (backend.py), and its
two bindings on the shared loop: torch.py (`hvd.DistributedOptimizer`) and tf.py (`DistributedGradientTape`)."""
