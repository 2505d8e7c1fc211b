"""A valid request for every ``key`` route of the ingress' table (``ROUTE_ACCESS``),
built for one chat model, with the ids its path names made by the caller that will
send it (a file, a batch, a stored response): what the route-access matrix sends with
each credential, so that a route answers what it serves, and a refusal can only be
the credential's (tests/e2e/quota_stack/test_1_route_access_e2e.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

HELLO = [{"role": "user", "content": "hi"}]


@dataclass
class RouteRequest:
    method: str
    path: str
    json: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    data: dict[str, str] | None = None
    files: dict[str, tuple[str, bytes]] | None = None

    def send(self, base_url: str, auth: dict[str, str]) -> httpx.Response:
        return httpx.request(
            self.method,
            base_url + self.path,
            json=self.json,
            data=self.data,
            files=self.files,
            headers={**self.headers, **auth},
            timeout=120,
        )


class Owned:
    """The ids a caller's path parameters name, made on first use by ``owner`` (the
    bearer secret whose file, batch and stored response they are)."""

    def __init__(self, base_url: str, owner: str, model: str):
        self.base_url, self.model = base_url, model
        self.auth = {"authorization": f"Bearer {owner}"}
        self._made: dict[str, str] = {}

    def _post(self, path: str, **kwargs) -> dict:
        response = httpx.post(self.base_url + path, headers=self.auth, timeout=120, **kwargs)
        assert response.status_code == 200, (path, response.status_code, response.text)
        return response.json()

    def file_id(self) -> str:
        if "file" not in self._made:
            line = {"custom_id": "l0", "method": "POST", "url": "/v1/chat/completions", "body": chat_body(self.model)}
            uploaded = self._post(
                "/v1/files", data={"purpose": "batch"}, files={"file": ("l.jsonl", json.dumps(line).encode() + b"\n")}
            )
            self._made["file"] = uploaded["id"]
        return self._made["file"]

    def batch_id(self) -> str:
        if "batch" not in self._made:
            self._made["batch"] = self._post("/v1/batches", json=batch_body(self.file_id()))["id"]
        return self._made["batch"]

    def response_id(self) -> str:
        if "response" not in self._made:
            stored = {"model": self.model, "input": "hi", "max_output_tokens": 2, "store": True}
            self._made["response"] = self._post("/v1/responses", json=stored)["id"]
        return self._made["response"]


def chat_body(model: str) -> dict:
    return {"model": model, "messages": HELLO, "max_tokens": 2}


def batch_body(file_id: str) -> dict:
    return {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}


def key_route_requests(model: str, owned: Owned) -> dict[tuple[str, str], Callable[[], RouteRequest]]:
    """For each ``key`` route, what builds its request (ids made only when it is built)."""
    chat, completion = chat_body(model), {"model": model, "prompt": "hi", "max_tokens": 2}
    embedding = {"model": model, "input": "hi"}
    azure = {"azureml-model-deployment": model}
    R = RouteRequest
    requests: dict[tuple[str, str], Callable[[], RouteRequest]] = {}
    for prefix in ("/v1/", "/v3/", "/serving-endpoints/"):
        requests[("POST", prefix + "chat/completions")] = lambda p=prefix: R("POST", p + "chat/completions", chat)
        requests[("POST", prefix + "completions")] = lambda p=prefix: R("POST", p + "completions", completion)
        requests[("POST", prefix + "embeddings")] = lambda p=prefix: R("POST", p + "embeddings", embedding)
    for prefix in ("/v1/", "/v3/"):
        requests[("GET", prefix + "models")] = lambda p=prefix: R("GET", p + "models")
        requests[("GET", prefix + "models/{model_id:path}")] = lambda p=prefix: R("GET", p + "models/" + model)
    for prefix in ("/", "/models/"):
        requests[("POST", prefix + "chat/completions")] = lambda p=prefix: R("POST", p + "chat/completions", chat)
        requests[("POST", prefix + "embeddings")] = lambda p=prefix: R(
            "POST", p + "embeddings", {"input": ["hi"]}, azure
        )
    requests[("GET", "/info")] = lambda: R("GET", "/info", headers=azure)
    requests[("GET", "/models/info")] = lambda: R("GET", "/models/info", headers=azure)
    requests[("POST", "/invocations")] = lambda: R(
        "POST", "/invocations", {"model": model, "inputs": "hi", "parameters": {"max_new_tokens": 2}}
    )
    requests[("POST", "/serving-endpoints/{name}/invocations")] = lambda: R(
        "POST", f"/serving-endpoints/{model}/invocations", {"prompt": "hi", "max_tokens": 2}
    )
    requests[("POST", "/v1/responses")] = lambda: R(
        "POST", "/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 2, "store": False}
    )
    requests[("POST", "/v1/messages")] = lambda: R("POST", "/v1/messages", chat)
    requests[("POST", "/v1/messages/count_tokens")] = lambda: R(
        "POST", "/v1/messages/count_tokens", {"model": model, "messages": HELLO}
    )
    for path in ("/score", "/v1/score"):
        requests[("POST", path)] = lambda p=path: R("POST", p, {"model": model, "queries": "a", "documents": ["b"]})
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        requests[("POST", path)] = lambda p=path: R("POST", p, {"model": model, "query": "a", "documents": ["b"]})
    requests[("POST", "/tokenize")] = lambda: R("POST", "/tokenize", {"model": model, "prompt": "hi"})
    requests[("POST", "/detokenize")] = lambda: R("POST", "/detokenize", {"model": model, "tokens": [1, 2]})
    # A key's own stored responses, files and batches.
    for method, suffix in (("GET", ""), ("DELETE", ""), ("GET", "/input_items")):
        requests[(method, "/v1/responses/{response_id}" + suffix)] = lambda m=method, s=suffix: R(
            m, f"/v1/responses/{owned.response_id()}{s}"
        )
    requests[("GET", "/v1/files")] = lambda: R("GET", "/v1/files")
    requests[("POST", "/v1/files")] = lambda: R(
        "POST", "/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", b'{"custom_id": "a"}\n')}
    )
    for method, suffix in (("GET", ""), ("DELETE", ""), ("GET", "/content")):
        requests[(method, "/v1/files/{file_id}" + suffix)] = lambda m=method, s=suffix: R(
            m, f"/v1/files/{owned.file_id()}{s}"
        )
    requests[("GET", "/v1/batches")] = lambda: R("GET", "/v1/batches")
    requests[("POST", "/v1/batches")] = lambda: R("POST", "/v1/batches", batch_body(owned.file_id()))
    requests[("GET", "/v1/batches/{batch_id}")] = lambda: R("GET", f"/v1/batches/{owned.batch_id()}")
    requests[("POST", "/v1/batches/{batch_id}/cancel")] = lambda: R("POST", f"/v1/batches/{owned.batch_id()}/cancel")
    return requests


class AdminOwned:
    """What the admin routes' paths name, made on first use with the admin credential:
    a team, a key of it (whose batch and request the admin looks at), a named admin."""

    def __init__(self, base_url: str, admin_secret: str, model: str, tag: str):
        self.base_url, self.model, self.tag = base_url, model, tag
        self.auth = {"authorization": f"Bearer {admin_secret}"}
        self._made: dict[str, Any] = {}

    def _admin(self, path: str, body: dict) -> dict:
        response = httpx.post(self.base_url + path, headers=self.auth, json=body, timeout=60)
        assert response.status_code == 201, (path, response.status_code, response.text)
        return response.json()

    def team(self) -> str:
        if "team" not in self._made:
            self._made["team"] = self._admin("/admin/teams", {"name": f"admin-team-{self.tag}"})["id"]
        return self._made["team"]

    def key(self) -> dict:
        if "key" not in self._made:
            self._made["key"] = self._admin("/admin/keys", {"name": f"admin-key-{self.tag}", "team": self.team()})
        return self._made["key"]

    def admin_name(self) -> str:
        if "admin" not in self._made:
            self._made["admin"] = self._admin("/admin/admins", {"name": f"admin-{self.tag}"})["name"]
        return self._made["admin"]

    def batch_id(self) -> str:
        if "batch" not in self._made:
            owned = Owned(self.base_url, self.key()["secret"], self.model)
            self._made["batch"] = owned.batch_id()
        return self._made["batch"]

    def request_id(self) -> str:
        """A request of the key's (its x-request-id), once its record is written."""
        if "request" not in self._made:
            request_id = f"admin-sees-{self.tag}"
            key_auth = {"authorization": f"Bearer {self.key()['secret']}", "x-request-id": request_id}
            chat = httpx.post(
                self.base_url + "/v1/chat/completions", headers=key_auth, json=chat_body(self.model), timeout=120
            )
            assert chat.status_code == 200, chat.text
            deadline = time.monotonic() + 30  # settled off the answer's path
            path = f"/admin/requests/{request_id}?key={self.key()['id']}"
            while httpx.get(self.base_url + path, headers=self.auth, timeout=60).status_code != 200:
                assert time.monotonic() < deadline, f"no record of {request_id}"
                time.sleep(0.2)
            self._made["request"] = request_id
        return self._made["request"]


