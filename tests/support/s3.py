"""An S3-compatible server on loopback for tests: moto's server mode (S3 only), in a thread
of the test process, with one empty bucket. Any process the test starts reaches it at
`location.endpoint_url`."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from moto.server import ThreadedMotoServer

from tenants.blobs import S3Location, s3_client

# moto accepts any credentials; a real client still signs with some.
ACCESS_KEY_ID = "tollgate-test"
SECRET_ACCESS_KEY = "tollgate-test-secret"


@contextmanager
def s3_server() -> Iterator[S3Location]:
    """A running server and a fresh bucket on it, stopped on exit."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        location = S3Location(
            bucket=f"tollgate-{uuid.uuid4().hex[:12]}",
            endpoint_url=f"http://{host}:{port}",
            access_key_id=ACCESS_KEY_ID,
            secret_access_key=SECRET_ACCESS_KEY,
        )
        s3_client(location).create_bucket(Bucket=location.bucket)
        yield location
    finally:
        server.stop()


def s3_env(location: S3Location) -> dict[str, str]:
    """The TOLLGATE_S3_* variables that select `location` (for a process the test starts)."""
    assert location.endpoint_url and location.access_key_id and location.secret_access_key
    return {
        "TOLLGATE_S3_BUCKET": location.bucket,
        "TOLLGATE_S3_ENDPOINT_URL": location.endpoint_url,
        "TOLLGATE_S3_REGION": location.region,
        "TOLLGATE_S3_PREFIX": location.prefix,
        "TOLLGATE_S3_ACCESS_KEY_ID": location.access_key_id,
        "TOLLGATE_S3_SECRET_ACCESS_KEY": location.secret_access_key,
    }
