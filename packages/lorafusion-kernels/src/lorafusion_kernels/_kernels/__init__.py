"""Triton kernels and their typed launchers, one kernel family per module; no autograd here.

The token count (``M`` or ``T``, and what is derived from it) is passed with ``do_not_specialize``:
Triton otherwise compiles one variant for counts divisible by 16, one for the others and one for a
count of 1, and a training run whose microbatches vary in length meets the later variants in the
middle of the run, where a compilation (0.5 to 2.5 s measured on an H200) stalls every pipeline
stage. Rows are never the contiguous dimension of an operand, so no load loses vectorisation.
For the same reason the number of programs sharing a reduction, which a launcher derives from the
token count, is a runtime argument; only whether a reduction is split at all selects a variant.
"""
