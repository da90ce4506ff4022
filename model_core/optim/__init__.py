"""The optimizer step's parts: AdamW's PyTorch-exact arithmetic, the moments' offload file, and the compiled pieces
that accumulate a micro-batch's gradients, measure their norm and apply them. `model_core.parallel` places them
for a layout (its one `optimizer.AdamW` updates every layout's whole weights or shards, tensor and pipeline
parallelism sum the norms over groups); `model_core.train` runs them."""
