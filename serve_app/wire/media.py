"""Which media URLs in chat messages a model's replicas may load.

vLLM fetches any http(s) URL in a media part unless told otherwise, which
would let a client make the cluster call internal addresses (cloud metadata,
the Ray dashboard, admin ports). vLLM reads a URL from more shapes than the
typed ``image_url``/``audio_url``/``video_url`` parts: ``input_image`` parts,
parts with no ``type`` (or with a ``uuid``) that carry one of those fields, a
bare string instead of ``{"url": ...}``. So the gateway checks every
URL-carrying field of every content part of every message, whatever the
part's type, against the model's ``MediaPolicy`` before the request reaches
a replica: inline ``data:`` URLs pass, http(s) only for configured domains,
``file://`` only under a configured directory. The replica enforces the same
policy again (deny-all by default, no redirects: replicas/vllm_engine.py).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

from contract.model_config import MediaPolicy
from serve_app.errors import OpenAIError

# Fields vLLM (or a model's processor) may read a URL from, at any depth of a
# content part: a string, or {"url": string}.
URL_FIELDS = frozenset({"image_url", "audio_url", "video_url", "input_image", "file_url", "url"})


def check_media(messages: Any, policy: MediaPolicy) -> None:
    if not isinstance(messages, list):
        return  # not a message list: the request's own validation answers it
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            for url in media_urls(part):
                _check_url(url, policy)


def media_urls(value: Any, depth: int = 0) -> Iterator[str]:
    """Every URL string under a URL-carrying field of ``value``, however nested."""
    if depth > 8:  # deeper than any part shape vLLM reads; refuse rather than guess
        raise OpenAIError(400, "Content part nested too deeply.", param="messages", code="invalid_content_part")
    if isinstance(value, dict):
        for field, inner in value.items():
            if field in URL_FIELDS and isinstance(inner, str):
                yield inner
            else:
                yield from media_urls(inner, depth + 1)
    elif isinstance(value, list):
        for item in value:
            yield from media_urls(item, depth + 1)


def _check_url(url: str, policy: MediaPolicy) -> None:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "data":
        return
    if scheme in ("http", "https"):
        host = (parts.hostname or "").lower()
        if policy.allowed_domains and host in {d.lower() for d in policy.allowed_domains}:
            return
        reason = (
            "media URL fetching is off for this model"
            if not policy.allowed_domains
            else f"host '{host}' is not allowed"
        )
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
