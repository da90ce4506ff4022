"""Training: the loop, the learning-rate schedule, precision and loss scaling, the data loader, checkpoints
(and their conversion between layouts), and the throughput and MFU metrics."""
