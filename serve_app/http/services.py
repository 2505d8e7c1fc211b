"""The one place the quota services and the gateway are built and wired together, for
the ingress and for a model's direct route alike. Nothing else constructs the concrete
services (tests/unit/test_boundaries.py): the request path sees admission through
``admission.seam.Admitter``, the routes see the ``Authenticator``, the admin operations
their ``AdminStores``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from contract.model_config import ModelConfig
from serve_app.accounting.record_shipper import RecordShipper
from serve_app.accounting.record_sink import RecordSink
from serve_app.admin.operations import AdminStores
from serve_app.admission.gatekeeper import Gatekeeper
from serve_app.admission.loop_lag import LoopLag
from serve_app.admission.maintenance import IngressReplicas, Maintenance
from serve_app.identity.authentication import Authenticator
from serve_app.identity.cache_isolation import CacheSalts
from serve_app.pipeline.gateway import Gateway
from serve_app.redis_store import redis_client
from serve_app.settings import AppSettings
from serve_app.telemetry import Telemetry


@dataclass(frozen=True)
class QuotaServices:
    stores: AdminStores  # keys, teams, admins, the audit trail, records: the admin operations' stores
    authenticator: Authenticator  # who is calling
    gate: Gatekeeper  # whether a request runs now, and settling it
    maintenance: Maintenance  # leases, missed settlements, revocations, the replica count

    @property
    def redis(self):
        return self.stores.redis


def build_quota_services(
    settings: AppSettings, telemetry: Telemetry, deployment: Mapping[str, Any] | None = None
) -> QuotaServices:
    """``deployment``: the Serve options of the deployment this runs in, whose replicas
    share a key's limits during a Redis outage (the ingress' unless given: a model's
    direct route passes its own)."""
    quota, records = settings.quota, settings.records
    redis = redis_client.connect(settings.redis_url, timeout_s=quota.redis_timeout_s)
    # Final records to the record sink (record_shipper.py); Redis keeps them recent_s.
    shipper = (
        RecordShipper(redis, RecordSink(records.sink_dir, quota.request_retention_s), records.max_backlog, telemetry)
        if records.sink_dir
        else None
    )
    stores = AdminStores.over(redis, shipper)
    # One watcher of this process' loop: a Redis call that failed while the loop ran
    # late is the process' overload, to authentication as to admission.
    loop_lag = LoopLag.judging(quota.redis_timeout_s)
    authenticator = Authenticator(
        stores.keys,
        stores.teams,
        stores.admins,
        settings,
        telemetry,
        late_during=loop_lag.late_during,
        clock=loop_lag.clock,
    )
    replicas = IngressReplicas(dict(settings.ingress.deployment if deployment is None else deployment))
    gate = Gatekeeper(redis, settings, telemetry, authenticator.team_of, replicas.count, shipper, loop_lag)
    maintenance = Maintenance(
        gate, stores.keys, stores.teams, replicas, shipper, quota.concurrency_lease_s, quota.key_cache_ttl_s
    )
    return QuotaServices(stores, authenticator, gate, maintenance)


@dataclass(frozen=True)
class EdgeTenancy:
    """What a direct route's edge router needs to place a request as its gateway will
    salt it: who is calling (a cached look-up) and the cache salts."""

    authenticator: Authenticator
    salts: CacheSalts


def build_edge_tenancy(settings: AppSettings, telemetry: Telemetry) -> EdgeTenancy:
    redis = redis_client.connect(settings.redis_url, timeout_s=settings.quota.redis_timeout_s)
    stores = AdminStores.over(redis, None)
    authenticator = Authenticator(stores.keys, stores.teams, stores.admins, settings, telemetry)
    return EdgeTenancy(authenticator, CacheSalts(redis))


def build_gateway(
    settings: AppSettings,
    telemetry: Telemetry,
    models: Mapping[str, Any],
    configs: list[ModelConfig],
    deployment: Mapping[str, Any] | None = None,
    **gateway_options,
) -> tuple[QuotaServices, Gateway]:
    """The quota services, their maintenance loop started (Serve runs ``__init__`` on the
    replica's event loop), and the ``Gateway`` over ``models`` (name -> what calls its
    replicas) admitting through them."""
    services = build_quota_services(settings, telemetry, deployment)
    services.maintenance.start()
    salts = CacheSalts(services.redis)
    return services, Gateway(services.gate, dict(models), configs, telemetry, salts, **gateway_options)
