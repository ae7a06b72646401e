"""`s.system(...)`, `s.user(...)`, `s.assistant(...)` for every kind of program state."""
from __future__ import annotations

from typing import Any


class RoleShortcuts:
    """Subclasses implement `_role(role, expr)`."""

    def system(self, expr: Any = None):
        return self._role("system", expr)

    def user(self, expr: Any = None):
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        return self._role("assistant", expr)
