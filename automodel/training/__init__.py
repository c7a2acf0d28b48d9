"""Training: the recipe classes (SFT, DPO, distillation), checkpoints, the run directory, metrics and trackers."""
