"""Tenants: who may call the gateway, and what each may use.

A tenants file (YAML or JSON; in Kubernetes, a Secret mounted as a file):

    tenants:
      - name: acme
        keys: [sk-acme-1, sk-acme-2]   # API keys, sent as `Authorization: Bearer <key>`
        requests_per_s: 5              # sustained rate (a token bucket); absent: unlimited
        burst: 10                      # requests at once above the rate (default: max(1, requests_per_s))
        max_concurrent: 4              # requests in flight at once; absent: unlimited
        priority: 0                    # under load higher goes first, below 0 is refused first (default 0);
                                       # a request may ask for less (its body's "priority"), never more
        weight: 2                      # its share under load, against tenants of its priority (default 1)
        slo_classes: [batch, default]  # the SLO classes its requests may name (the first is its default);
                                       # absent: any of the Conductor's
        min_ttft_slo_s: 2.0            # the tightest TTFT target a request may ask for (its body's ttft_slo_s);
        min_tbt_slo_s: 0.1             # and TBT: a tighter one is served at this bound (absent: unbounded)
      - name: globex
        keys: [sk-globex]

A request's key picks its tenant: the key's SHA-256 is compared in constant time with
every configured key's, and no key is ever logged or echoed. The tenant's name salts the
block keys of everything it sends (``cache_salt`` becomes ``tenant/<name>``, joined with
the request's own ``cache_salt`` when it sends one), so two tenants never share a KV
block, in the pool or in a worker, while one tenant's repeated prefix is still a cache
hit; a client cannot pick another tenant's salt, because its own is always prefixed.

Under load the Conductor serves higher priorities first and refuses the lowest first, and
shares the cluster between the tenants of one priority by weight (conductor.waiting).

A request naming an SLO class its tenant may not use is answered 403 (``slo_class_not_allowed``); a refusal offers
only classes its tenant may use.

Over its rate or its concurrency cap a tenant's generation request (chat or completion)
is answered 429 with ``Retry-After``, before any work is spent on it; other tenants are
untouched. Limits are per gateway replica.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import math
import time
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

SALT_PREFIX = "tenant/"
SALT_JOIN = (
    "\x1f"  # between the tenant's salt and a request's own (a unit separator: no client text is confused with it)
)

current: contextvars.ContextVar["Tenant | None"] = contextvars.ContextVar("mooncake_tenant", default=None)


class Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$", description="also what salts its block keys")
    keys: list[SecretStr] = Field(min_length=1, description="its API keys")
    requests_per_s: float | None = Field(
        None, gt=0, description="sustained request rate (token bucket); None: unlimited"
    )
    burst: int | None = Field(None, ge=1, description="bucket size (default: max(1, requests_per_s))")
    max_concurrent: int | None = Field(None, ge=1, description="requests in flight at once; None: unlimited")
    priority: int = Field(
        0,
        ge=-100,
        le=100,
        description="its requests' priority, and the most a request may ask for: under load higher goes first, "
        "below 0 is refused first",
    )
    weight: float = Field(1.0, gt=0, description="its share under load against the tenants of the same priority")
    slo_classes: list[str] | None = Field(
        None, min_length=1, description="the SLO classes its requests may name, its default first; None: any"
    )
    min_ttft_slo_s: float | None = Field(
        None, gt=0, description="the tightest TTFT target its requests may ask for; None: unbounded"
    )
    min_tbt_slo_s: float | None = Field(
        None, gt=0, description="the tightest TBT target its requests may ask for; None: unbounded"
    )

    @field_validator("keys")
    @classmethod
    def _keys_long_enough(cls, keys: list[SecretStr]) -> list[SecretStr]:
        for key in keys:
            if len(key.get_secret_value()) < 8:
                raise ValueError("every API key needs at least 8 characters")
        return keys

    def salt(self, request_salt: str | None) -> str:
        """The cache_salt this tenant's request of ``request_salt`` is served with."""
        own = SALT_PREFIX + self.name
        return own if not request_salt else own + SALT_JOIN + request_salt


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: list[Tenant] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> "TenantsFile":
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names repeat: {sorted(n for n in set(names) if names.count(n) > 1)}")
        digests = [_digest(k.get_secret_value().encode()) for t in self.tenants for k in t.keys]
        if len(set(digests)) != len(digests):
            raise ValueError("an API key is given twice (to one tenant or two)")
        return self


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class Limit:
    """One tenant's token bucket and in-flight count (the gateway's event loop only: no locks)."""

    def __init__(self, tenant: Tenant) -> None:
        self.tenant = tenant
        self.capacity = float(tenant.burst or max(1, math.floor(tenant.requests_per_s or 1)))
        self.tokens = self.capacity
        self.stamp = time.monotonic()
        self.in_flight = 0

    def take(self, now: float) -> tuple[str, float] | None:
        """Admit one request now (None), or say why not: (reason, seconds until it would be admitted)."""
        t = self.tenant
        if t.max_concurrent is not None and self.in_flight >= t.max_concurrent:
            return "tenant_concurrency", 1.0
        if t.requests_per_s is not None:
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * t.requests_per_s)
            self.stamp = now
            if self.tokens < 1.0:
                return "tenant_rate_limit", (1.0 - self.tokens) / t.requests_per_s
            self.tokens -= 1.0
        self.in_flight += 1
        return None

    def release(self) -> None:
        self.in_flight -= 1


