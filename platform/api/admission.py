"""Admission before preparation: in-flight caps and requests-per-minute, checked before anything costly.

`admit_early` runs first on every generation request, before the model is
resolved, the chat template is rendered, the prompt is tokenized, a grammar
is compiled or a session lease is taken: a request refused here costs one
counter lookup. Each prompt of a `/v1/completions` prompt list is one
request, for the limits and for the in-flight counts.

Caps:
- the server's `max_pending_requests` admission places, shared fairly: while
  there is room anyone gets in (an idle tenant's places go to busy ones);
  once the server is full, a tenant still gets in up to its fair share
  (the places over the number of tenants with requests in flight), and a
  tenant past its share gets a 429 naming its share (`tenant_share_exceeded`),
  so one tenant's flood never turns another tenant's request away. The
  server holds at most twice `max_pending_requests` that way; past that, 503
  `overloaded`.
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


class TenantShareExceededError(RateLimitedError):
    def __init__(self, cap: int, held: int, share: int, num_tenants: int) -> None:
        super().__init__(
            f"the server is at its limit of {cap} concurrent requests (max_pending_requests) and this tenant holds "
            f"{held} of them, its fair share being {share} while {num_tenants} tenants have requests in flight; "
            "retry when one of its requests finishes", retry_after_s=1, code="tenant_share_exceeded",
        )


class TenantInflightLimitError(RateLimitedError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            f"this tenant already has {limit} requests in flight on this server (max_inflight_per_tenant); "
            "retry when one finishes", retry_after_s=1, code="tenant_inflight_limit",
        )



class UnslottedTicket:
    """What a request admitted by other means holds (a batch line, bounded by its batch's own concurrency):
    no in-flight slot to give back, no per-minute charge."""

    async def charge_prompt(self, num_prompt_tokens: int) -> None:
        return None

    def release(self) -> None:
        return None


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


def check_admission_share(services: Services, tenant_id: str, num_requests: int) -> None:
    """Room for `num_requests` more of this tenant's requests among the server's admission places, or an error."""
    cap = services.settings.max_pending_requests
    total = services.num_inflight + num_requests
    if total <= cap:
        return
    held = services.inflight_by_tenant.get(tenant_id, 0)
    num_tenants = len(services.inflight_by_tenant.keys() | {tenant_id})
    share = max(1, cap // num_tenants)
    if held + num_requests > share:
        raise TenantShareExceededError(cap, held, share, num_tenants)
    if total > 2 * cap:
        raise OverloadedError(f"the server is at its limit of {cap} concurrent requests; retry shortly")


async def admit_early(services: Services, key: Principal, *, num_requests: int = 1) -> AdmissionTicket:
    settings = services.settings
    check_admission_share(services, key.tenant_id, num_requests)
    if settings.max_inflight_per_tenant:
        cap = tenant_share(settings.max_inflight_per_tenant, settings.num_api_servers)
        if services.inflight_by_tenant.get(key.tenant_id, 0) + num_requests > cap:
            raise TenantInflightLimitError(cap)
    await services.rate_limiter.admit(key.key_id, key.limits, num_prompt_tokens=0, num_requests=num_requests)
    services.num_inflight += num_requests
    services.metrics.inflight.inc(num_requests)
    services.inflight_by_tenant[key.tenant_id] = services.inflight_by_tenant.get(key.tenant_id, 0) + num_requests
    return AdmissionTicket(services, key, num_requests)
