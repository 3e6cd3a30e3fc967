"""A local Google Cloud Storage server for the tests: ``gs://`` paths without a network.

:func:`emulator` starts ``gcp-storage-emulator`` (the ``test`` extra) in memory on a free
localhost port, in its own process, with one bucket, and points every client in this
process, and in the processes a test starts, at it through the environment:

* ``STORAGE_EMULATOR_HOST``: gcsfs (what ``etils.epath`` and so the library use for
  ``gs://``) talks to the emulator, anonymously;
* ``TENSORSTORE_GCS_HTTP_URL`` and ``GOOGLE_AUTH_TOKEN_FOR_TESTING``: tensorstore (orbax's
  array writer) talks to it too, without looking for real credentials (without them it
  waits for them);
* ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``: gcsfs's newer file system asks Google's
  control plane for each bucket's layout, which an emulator does not serve (one warning
  per call, and a fall-back to the plain file system anyway).

Known differences from GCS, seen here: the emulator answers 501 to gcsfs's ``moveTo``, so
a rename falls back to copy and delete after gcsfs's retries (about 30 s): the library
never renames on an object store (:mod:`meshensemble.runtime.storage`). Its downloads lack
the object's generation and ignore the read conditions tensorstore uses: it runs through
``tests/gcs_server.py``, which adds them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

BUCKET = "bucket"
"""The bucket :func:`emulator` creates."""
START_TIMEOUT = 60
"""Seconds the emulator may take to answer (it answers in about 0.3 s when idle)."""


@dataclasses.dataclass(frozen=True)
class Emulator:
    """A running emulator.

    Attributes:
      url: ``http://127.0.0.1:PORT``.
      bucket: the bucket's name.
      env: the environment variables that point clients at it.
      started_s: seconds it took to start and answer.
    """

    url: str
    bucket: str
    env: dict[str, str]
    started_s: float

    def path(self, *parts: str) -> str:
        """``gs://BUCKET/part/...``."""
        return "/".join([f"gs://{self.bucket}", *parts])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def emulator(bucket: str = BUCKET) -> Iterator[Emulator]:
    """Starts the emulator with ``bucket``, sets the environment; undoes both after.

    Yields:
      The :class:`Emulator`.

    Raises:
      RuntimeError: it did not answer within :data:`START_TIMEOUT` (its output attached).
    """
    with tempfile.TemporaryFile("w+") as log:  # not a pipe: request tracebacks would fill it
        yield from _serve(bucket, log)


def _serve(bucket: str, log: Any) -> Iterator[Emulator]:
    start = time.monotonic()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    patched = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gcs_server.py")
    cmd = [sys.executable, patched, "start", "--in-memory", "--quiet"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--default-bucket", bucket]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    env = {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }
    before = {k: os.environ.get(k) for k in env}
    try:
        while not _answers(url):
            if proc.poll() is not None or time.monotonic() - start > START_TIMEOUT:
                proc.kill()
                proc.wait()
                log.seek(0)
                raise RuntimeError(f"the GCS emulator did not start: {log.read()[-2000:]}")
            time.sleep(0.05)
        os.environ.update(env)
        yield Emulator(url, bucket, env, time.monotonic() - start)
    finally:
        for k, v in before.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
