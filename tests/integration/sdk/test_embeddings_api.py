"""/v1/embeddings with the official `openai` client against a real server (in-process
engine), and the same vectors from a backend replica over the internal API."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend import AsyncEngine, EngineConfig
from backend.builtin import BUILTIN_MODEL_DIR
from backend.server import create_backend_app
from gateway.core.errors import InvalidRequest
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.dispatch.remote import RemoteEngineClient
from tenants.models import UsageEvent
from tests.conftest import serving

TEXTS = ["What does json.dumps do?", "Return the sum of a list.", "What does json.dumps do?"]


async def test_same_text_same_vector_different_text_different_vector(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    # The SDK asks for base64 by default and decodes it to floats.
    result = await client.embeddings.create(model=engine_client.model_name, input=TEXTS)
    vectors = [d.embedding for d in result.data]
    assert [d.index for d in result.data] == [0, 1, 2]
    assert len(vectors[0]) == engine_client.hidden_size
    assert vectors[0] == vectors[2] != vectors[1]
    tokens = sum(len(engine_client.encode(t)) for t in TEXTS)
    assert result.usage.prompt_tokens == result.usage.total_tokens == tokens


async def test_base64_is_little_endian_float32_of_the_floats(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    model = engine_client.model_name
    floats = await client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    encoded = await client.embeddings.create(model=model, input=TEXTS[0], encoding_format="base64")
    raw = base64.b64decode(str(encoded.data[0].embedding))
    decoded = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert decoded == floats.data[0].embedding
    by_sdk = await client.embeddings.create(model=model, input=TEXTS[0])  # base64, decoded
    assert by_sdk.data[0].embedding == floats.data[0].embedding


async def test_token_ids_embed_as_their_text(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    model = engine_client.model_name
    ids = [engine_client.encode(t) for t in TEXTS[:2]]
    texts = await client.embeddings.create(model=model, input=TEXTS[:2])
    lists = await client.embeddings.create(model=model, input=ids)
    one = await client.embeddings.create(model=model, input=ids[0])
    assert [d.embedding for d in lists.data] == [d.embedding for d in texts.data]
    assert one.data[0].embedding == texts.data[0].embedding


async def test_dimensions_other_than_the_models_are_refused(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    model, size = engine_client.model_name, engine_client.hidden_size
    assert size is not None
    same = await client.embeddings.create(model=model, input="x", dimensions=size)
    assert len(same.data[0].embedding) == size
    with pytest.raises(openai.BadRequestError) as refused:
        await client.embeddings.create(model=model, input="x", dimensions=size // 2)
    assert refused.value.param == "dimensions"


@pytest.mark.parametrize(
    ("body_input", "param"),
    [([], "input"), ([[1, 2], "text"], "input"), ([[]], "input"), ("", "input")],
)
async def test_malformed_input_is_a_400_naming_it(
    base_url: str,
    tenant_key: str,
    engine_client: InProcessEngineClient,
    body_input: object,
    param: str,
) -> None:
    body = {"model": engine_client.model_name, "input": body_input}
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {tenant_key}"}) as http:
        response = await http.post(f"{base_url}/embeddings", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


async def test_an_input_longer_than_the_context_is_context_length_exceeded(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    too_long = [5] * engine_client.max_model_len
    with pytest.raises(openai.BadRequestError) as refused:
        await client.embeddings.create(model=engine_client.model_name, input=[too_long])
    assert refused.value.code == "context_length_exceeded"
    assert refused.value.param == "input"


async def test_an_embedding_is_one_ledger_row_of_input_tokens(
    client: openai.AsyncOpenAI,
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    result = await client.embeddings.create(model=engine_client.model_name, input=TEXTS)
    async with sessions() as session:
        rows = (await session.scalars(select(UsageEvent))).all()
    assert len(rows) == 1
    row = rows[0]
    assert row.endpoint == "embeddings"
    assert (row.prompt_tokens, row.completion_tokens) == (result.usage.prompt_tokens, 0)
    assert row.cost_micros > 0


async def test_a_replica_embeds_as_the_engine_in_process(
    engine_client: InProcessEngineClient, tmp_path: Path
) -> None:
    engine = AsyncEngine.from_pretrained(BUILTIN_MODEL_DIR, EngineConfig(max_num_seqs=4))
    app = create_backend_app(engine, BUILTIN_MODEL_DIR, secret="s3cret")
    async with serving(app) as url:
        remote = await RemoteEngineClient.connect([url], "s3cret", tmp_path)
        try:
            prompts = [engine_client.encode(t) for t in TEXTS]
            assert remote.hidden_size == engine_client.hidden_size
            assert await remote.embed(prompts) == await engine_client.embed(prompts)
            with pytest.raises(InvalidRequest) as refused:
                await remote.embed([[10**6]])
            assert refused.value.param == "prompt"
        finally:
            await remote.close()
