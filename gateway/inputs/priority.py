"""A request's scheduling priority (vLLM's `priority` field, lower first) under `--scheduling-policy priority`.

Without `--tenant-keys` a request may ask for any 32-bit priority (whoever holds the API key is trusted with the
queue); a request that leaves it out runs at 0. With tenants, a tenant's `priority` (tenant file, default 0) is
both its requests' default and the most urgent they may ask for: a request may ask for a larger number (to step
aside for its own interactive traffic, say), never a smaller one, so no tenant can put itself ahead of others
beyond what the operator granted (a 400 naming `priority`). Under any other policy a priority other than 0 is a
400, as vLLM answers it.
"""
from __future__ import annotations

from gateway.errors import invalid
from gateway.tenancy.auth import Principal


def request_priority(asked: int | None, principal: Principal, policy: str) -> int:
    """The priority a request runs at; 400 (`priority`) for one it may not ask for."""
    floor = principal.tenant.priority if principal.tenant is not None else None
    if policy != "priority":
        if asked:
            raise invalid(f"priority {asked} needs the priority scheduling policy (--scheduling-policy priority); "
                          f"this server schedules by {policy}", param="priority")
        return 0
    if asked is None:
        return floor or 0
    if floor is not None and asked < floor:
        raise invalid(f"priority {asked} is more urgent than this API key may ask for (at least {floor}; lower "
                      f"runs first)", param="priority")
    return asked
