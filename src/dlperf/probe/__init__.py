"""Measure this machine and model what a training step costs on it (d2l 12.4, 12.7)."""
