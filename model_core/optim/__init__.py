"""The single-device optimizer step: AdamW (PyTorch-exact) and the compiled pieces that accumulate a micro-batch's
gradients, measure their norm and apply them. `model_core.parallel` wraps these for a layout (ZeRO shards them,
tensor and pipeline parallelism sum their norms over groups); `model_core.train` runs them."""