class Tenants:
    """The tenants of one gateway: ``authenticate`` a bearer token, ``limit`` of a tenant."""

    def __init__(self, tenants: list[Tenant]) -> None:
        self.tenants = tenants
        self._digests = [(_digest(k.get_secret_value().encode()), t) for t in tenants for k in t.keys]
        self._limits = {t.name: Limit(t) for t in tenants}

    @classmethod
    def load(cls, path: str | Path) -> "Tenants":
        """Read a tenants file; ValueError (naming the file, never a key) when it is missing or malformed."""
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ValueError(f"cannot read the tenants file {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"the tenants file {path} is not YAML or JSON: {e}") from None
        try:
            return cls(TenantsFile.model_validate(data).tenants)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'file'}: {err['msg']}" for err in e.errors())
            raise ValueError(f"the tenants file {path} is not valid: {problems}") from None

    @classmethod
    def single(cls, api_key: str) -> "Tenants":
        """One key, no limits, no salt of its own: the ``--api-key`` gateway (everyone who has it shares the cache)."""
        return cls(
            [
                Tenant.model_construct(
                    name="",
                    keys=[SecretStr(api_key)],
                    requests_per_s=None,
                    burst=None,
                    max_concurrent=None,
                    slo_classes=None,
                    min_ttft_slo_s=None,
                    min_tbt_slo_s=None,
                )
            ]
        )

    def authenticate(self, token: bytes) -> Tenant | None:
        """The tenant whose key ``token`` is; every key is compared, in constant time, whatever matches."""
        digest, found = _digest(token), None
        for known, tenant in self._digests:
            if hmac.compare_digest(digest, known):
                found = tenant
        return found

    def limit(self, tenant: Tenant) -> Limit | None:
        return self._limits.get(tenant.name) if tenant.name else None


def salt_for(request_salt: str | None) -> str | None:
    """The cache_salt to serve the current request with: its tenant's (see Tenant.salt), or its own without tenants."""
    tenant = current.get()
    if tenant is None or not tenant.name:
        return request_salt
    return tenant.salt(request_salt)


def admission_for(request_priority: int | None) -> tuple[int, str, float]:
    """(priority, tenant name, weight) the current request is admitted with: without tenants, the priority it asks
    for (0 by default); with them, its tenant's, or less when it asks for less (a client cannot raise itself)."""
    tenant = current.get()
    if tenant is None or not tenant.name:
        return request_priority or 0, "", 1.0
    asked = tenant.priority if request_priority is None else min(request_priority, tenant.priority)
    return asked, tenant.name, tenant.weight


class SloNotAllowed(ValueError):
    """A request named an SLO class its tenant may not use."""


def slo_for(slo_class: str | None, ttft_slo_s: float | None, tbt_slo_s: float | None) -> tuple[str, float, float]:
    """(SLO class, TTFT target, TBT target; 0: the class's) the current request is admitted with: what it asks for,
    within its tenant's bounds (``Tenant.slo_classes``, ``min_ttft_slo_s``, ``min_tbt_slo_s``): no class named is the
    tenant's first, a target tighter than the tenant's bound is served at the bound (as a priority above the tenant's
    is served at the tenant's). Raises SloNotAllowed for a class the tenant may not name."""
    tenant = current.get()
    ttft, tbt = ttft_slo_s or 0.0, tbt_slo_s or 0.0
    if tenant is None or not tenant.name:
        return slo_class or "default", ttft, tbt
    allowed = tenant.slo_classes
    if allowed is not None and slo_class is not None and slo_class not in allowed:
        raise SloNotAllowed(
            f"Tenant '{tenant.name}' may not use the SLO class '{slo_class}'; it may use: {', '.join(allowed)}"
        )
    chosen = slo_class or (allowed[0] if allowed else "default")
    if ttft and tenant.min_ttft_slo_s is not None:
        ttft = max(ttft, tenant.min_ttft_slo_s)
    if tbt and tenant.min_tbt_slo_s is not None:
        tbt = max(tbt, tenant.min_tbt_slo_s)
    return chosen, ttft, tbt


def may_use(slo_class: str | None) -> bool:
    """Whether the current request's tenant may name ``slo_class`` (a refusal offers only those)."""
    tenant = current.get()
    return tenant is None or not tenant.name or tenant.slo_classes is None or slo_class in tenant.slo_classes