def admin_route_requests(owned: AdminOwned) -> dict[tuple[str, str], Callable[[], tuple[RouteRequest, int]]]:
    """For each ``admin`` route, what builds its valid request and the status it answers."""
    R, tag = RouteRequest, owned.tag
    since = f"?start_time={int(time.time()) - 86_400}"
    return {
        ("GET", "/admin/admins"): lambda: (R("GET", "/admin/admins"), 200),
        ("POST", "/admin/admins"): lambda: (R("POST", "/admin/admins", {"name": f"made-{tag}"}), 201),
        ("DELETE", "/admin/admins/{name}"): lambda: (R("DELETE", f"/admin/admins/{owned.admin_name()}"), 200),
        ("GET", "/admin/keys"): lambda: (R("GET", "/admin/keys"), 200),
        ("POST", "/admin/keys"): lambda: (R("POST", "/admin/keys", {"name": f"made-{tag}"}), 201),
        ("GET", "/admin/keys/{key}"): lambda: (R("GET", f"/admin/keys/{owned.key()['id']}"), 200),
        ("PATCH", "/admin/keys/{key}"): lambda: (
            R("PATCH", f"/admin/keys/{owned.key()['id']}", {"requests_per_minute": 100}),
            200,
        ),
        ("DELETE", "/admin/keys/{key}"): lambda: (R("DELETE", f"/admin/keys/{owned.key()['id']}"), 200),
        ("GET", "/admin/keys/{key}/usage"): lambda: (R("GET", f"/admin/keys/{owned.key()['id']}/usage"), 200),
        ("GET", "/admin/teams"): lambda: (R("GET", "/admin/teams"), 200),
        ("POST", "/admin/teams"): lambda: (R("POST", "/admin/teams", {"name": f"made-{tag}"}), 201),
        ("GET", "/admin/teams/{team}"): lambda: (R("GET", f"/admin/teams/{owned.team()}"), 200),
        ("PATCH", "/admin/teams/{team}"): lambda: (
            R("PATCH", f"/admin/teams/{owned.team()}", {"requests_per_minute": 100}),
            200,
        ),
        ("DELETE", "/admin/teams/{team}"): lambda: (R("DELETE", f"/admin/teams/{owned.team()}"), 200),
        ("GET", "/admin/audit"): lambda: (R("GET", "/admin/audit"), 200),
        ("GET", "/admin/batches"): lambda: (R("GET", f"/admin/batches?key={owned.key()['id']}"), 200),
        ("POST", "/admin/batches/{batch_id}/cancel"): lambda: (
            R("POST", f"/admin/batches/{owned.batch_id()}/cancel"),
            200,
        ),
        ("GET", "/admin/requests/{request_id}"): lambda: (
            R("GET", f"/admin/requests/{owned.request_id()}?key={owned.key()['id']}"),
            200,
        ),
        ("GET", "/v1/organization/usage/completions"): lambda: (
            R("GET", "/v1/organization/usage/completions" + since),
            200,
        ),
        ("GET", "/v1/organization/costs"): lambda: (R("GET", "/v1/organization/costs" + since), 200),
    }
