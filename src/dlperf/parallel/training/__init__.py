"""Training: the Trainer and its configuration, one training run (epochs, checkpoints, resume), DataParallel."""
