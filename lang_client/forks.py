"""The list-like behaviour every fork group shares (run-time states and traced states alike)."""
from __future__ import annotations

from typing import Any


class ForkList:
    """`forks[i]`, `len(forks)`, iteration, and `forks += expr` (one expression to every fork, or the
    i-th of a list to the i-th fork). Subclasses set `self.states` and implement `join`."""

    states: list

    def __getitem__(self, i: int):
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __setitem__(self, i: int, value) -> None:
        if value is not self.states[i]:  # `forks[i] += x` reassigns the same state; allow only that
            raise TypeError("a fork list holds program states; append to them with +=")

    def __iadd__(self, other: Any):
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} forks")
            for state, expr in zip(self.states, other):
                state += expr
        else:
            for state in self.states:
                state += other
        return self
