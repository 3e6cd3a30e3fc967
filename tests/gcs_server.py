"""``python tests/gcs_server.py start ...``: gcp-storage-emulator, with what tensorstore needs
of a download that the emulator leaves out (tests/gcs.py starts it this way).

Real GCS answers a media download with the object's generation (``x-goog-generation``) and
honours ``ifGenerationNotMatch`` (304 when the object is unchanged) and
``ifGenerationMatch`` (412 when it changed). Tensorstore, which orbax writes arrays with,
revalidates its cached OCDBT manifest that way; the emulator (2026.7.19) sends no
generation and ignores both conditions, and tensorstore then fails the save ("Malformed
StorageGeneration"), which happened when a loaded machine made its cache entries old
enough to revalidate (2 saves in 18 at load 8 on 2 cores). This adds the three to its
download handler and runs it unchanged otherwise.
"""

from __future__ import annotations

import sys
from http import HTTPStatus
from typing import Any

from gcp_storage_emulator import server
from gcp_storage_emulator.__main__ import main
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_download = objects.download  # the emulator's own


def download(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
    """The emulator's download, with the object's generation and its two conditions."""
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except NotFound:
        return _download(request, response, storage, *args, **kwargs)
    generation = str(obj["generation"])
    if request.query.get("ifGenerationNotMatch", [None])[0] == generation:
        response.status = HTTPStatus.NOT_MODIFIED
        return None
    if request.query.get("ifGenerationMatch", [generation])[0] != generation:
        response.status = HTTPStatus.PRECONDITION_FAILED
        return None
    response["x-goog-generation"] = generation
    response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
    return _download(request, response, storage, *args, **kwargs)


if __name__ == "__main__":
    objects.download = download  # what the JSON API's GET ?alt=media calls
    for _, methods in server.HANDLERS:
        for method, handler in list(methods.items()):
            if handler is _download:
                methods[method] = download
    main(sys.argv[1:])
