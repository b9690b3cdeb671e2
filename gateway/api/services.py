"""What the generation routes use (chat, completions, responses, embeddings, and a batch
line through the same path), as one dependency the composition root provides."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.admission.idempotency import Idempotency
from gateway.admission.quota import Admission
from gateway.core.tasks import TaskSet
from gateway.dispatch.directory import ModelDirectory
from gateway.metering.recorder import UsageRecorder
from gateway.settings import Settings


@dataclass(frozen=True)
class GenerationServices:
    settings: Settings
    directory: ModelDirectory  # every model served, each name's client
    admission: Admission  # quotas: the reservation before, the settlement after
    idempotency: Idempotency
    recorder: UsageRecorder  # the ledger row of each request, priced
    tasks: TaskSet  # work that outlives the request (settlement, lock releases)
