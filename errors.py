"""The one exception a bad config value raises, and the small checks that build it.

A leaf module: it imports nothing of the project, so every layer (``algorithms/``, ``data/``, ``engine/``)
validates its own config section without importing the layer above it.

Every config group validates through one signature, run once in the launcher before any worker starts::

    validate(section: dict, cfg: dict, world_size: int) -> None    # raise ConfigError on a bad value

a classmethod of the group's ``_target_`` class (sync, amp, logger, straggler), or a module-level function
beside a ``_target_`` function (data). ``section`` is the group's own config, ``cfg`` the whole resolved
config, ``world_size`` the number of worker processes the run will have.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A bad config value, in one line: ``key=value: expected <what is allowed>``."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r}: expected {allowed}")

    def under(self, prefix: str, section: str = "sync") -> ConfigError:
        """The same error with ``section.`` keys moved under ``prefix`` (an inner algorithm's section)."""
        if self.key == section or self.key.startswith(section + "."):
            return ConfigError(prefix + self.key[len(section) :], self.value, self.allowed)
        return self


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    """Raise ``ConfigError(key, value, allowed)`` unless ``ok``."""
    if not ok:
        raise ConfigError(key, value, allowed)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
