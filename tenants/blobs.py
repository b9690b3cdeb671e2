"""Where the bytes of uploaded files live: the data folder (embedded mode, or a volume every
process mounts) or an S3-compatible bucket (stack mode: a Celery worker on another machine
reads the input file a gateway stored, and writes the output file the gateway serves).
tenants/files.py keeps the rows and names each blob `<tenant id>/<file id>`; a store only
puts, gets and deletes bytes by that name."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tenants.errors import NotFoundError


@runtime_checkable  # Litestar checks a dependency against its type
class BlobStore(Protocol):
    async def put(self, name: str, content: bytes) -> None:
        """Whole or absent: a crash halfway leaves no half blob under `name`."""
        ...

    async def get(self, name: str) -> bytes:
        """The bytes; NotFoundError when there are none."""
        ...

    async def delete(self, name: str) -> None:
        """Gone, whether or not it was there."""
        ...


class FolderBlobStore:
    """Blobs as files under `root` (one folder per tenant), written aside and renamed."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, name: str) -> Path:
        return self.root / name

    async def put(self, name: str, content: bytes) -> None:
        await asyncio.to_thread(self._write, self._path(name), content)

    async def get(self, name: str) -> bytes:
        try:
            return await asyncio.to_thread(self._path(name).read_bytes)
        except FileNotFoundError:
            raise NotFoundError("the file's content is gone") from None

    async def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    @staticmethod
    def _write(path: Path, content: bytes) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = path.with_suffix(".part")
        temporary.write_bytes(content)
        os.replace(temporary, path)


@dataclass(frozen=True)
class S3Location:
    """A bucket on AWS S3 or any S3-compatible server (MinIO, Ceph, R2...). Credentials left
    unset come from boto3's own chain (AWS_* variables, an instance or pod role)."""

    bucket: str
    endpoint_url: str | None = None  # None: AWS
    region: str = "us-east-1"
    prefix: str = "files/"
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)


class S3BlobStore:
    """Blobs as objects `<prefix><name>` in one bucket. An S3 PUT is atomic, so a crash
    leaves the old object or none. boto3 blocks: each call runs in a thread (its clients
    are thread-safe)."""

    def __init__(self, location: S3Location, client: Any | None = None) -> None:
        self.location = location
        self.client = client if client is not None else s3_client(location)

    def _key(self, name: str) -> str:
        return self.location.prefix + name

    async def put(self, name: str, content: bytes) -> None:
        await asyncio.to_thread(
            self.client.put_object, Bucket=self.location.bucket, Key=self._key(name), Body=content
        )

    async def get(self, name: str) -> bytes:
        return await asyncio.to_thread(self._read, self._key(name))

    async def delete(self, name: str) -> None:
        await asyncio.to_thread(
            self.client.delete_object, Bucket=self.location.bucket, Key=self._key(name)
        )

    def _read(self, key: str) -> bytes:
        try:
            answer = self.client.get_object(Bucket=self.location.bucket, Key=key)
        except self.client.exceptions.NoSuchKey:
            raise NotFoundError("the file's content is gone") from None
        body: bytes = answer["Body"].read()
        return body


def s3_client(location: S3Location) -> Any:
    """A boto3 S3 client for `location`; path-style addressing, which every S3-compatible
    server understands (virtual-host style needs a DNS name per bucket)."""
    import boto3  # stack mode only: the embedded default never loads the AWS SDK
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=location.endpoint_url,
        region_name=location.region,
        aws_access_key_id=location.access_key_id,
        aws_secret_access_key=location.secret_access_key,
        config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard"}),
    )
