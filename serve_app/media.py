"""Which media URLs in chat messages a model's replicas may load.

vLLM fetches any http(s) URL in an image/audio/video part unless told
otherwise, which would let a client make the cluster call internal addresses
(cloud metadata, admin ports). The gateway checks every media part against
the model's ``MediaPolicy`` before the request reaches a replica: inline
``data:`` URLs pass, http(s) only for configured domains, ``file://`` only
under a configured directory.
"""

from __future__ import annotations

import posixpath
from typing import Any
from urllib.parse import unquote, urlsplit

from replicas.config import MediaPolicy
from serve_app.errors import OpenAIError

# Content parts that point at media by URL (each holds {"url": ...} under its type).
_MEDIA_PARTS = frozenset({"image_url", "video_url", "audio_url"})


def check_media(messages: list[Any], policy: MediaPolicy) -> None:
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            url = _media_url(part)
            if url is not None:
                _check_url(url, policy)


def _media_url(part: Any) -> str | None:
    if not isinstance(part, dict) or part.get("type") not in _MEDIA_PARTS:
        return None
    holder = part.get(part["type"])
    url = holder.get("url") if isinstance(holder, dict) else holder
    return url if isinstance(url, str) else None


def _check_url(url: str, policy: MediaPolicy) -> None:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "data":
        return
    if scheme in ("http", "https"):
        host = (parts.hostname or "").lower()
        if policy.allowed_domains and host in {d.lower() for d in policy.allowed_domains}:
            return
        reason = "media URL fetching is off for this model" if not policy.allowed_domains else f"host '{host}' is not allowed"
    elif scheme == "file":
        path = posixpath.normpath(unquote(parts.path))
        root = posixpath.normpath(policy.local_dir) if policy.local_dir else None
        if root and (path == root or path.startswith(root.rstrip("/") + "/")):
            return
        reason = "local media files are off for this model" if not root else f"'{path}' is outside {root}"
    else:
        reason = f"unsupported URL scheme '{scheme}'"
    raise OpenAIError(
        400,
        f"Media URL refused: {reason}. Send the image inline as a data: URL (base64).",
        param="messages",
        code="media_url_not_allowed",
    )
