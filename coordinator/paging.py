"""Paging of list calls (``page``): pages of at most ``MAX_PAGE_SIZE`` items, each resumed
after the key of the last item the previous page returned (an opaque token), so pages stay
right while items come and go. A token this coordinator did not give is a SpecError."""

from __future__ import annotations

import base64
import bisect
import json
from typing import Any, Callable, TypeVar

from strata.errors import SpecError

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
T = TypeVar("T")


def page(items: list[T], key: Callable[[T], tuple[Any, ...]], size: int,
         token: str) -> tuple[list[T], str]:
    """One page of ``items`` (sorted by ``key``) after the one ``token`` ended, and the token
    of the next page ("" after the last). A token is the key of the last item it returned, so
    pages stay right while items come and go between calls."""
    if not 0 <= size <= MAX_PAGE_SIZE:
        raise SpecError("page_size", f"must be 0-{MAX_PAGE_SIZE} (0: {DEFAULT_PAGE_SIZE}), "
                                     f"got {size}")
    size = size or DEFAULT_PAGE_SIZE
    start = 0
    if token:
        after = _decode_token(token, key(items[0]) if items else None)
        if after is not None:
            start = bisect.bisect_right([key(i) for i in items], after)
    chosen = items[start:start + size]
    more = start + size < len(items)
    return chosen, _encode_token(key(chosen[-1])) if more and chosen else ""


def _encode_token(key: tuple[Any, ...]) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(key)).encode()).decode()


def _decode_token(token: str, like: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    bad = SpecError("page_token", "is not a token this coordinator gave (send back "
                                  "next_page_token as it came)")
    if len(token) > 1024:
        raise bad
    try:
        key = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
    except (ValueError, UnicodeError):
        raise bad from None
    if not isinstance(key, list) or not key or not all(isinstance(k, (str, int, float))
                                                      and not isinstance(k, bool) for k in key):
        raise bad
    if like is not None and (len(key) != len(like) or any(
            isinstance(a, str) != isinstance(b, str) for a, b in zip(key, like))):
        raise bad
    return tuple(key)
