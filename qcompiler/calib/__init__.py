"""Calibration: the block-sequential engine over the fx graph, calibration data, host-memory care."""
