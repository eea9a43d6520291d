"""transformer: an encoder-decoder Transformer for machine translation."""
