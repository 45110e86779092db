"""Multi-adapter pipeline-parallel runtime: the trainer's jobs on ``S`` pipeline stages x ``d`` replicas.

Each rank builds only its own stage of the HF decoder (:mod:`.stage_model`), exchanges
variable-length activations and gradients with its neighbours (:mod:`.p2p`) and executes the
scheduler's plan with the continuous multi-adapter 1F1B schedule (:mod:`.engine`); the baselines
``megatron-1f1b`` and ``mlora`` are other programs for the same engine (:mod:`.programs`).

Importing this package loads no torch: the torch-free modules (:mod:`.options`,
:mod:`.partition`, :mod:`.schedule`, :mod:`.programs`) validate and plan without it.
"""

from __future__ import annotations
