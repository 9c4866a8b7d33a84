"""Capacity reservations: places are counted from the capacity check until the engine has the
request, and every place comes back whether the request is submitted, fails or is dropped."""

from __future__ import annotations

import gc
from types import SimpleNamespace

from mmserve.frontend.async_llm import Reservation


def engine() -> SimpleNamespace:
    return SimpleNamespace(_reserved=0)


def test_each_submitted_prompt_takes_one_place_over_and_release_frees_the_rest():
    e = engine()
    r = Reservation(e, 3)
    assert e._reserved == 3
    r.take_one()
    r.take_one()
    assert e._reserved == 1
    r.release()
    assert e._reserved == 0
    r.take_one()  # nothing left to take: no negative count
    r.release()
    assert e._reserved == 0


def test_a_dropped_reservation_gives_its_places_back():
    e = engine()
    r = Reservation(e, 2)
    r.take_one()
    del r
    gc.collect()
    assert e._reserved == 0
