"""An intrusive doubly linked LRU list: the nodes carry their own `prev`/`next` links.

    sentinel <-> least recent <-> ... <-> most recent <-> sentinel

O(1) push, remove and touch; no per-operation allocation. The list is generic in its
nodes: anything with `prev` and `next` slots (`LruNode`, or `pools.page_pool.Entry`, a
slotted dataclass that cannot also derive from it). Inside, the links are `Any`: they are
nodes while linked and None while off the list, which is the list's invariant (`check`),
not a type mypy can follow through the sentinel.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar


class Linked(Protocol):
    """What the list needs of a node: its two links (None while off the list)."""

    prev: Any
    next: Any


N = TypeVar("N", bound=Linked)


class LruNode:
    """Base of anything kept on an `LruList`; `prev`/`next` are None while off the list."""

    __slots__ = ("prev", "next")

    def __init__(self) -> None:
        self.prev: LruNode | None = None
        self.next: LruNode | None = None


class LruList(Generic[N]):
    """The list; `len()` counts its nodes."""

    __slots__ = ("_head", "_len")

    def __init__(self) -> None:
        self._head: Any = LruNode()
        self._head.prev = self._head.next = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push_mru(self, node: N) -> None:
        assert node.prev is None and node.next is None, "node already linked"
        last = self._head.prev
        node.prev, node.next = last, self._head
        last.next = node
        self._head.prev = node
        self._len += 1

    def remove(self, node: N) -> None:
        assert node.prev is not None and node.next is not None, "node not linked"
        node.prev.next = node.next
        node.next.prev = node.prev
        node.prev = node.next = None
        self._len -= 1

    def touch(self, node: N) -> None:
        """Move a linked node to the most-recent end."""
        if self._head.prev is not node:
            self.remove(node)
            self.push_mru(node)

    def touch_all(self, nodes: Iterable[N]) -> None:
        """`touch` each linked node in order (the pages of one read): the last is most recent."""
        head = self._head
        for node in nodes:
            last = head.prev
            if last is not node:
                node.prev.next, node.next.prev = node.next, node.prev
                node.prev, node.next = last, head
                last.next = head.prev = node

    def from_lru(self) -> Iterator[N]:
        """Nodes from least to most recent."""
        node = self._head.next
        while node is not self._head:
            nxt = node.next
            yield node
            node = nxt

    def check(self) -> int:
        """Walk both directions; return the length. Raises AssertionError on a broken link."""
        count, node = 0, self._head.next
        while node is not self._head:
            if node.next.prev is not node:
                raise AssertionError("LRU forward/backward links disagree")
            count += 1
            node = node.next
            if count > self._len:
                raise AssertionError("LRU list is longer than its count (cycle?)")
        if count != self._len:
            raise AssertionError(f"LRU count {self._len} != walked {count}")
        return count
