"""Training: the train step, AdamW and its learning-rate schedule, precision and loss scaling,
checkpoints, and the throughput and MFU metrics."""
