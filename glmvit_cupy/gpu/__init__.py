"""The GPU engine: the CuPy forward and what it needs: buffers, kernels, faults, timings.

Separate because it is the one layer that needs CuPy and a GPU: nothing below it imports CuPy,
and the layers above reach it only inside the functions that use a GPU, so the package imports
where CuPy is not installed.
"""
