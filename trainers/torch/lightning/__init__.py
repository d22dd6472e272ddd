"""trainer=lightning: PyTorch Lightning's `Trainer` in Ray Train workers, through Ray's Lightning integration
(`ray.train.lightning`), on the shared loop's contract. `backend.py` is what the driver imports (no Lightning);
`worker.py` runs on the workers; `module.py` is the LightningModule a plain model spec trains as."""

CHECKPOINT_FILE = "lightning.ckpt"  # Lightning's own checkpoint (`Trainer.save_checkpoint`), beside train_state.json
PLAIN_MODEL = "model."  # where `RecipeModule` (module.py) keeps the spec's plain model in its state dict
