"""Keep Python's garbage collector from stalling training.

A process holding torch, transformers, PEFT, megatron-core and Triton tracks about half a million
Python objects (modules, functions, dicts) before it builds a model, and every full collection
walks them all: about 0.2 s on a CI core. Training allocates enough container objects (HF's
``ModelOutput`` dicts, tuples of arguments) to trigger a full collection every 10 to 25
microbatches, in the middle of a forward; on the GPU machine these stalls measured 300 to 400 ms,
and in a pipeline every other stage idles through them.

The objects alive at the end of start-up (libraries, the model, the data) live as long as the run.
:func:`start_up_objects_frozen` moves them to the collector's permanent generation, which
collections skip, so a full collection walks only what training allocated since, and gives them
back to the collector when the run ends (a process that trains several times, as a notebook or the
tests do, must not keep the first run's model for ever). Nothing is disabled: cycles created
during training are still collected.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["start_up_objects_frozen"]


@contextmanager
def start_up_objects_frozen() -> Iterator[None]:
    """Inside: the objects alive on entry are exempt from collections (``gc.freeze``; collected first)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
