"""Packing one global batch of one adapter group into microbatches.

``problem`` holds the data and its bounds, ``greedy`` the first-fit-decreasing packer,
``formulation`` the two MILPs (one function per constraint family), ``highs`` the solver adapter
and ``solve`` the per-task driver that chooses between greedy and MILP.
"""
