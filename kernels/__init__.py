"""Kernels, each beside a reference twin that tests compare it with.

``kernels/cpu``: paddle C++ custom operators for CPU, compiled on first use
(:func:`specdec.kernels.cpu.load_cpu_ops`), with numpy twins in ``kernels/cpu/reference.py``.
``kernels/triton``: Triton kernels for CUDA devices, with numpy twins beside them.
The bottom of the import graph: nothing here imports specdec beyond ``specdec.errors``.
"""
