"""Triton kernels and their plain-torch reference twins (one op per file)."""
