"""The file store's two implementations, one contract: the data folder, and an S3 bucket on
a real S3-compatible server (moto's, on loopback). And the Files API's rows over each:
one tenant's file is never another's, deleted bytes are gone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.batches.service import open_blob_store
from gateway.settings import Settings
from tenants.blobs import BlobStore, FolderBlobStore, S3BlobStore, S3Location, s3_client
from tenants.errors import NotFoundError
from tenants.files import FileStore
from tenants.services import TenantService
from tests.conftest import migrated_sqlite
from tests.support.s3 import s3_env, s3_server


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Location]:
    with s3_server() as location:
        yield location


@pytest.fixture(params=["folder", "s3"])
def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    if request.param == "folder":
        return FolderBlobStore(tmp_path / "files")
    location: S3Location = request.getfixturevalue("s3")
    return S3BlobStore(location)


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return migrated_sqlite(tmp_path / "files.db")


async def test_a_blob_is_kept_read_back_and_deleted(blobs: BlobStore, tmp_path: Path) -> None:
    content = b'{"custom_id": "a"}\n' * 1000 + bytes(range(256))
    await blobs.put("tenant-a/file-1", content)
    await blobs.put("tenant-b/file-1", b"other")
    assert await blobs.get("tenant-a/file-1") == content
    assert await blobs.get("tenant-b/file-1") == b"other"
    await blobs.put("tenant-a/file-1", b"replaced")
    assert await blobs.get("tenant-a/file-1") == b"replaced"
    await blobs.delete("tenant-a/file-1")
    await blobs.delete("tenant-a/file-1")  # twice: still fine
    with pytest.raises(NotFoundError):
        await blobs.get("tenant-a/file-1")
    assert await blobs.get("tenant-b/file-1") == b"other"
    if isinstance(blobs, FolderBlobStore):  # nothing half-written left beside the files
        assert sorted(p.name for p in (tmp_path / "files").rglob("*")) == [
            "file-1",
            "tenant-a",
            "tenant-b",
        ]


async def test_files_of_one_tenant_are_not_anothers_on_either_store(
    blobs: BlobStore, sessions: async_sessionmaker[AsyncSession]
) -> None:
    async with sessions.begin() as session:
        acme = (await TenantService(session).create("acme")).id
        globex = (await TenantService(session).create("globex")).id
        stored = await FileStore(session, blobs, acme).create("in.jsonl", "batch", b"acme's\n")
    async with sessions.begin() as session:
        assert await FileStore(session, blobs, acme).content(stored.id) == b"acme's\n"
        other = FileStore(session, blobs, globex)
        with pytest.raises(NotFoundError):
            await other.content(stored.id)
        with pytest.raises(NotFoundError):
            await other.delete(stored.id)
        assert await other.list() == []
    async with sessions.begin() as session:
        await FileStore(session, blobs, acme).delete(stored.id)
    with pytest.raises(NotFoundError):
        await blobs.get(f"{acme}/{stored.id}")


def test_the_settings_pick_the_store(s3: S3Location, tmp_path: Path) -> None:
    folder = open_blob_store(Settings.from_env({"TOLLGATE_DATA_DIR": str(tmp_path)}))
    assert isinstance(folder, FolderBlobStore) and folder.root == tmp_path / "files"
    chosen = open_blob_store(Settings.from_env(s3_env(s3)))
    assert isinstance(chosen, S3BlobStore) and chosen.location == s3


async def test_objects_live_under_the_prefix_in_the_bucket(s3: S3Location) -> None:
    store = S3BlobStore(s3)
    await store.put("tenant-a/file-2", b"x")
    listed = s3_client(s3).list_objects_v2(Bucket=s3.bucket, Prefix="files/tenant-a/")
    assert [o["Key"] for o in listed["Contents"]] == ["files/tenant-a/file-2"]
