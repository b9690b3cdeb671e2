"""Opening the client of a registry model, by its kind: `tollgate` models are Tollgate
backend replicas (RemoteEngineClient, with the backend secret), `openai` models are
OpenAI-compatible upstreams (OpenAIUpstreamClient)."""

from __future__ import annotations

import secrets

from gateway.core.errors import EngineUnavailable
from gateway.dispatch.directory import Builder
from gateway.dispatch.engine_client import EngineClient
from gateway.dispatch.remote import RemoteEngineClient
from gateway.dispatch.upstream import (
    Disagreement,
    OpenAIUpstreamClient,
    Overclaim,
    UpstreamOptions,
)
from gateway.settings import Settings
from tenants.registry import ModelKind, ModelSpec


def client_builder(
    settings: Settings, on_disagreement: Disagreement, on_overclaim: Overclaim
) -> Builder:
    salt_secret = settings.cache_salt_secret or settings.backend_secret or secrets.token_hex(32)

    async def build(spec: ModelSpec) -> EngineClient:
        if spec.kind is ModelKind.OPENAI:
            options = UpstreamOptions(
                salt_secret=salt_secret.encode(),
                priority=settings.upstream_priority_models.get(spec.name),
                salted=spec.name not in settings.upstream_shared_cache_models,
                on_disagreement=on_disagreement,
                on_overclaim=on_overclaim,
                probe_every_s=settings.upstream_probe_s,
            )
            return await OpenAIUpstreamClient.connect(spec, options)
        if settings.backend_secret is None:
            raise EngineUnavailable(
                f"model {spec.name!r} is served by Tollgate backends, which need "
                "TOLLGATE_BACKEND_SECRET on the gateway"
            )
        client = await RemoteEngineClient.connect(
            [t.url for t in spec.targets],
            settings.backend_secret,
            settings.data_dir,
            weights={t.url: t.weight for t in spec.targets},
        )
        client.model_name = spec.name  # the registry's name, whatever the replicas load
        return client

    return build
