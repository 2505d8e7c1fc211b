"""Pure logic: which media URLs the gateway lets through to a replica."""

import pytest
from http_checks import Listener

from contract.model_config import MediaPolicy
from serve_app.errors import OpenAIError
from serve_app.wire.media import check_media


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


# Every shape vLLM 0.32 reads a media URL from (renderers/chat_utils.py
# `_parse_chat_message_content_mm_part`), and nested or odd variants of them.
def part_shapes(url):
    return {
        "typed image_url": {"type": "image_url", "image_url": {"url": url}},
        "typed image_url, bare string": {"type": "image_url", "image_url": url},
        "input_image (Responses shape)": {"type": "input_image", "image_url": url},
        "untyped image_url": {"image_url": url},
        "untyped image_url dict": {"image_url": {"url": url}},
        "uuid with typed image_url": {"type": "image_url", "image_url": {"url": url}, "uuid": "x"},
        "uuid with untyped audio_url": {"uuid": "x", "audio_url": url},
        "untyped video_url dict": {"video_url": {"url": url}},
        "unknown type carrying a url": {"type": "made_up", "made_up": {"url": url}},
        "text type carrying image_url": {"type": "text", "text": "hi", "image_url": url},
        "nested list": {"type": "image_url", "image_url": [{"url": url}]},
        "file_url": {"type": "input_file", "file_url": url},
    }


@pytest.mark.parametrize("shape", list(part_shapes("x")))
def test_every_part_shape_is_checked(shape):
    url = "http://169.254.169.254/latest/meta-data/"
    with pytest.raises(OpenAIError) as caught:
        check_media([{"role": "user", "content": [part_shapes(url)[shape]]}], MediaPolicy())
    assert caught.value.status == 400 and caught.value.code == "media_url_not_allowed"
    check_media([{"role": "user", "content": [part_shapes("data:image/png;base64,AAAA")[shape]]}], MediaPolicy())


def test_parts_in_any_message_role_are_checked():
    for role in ("system", "assistant", "tool", "developer"):
        with pytest.raises(OpenAIError):
            check_media([{"role": role, "content": [{"image_url": "http://10.0.0.1/"}]}], MediaPolicy())


def test_hostile_nesting_is_a_400_not_a_crash():
    part: dict = {"url": "data:,"}
    for _ in range(50):
        part = {"x": part}
    with pytest.raises(OpenAIError) as caught:
        check_media([{"role": "user", "content": [part]}], MediaPolicy())
    assert caught.value.status == 400


def test_non_list_messages_are_left_to_validation():
    check_media(None, MediaPolicy())
    check_media("hi", MediaPolicy())


def test_the_replicas_media_fetcher_opens_no_connection_by_default():
    # The replica's second line: vLLM's own fetcher, configured as vllm_cli_args
    # configures it for a model with the default policy.
    from vllm.multimodal.media import MediaConnector

    from replicas.vllm_engine import NO_MEDIA_DOMAIN

    listener = Listener()
    try:
        connector = MediaConnector(allowed_media_domains=[NO_MEDIA_DOMAIN])
        for url in (f"http://127.0.0.1:{listener.port}/a.png", f"http://localhost:{listener.port}/a.png"):
            with pytest.raises(ValueError):
                connector.fetch_image(url)
        with pytest.raises(RuntimeError, match="allowed-local-media-path"):
            connector.fetch_image("file:///etc/passwd")
        assert listener.connections == 0
        # The control: the same fetcher allowed to that host does connect.
        with pytest.raises(Exception):  # noqa: B017 (whatever the bad image raises: the count is the check)
            MediaConnector(allowed_media_domains=["127.0.0.1"]).fetch_image(f"http://127.0.0.1:{listener.port}/a.png")
        assert listener.connections >= 1  # (its HTTP client retries)
    finally:
        listener.close()


def test_the_replicas_media_fetcher_does_not_follow_redirects(monkeypatch):
    # An allowed host that answers with a redirect must not lead the fetch elsewhere.
    import http.server
    import threading

    from vllm.multimodal.media import MediaConnector

    from replicas.vllm_engine import MEDIA_ENV

    target = Listener()

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{target.port}/metadata")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for name, value in MEDIA_ENV.items():
            monkeypatch.setenv(name, value)
        connector = MediaConnector(allowed_media_domains=["127.0.0.1"])
        with pytest.raises(Exception):  # noqa: B017 (refused before connecting: the count is the check)
            connector.fetch_image(f"http://127.0.0.1:{server.server_port}/a.png")
        assert target.connections == 0
    finally:
        server.shutdown()
        server.server_close()
        target.close()
