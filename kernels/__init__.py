"""Triton kernels, each beside its paddle/numpy reference twin (none yet)."""
