"""Pallas GPU kernels; each file holds a kernel body and a thin wrapper with shape checks."""
