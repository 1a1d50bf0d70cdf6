"""Evaluation: held-out task splits, eval runs during training (shared, dedicated, external)
and on checkpoints, and their statistics (pass@k, standard errors, bootstrap intervals)."""
