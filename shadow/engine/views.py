"""Read-only views of a lane's state.

`Outstanding` and `Added`: per-worker views a lane's `FleetSnapshot` holds, sums counted when read,
so that a snapshot's derived lists cost nothing for the policies that never read them (valid while
the lane does not move, as the snapshot itself). `Forward`: a lane's public read-only attribute
whose value one of its collaborators keeps. Pure."""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar, cast, overload

from shadow.engine.jobs import Job

T = TypeVar("T")


class Outstanding(Sequence[int]):
    """Requests sent to each worker and not finished (running + queued), counted when read."""

    __slots__ = ("queues", "running")

    def __init__(self, running: list[int], queues: list[deque[tuple[Job, float]]]) -> None:
        self.running, self.queues = running, queues

    def __len__(self) -> int:
        return len(self.running)

    def __getitem__(self, g: int) -> int:  # type: ignore[override]  # worker indices only
        return self.running[g] + len(self.queues[g])

    def __iter__(self) -> Iterator[int]:  # (Sequence's would index one worker at a time)
        return map(operator.add, self.running, map(len, self.queues))


class Added(Sequence[float]):
    """`a[g] + b[g]` per worker, added when read (as `Outstanding`)."""

    __slots__ = ("a", "b")

    def __init__(self, a: list[float], b: list[float]) -> None:
        self.a, self.b = a, b

    def __len__(self) -> int:
        return len(self.a)

    def __getitem__(self, g: int) -> float:  # type: ignore[override]  # worker indices only
        return self.a[g] + self.b[g]

    def __iter__(self) -> Iterator[float]:
        return map(operator.add, self.a, self.b)


class Forward(Generic[T]):
    """A read-only attribute of a class's instances, under the same name as its value's attribute
    in the collaborator the instance holds as `owner` (`x.name` is `x.<owner>.name`)."""

    __slots__ = ("name", "owner")

    def __init__(self, owner: str) -> None:
        self.owner, self.name = owner, ""

    def __set_name__(self, cls: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, cls: type | None = None) -> Forward[T]: ...

    @overload
    def __get__(self, obj: object, cls: type | None = None) -> T: ...

    def __get__(self, obj: object | None, cls: type | None = None) -> T | Forward[T]:
        if obj is None:
            return self
        return cast(T, getattr(getattr(obj, self.owner), self.name))

    def __set__(self, obj: object, value: T) -> None:
        raise AttributeError(f"{self.name} is read-only (kept by the {self.owner})")
