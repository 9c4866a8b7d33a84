"""Kernels: the only importer of the compiled `csrc/` extension and of Triton kernels.

Every op has a plain torch reference in `mmserve.ops.reference` with the same contract, and a
property test against it.
"""
