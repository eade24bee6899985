"""Admission before preparation: in-flight caps and requests-per-minute, checked before anything costly.

`admit_early` runs first on every generation request, before the model is
resolved, the chat template is rendered, the prompt is tokenized, a grammar
is compiled or a session lease is taken: a request refused here costs one
counter lookup. Each prompt of a `/v1/completions` prompt list is one
request, for the limits and for the in-flight counts.

Caps:
- the server's `max_pending_requests` (503, `overloaded`),
- a tenant's `max_inflight_per_tenant` (429, `tenant_inflight_limit`), so one
  tenant's burst cannot take every slot; with N API server processes each
  enforces its share, ceil(cap / N),
- the key's requests per minute (429, `rate_limit_exceeded`).

The prompt's tokens are charged against tokens-per-minute later, once they
are known (`AdmissionTicket.charge_prompt`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loraplex.platform.deps import Principal
from loraplex.platform.errors import OverloadedError, RateLimitedError
from loraplex.platform.services import Services


class TenantInflightLimitError(RateLimitedError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            f"this tenant already has {limit} requests in flight on this server (max_inflight_per_tenant); "
            "retry when one finishes", retry_after_s=1, code="tenant_inflight_limit",
        )


@dataclass(slots=True)
class AdmissionTicket:
    """One admitted request's hold on the in-flight slots; `release` gives them back exactly once."""

    services: Services
    key: Principal
    num_requests: int
    released: bool = False

    async def charge_prompt(self, num_prompt_tokens: int) -> None:
        await self.services.rate_limiter.charge_prompt(self.key.key_id, self.key.limits,
                                                       num_prompt_tokens=num_prompt_tokens,
                                                       num_requests=self.num_requests)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        services = self.services
        services.num_inflight -= self.num_requests
        services.metrics.inflight.dec(self.num_requests)
        tenant = self.key.tenant_id
        remaining = services.inflight_by_tenant.get(tenant, 0) - self.num_requests
        if remaining > 0:
            services.inflight_by_tenant[tenant] = remaining
        else:
            services.inflight_by_tenant.pop(tenant, None)


def tenant_share(settings_cap: int, num_api_servers: int) -> int:
    return math.ceil(settings_cap / max(1, num_api_servers))


async def admit_early(services: Services, key: Principal, *, num_requests: int = 1) -> AdmissionTicket:
    settings = services.settings
    if services.num_inflight + num_requests > settings.max_pending_requests:
        raise OverloadedError(
            f"the server is at its limit of {settings.max_pending_requests} concurrent requests; retry shortly"
        )
    if settings.max_inflight_per_tenant:
        cap = tenant_share(settings.max_inflight_per_tenant, settings.api_servers)
        if services.inflight_by_tenant.get(key.tenant_id, 0) + num_requests > cap:
            raise TenantInflightLimitError(cap)
    await services.rate_limiter.admit(key.key_id, key.limits, num_prompt_tokens=0, num_requests=num_requests)
    services.num_inflight += num_requests
    services.metrics.inflight.inc(num_requests)
    services.inflight_by_tenant[key.tenant_id] = services.inflight_by_tenant.get(key.tenant_id, 0) + num_requests
    return AdmissionTicket(services, key, num_requests)
