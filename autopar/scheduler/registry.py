"""The scheduling policies by name: a dict plus a decorator (as the rule registry).

``all`` on the command line runs every registered policy, in registration order."""

from __future__ import annotations

from typing import Callable

from ..errors import AutoparError
from .fifo import Fifo
from .ones import Ones
from .optimus import Optimus
from .pollux import Pollux
from .simulator import Policy
from .tiresias import Tiresias

__all__ = ["POLICIES", "register_policy", "make_policy", "PolicyError"]

PolicyFactory = Callable[[int], Policy]  # seed -> a fresh policy
POLICIES: dict[str, PolicyFactory] = {}


class PolicyError(AutoparError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def register_policy(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    def deco(factory: PolicyFactory) -> PolicyFactory:
        if name in POLICIES:
            raise PolicyError(f"policy {name!r} is already registered")
        POLICIES[name] = factory
        return factory

    return deco


def make_policy(name: str, seed: int = 0) -> Policy:
    """A fresh policy (policies keep per-run state such as ONES's population)."""
    try:
        return POLICIES[name](seed)
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; pick one of {', '.join(POLICIES)} or all") from None


register_policy("fifo")(lambda seed: Fifo())
register_policy("tiresias")(lambda seed: Tiresias())
register_policy("optimus")(lambda seed: Optimus())
register_policy("ones")(lambda seed: Ones(seed=seed))
register_policy("pollux")(lambda seed: Pollux())
