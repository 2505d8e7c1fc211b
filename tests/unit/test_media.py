"""Pure logic: which media URLs the gateway lets through to a replica."""

import pytest

from replicas.config import MediaPolicy
from serve_app.errors import OpenAIError
from serve_app.media import check_media


def messages(url, part_type="image_url"):
    return [{"role": "user", "content": [{"type": "text", "text": "?"}, {"type": part_type, part_type: {"url": url}}]}]


OPEN = MediaPolicy(allowed_domains=["images.example.com"], local_dir="/srv/media")


@pytest.mark.parametrize(
    "url, policy",
    [
        ("data:image/png;base64,AAAA", MediaPolicy()),
        ("https://images.example.com/a.png", OPEN),
        ("http://IMAGES.example.com/a.png", OPEN),
        ("file:///srv/media/cats/a.png", OPEN),
        ("file:///srv/media", OPEN),
    ],
)
def test_allowed(url, policy):
    check_media(messages(url), policy)


@pytest.mark.parametrize(
    "url, policy",
    [
        ("http://169.254.169.254/latest/meta-data/", MediaPolicy()),
        ("https://images.example.com/a.png", MediaPolicy()),
        ("https://evil.example.com/a.png", OPEN),
        ("https://images.example.com.evil.net/a.png", OPEN),
        ("file:///etc/passwd", MediaPolicy()),
        ("file:///etc/passwd", OPEN),
        ("file:///srv/media/../../etc/passwd", OPEN),
        ("file:///srv/media-other/a.png", OPEN),
        ("ftp://images.example.com/a.png", OPEN),
        ("gopher://localhost:6379/_FLUSHALL", OPEN),
    ],
)
@pytest.mark.parametrize("part_type", ["image_url", "video_url", "audio_url"])
def test_refused(url, policy, part_type):
    with pytest.raises(OpenAIError) as caught:
        check_media(messages(url, part_type), policy)
    assert caught.value.status == 400 and caught.value.code == "media_url_not_allowed"


def test_text_only_and_string_content_pass():
    check_media([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], MediaPolicy())
