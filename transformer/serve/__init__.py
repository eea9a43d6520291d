"""python -m transformer.serve: exported models (or checkpoints) behind HTTP, batched across requests."""
