"""A check a downstream suite writes for its own engine: the KV cache is untouched outside the batch's slots."""
