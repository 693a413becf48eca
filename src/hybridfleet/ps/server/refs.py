"""Whether anything besides one container slot holds an object, read from its reference count.

Used where memory is reused or written in place only once nothing else can reach it: numpy views
hold their base array, memoryviews the object they were made from, and answers the lists they
were built of, so a count above the container's own reference means someone still uses it.
"""

from __future__ import annotations

import sys


def held_elsewhere(container, key) -> bool:
    """Whether ``container[key]`` is referenced by anything but ``container``."""
    return sys.getrefcount(container[key]) > _ONLY_THE_CONTAINER


def _count_in_container() -> int:
    probe = {0: object()}
    return sys.getrefcount(probe[0])


_ONLY_THE_CONTAINER = _count_in_container()  # read the same way as in held_elsewhere
