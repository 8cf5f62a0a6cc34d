"""Capture: a model (or a checkpoint folder, streamed) into an aten-level torch.fx graph."""
