"""Kernels, each beside a reference twin that tests compare it with.

``kernels/cpu``: paddle C++ custom operators for CPU, compiled on first use
(:func:`specdec.kernels.cpu.load_cpu_ops`), with numpy twins in ``kernels/cpu/reference.py``.
There are no GPU (Triton) kernels yet.
"""
