"""Triton kernels and their typed launchers, one kernel family per module; no autograd here."""
