"""Artifacts on disk: the graph as data, safetensors, atomic output folders, the spill of finished blocks."""
