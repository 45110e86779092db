"""The start-up objects are frozen for the run only."""

from __future__ import annotations

import gc

from lorafusion_megatron.gc_tuning import start_up_objects_frozen


def test_the_objects_alive_on_entry_are_frozen_inside_and_given_back_after() -> None:
    alive = [object(), {"a": [1]}]
    assert gc.get_freeze_count() == 0
    with start_up_objects_frozen():
        assert gc.get_freeze_count() >= len(alive)
        assert gc.isenabled()  # collections still run, over what training allocates
    assert gc.get_freeze_count() == 0


def test_the_objects_are_given_back_when_the_run_raises() -> None:
    try:
        with start_up_objects_frozen():
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert gc.get_freeze_count() == 0
