"""The profiler behind ``lorafusion-megatron profile``: measure, fit, choose the capacity.

Per-stage forward/backward time and peak memory over token counts, the scheduler's cost model
fitted to them, and the token capacity chosen with it.

Importing this package loads no torch; :mod:`.fit` and :mod:`.capacity` never do.
"""

from __future__ import annotations
