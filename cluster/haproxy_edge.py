"""The edge's own settings on Ray Serve's HAProxy config, which Ray does not expose.

Ray writes HAProxy's config from its template and starts ``haproxy -f <file>`` (again
on every reload) through ``llm-haproxy`` (``haproxy_guard.py``), which passes it
through ``edge_config`` first:

- ``timeout client`` (``CLIENT_SILENCE_S``, in place of Ray's hour): how long a client
  may leave HAProxy waiting for its body's next bytes or for it to read its answer.
- ``timeout http-request`` (Ray leaves it unset): a client has this long to send a
  request's headers, so connections trickling a header line every few seconds (a
  slowloris; HAProxy's ``maxconn`` is 4,096) are closed with a 408 instead of locking
  every tenant out; ``timeout http-keep-alive``: how long an idle kept-alive
  connection is held between requests.
- ``EDGE_TIME_HEADER`` on every request a frontend forwards: when HAProxy had it, so
  a trace shows the hop from the edge to the ingress (an "edge" span: HAProxy 2.8 as
  Ray ships it is built without OpenTelemetry, ``-OT``).
- HAProxy's own answers in OpenAI's error envelope as JSON, with their real status
  (no replica up: 503 with ``Retry-After``; a replica gone: 502; too slow: 504), instead
  of Ray's plain-text "Internal Server Error" for all three. HAProxy 2.8 answers the
  errors it raises before a request is parsed (a 408 for headers too slow, a 400 for a
  request line past its buffer) with its own HTML whatever the config says (tried:
  ``errorfile`` and ``http-error`` in the defaults and in the frontend; its HTTP/1 mux,
  ``h1_send_error``, writes the built-in ``http_err_msgs`` and reads the configured
  error file only to see whether it is empty, which would close without an answer);
  their status is right, their body is not JSON.
- One hop at ``/v1`` for the models with a direct route: a POST to one of
  ``ONE_HOP_ROUTES`` whose JSON body names such a model is sent to that model's
  application (``/direct/<model>/v1/...``: its replicas run the gateway in-process,
  serve_app/http/direct.py) instead of to the ingress, which would reach the same
  replicas a hop later. HAProxy reads ``model`` from the body once it has it all (up
  to ``ONE_HOP_BODY_BYTES``, its buffer, raised to that); a body it cannot read (larger,
  not JSON, a model without a direct route)
  goes to the ingress as before, which answers it the same way. The models are those
  whose direct application Ray's config routes (its ``path_beg /direct/<model>/`` ACLs),
  so the edge follows deployments with nothing to configure; each is named by its
  name, its aliases and its LoRA adapters (``route_names``: asked of one of its replicas
  when the config is written, ``contract.edge.EDGE_NAMES_PATH``; a route whose replicas
  do not answer in time keeps its own name only, its other names taking the ingress' two
  hops until the next reload). Every change of names is a new deployment of the model's
  application (its arguments change), hence new replicas, hence a reload. Only while
  one of the route's replicas is up: a model scaled to zero, or whose replicas are all
  down, goes to the ingress, which wakes it and waits for it (``one_hop_rules``).
- Session affinity on a direct route: a request carrying the session header
  (``contract.edge.session_header()``, ``x-session-id`` unless Ray's
  ``RAY_SERVE_SESSION_ID_HEADER_KEY`` names another) goes to a copy of the direct
  application's backend that picks the replica by a consistent hash of that header
  and the credential's (``session_hash``: another tenant's equal session id is another
  session), bounded by ``SESSION_BALANCE_FACTOR`` (HAProxy's ``hash-balance-factor``: no replica
  takes more than that share of the mean load; past it a session moves, and its
  history is cached again there). The copy's servers track the originals' health.
  Requests without the header keep Ray's balancing (least connections). A direct
  application with an ingress request router (a model routed with affinity on several
  replicas: serve_app/http/edge_router.py) has its replica picked there, sessions
  included, so it gets no session copy.
- ``option forwardfor``: every request carries the client's address as the last
  ``X-Forwarded-For`` (the gateway counts failed admin credentials per client).
- HAProxy's own listeners tell nobody anything: its statistics page (Ray's ``listen
  stats``, every interface, no credential: every backend, replica name and address) and
  its Prometheus exporter (``frontend prometheus``) are bound to ``EDGE_ADMIN_HOST``
  (``LLM_EDGE_ADMIN_HOST``, default 127.0.0.1: reach them through an SSH tunnel, or set
  the node's private address and firewall it, docs/operating.md "What listens where"),
  and its admin socket (``stats socket``, which can stop and reroute servers) is
  ``mode 600`` (Ray writes 666): only the user running Ray talks to it, as Ray does.
- The credential goes to a direct route's edge router with the body: Ray's Lua action
  (``lua-load-per-thread``) forwards the body, the session and request-id headers to
  ``/internal/route``; the patched copy this loads (``edge_router_lua``) adds the
  client's credential headers, so the router salts the prompt it routes as the replica's
  gateway will (the tenant's cache: serve_app/identity/cache_isolation.py), and a
  tenant's requests are placed where its own cache is, never where another's is.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time
import urllib.request
from http import HTTPStatus
from pathlib import Path

from contract.edge import (
    CREDENTIAL_HEADERS,
    DIRECT_ROUTE_ROOT,
    EDGE_NAMES_PATH,
    EDGE_REQUEST_HEADER,
    EDGE_TIME_HEADER,
    ONE_HOP_ROUTES,
    session_header,
)

REQUEST_HEADERS_TIMEOUT_S = 10
KEEP_ALIVE_TIMEOUT_S = 60
# How long a client may leave HAProxy waiting on it (``timeout client``, Ray's 3,600 s):
# for the next bytes of its request's body, or to read what HAProxy has for it. It does
# not run while the client waits on an answer (a long unary call, a stream between
# tokens: tried, a 2 s timeout let both run 6 s). The routes bound a body's whole time
# (``ingress.body_timeout_s``, 60 s; an upload by its rate: serve_app/http/body_bounds.py),
# so no body they take pauses this long; a client that stops reading its stream is cut
# after it, and its request ends as one whose client left (settled for what it got),
# instead of holding its slot and the engine's sequence for an hour. ``LLM_EDGE_CLIENT_SILENCE_S``
# sets another (clients that pause reading their streams longer).
CLIENT_SILENCE_S = 60


def client_silence_s() -> int:
    """HAProxy's ``timeout client``, in seconds (``LLM_EDGE_CLIENT_SILENCE_S``, else ``CLIENT_SILENCE_S``)."""
    return int(os.environ.get("LLM_EDGE_CLIENT_SILENCE_S") or CLIENT_SILENCE_S)


# The largest body the edge reads a model from (HAProxy's request buffer; about 60k
# tokens of text): larger ones take the ingress' two hops. Each request being read
# holds one such buffer, taken from a pool as needed, not one per connection.
ONE_HOP_BODY_BYTES = 256 * 1024
# How long the edge waits for such a body to arrive whole (or to fill its buffer):
# HAProxy's ``timeout http-request`` bounds it too, so a model request's headers and
# the first ``ONE_HOP_BODY_BYTES`` of its body must come within this (at least 26
# KiB/s), else 408; the rest of a larger body has the ingress' ``body_timeout_s``.
ONE_HOP_BODY_WAIT_S = REQUEST_HEADERS_TIMEOUT_S
# A session's replica takes it while that replica runs at most 150% of the mean load
# (in connections); the ingress' routers keep the same spirit with their load guard.
SESSION_BALANCE_FACTOR = 150
SESSION_BACKEND_SUFFIX = "-session"
# Ray's copy of an application's backend whose replica its ingress request router picks.
ROUTED_BACKEND_SUFFIX = "-via-ingress-request-router"
# Each direct route (as its prefix writes the model's name) -> what clients may name its
# model by: (whole names, beginnings of names).
RouteNames = dict[str, tuple[list[str], list[str]]]

# The statuses HAProxy itself answers (those its `errorfile` takes), what each
# tells an OpenAI client, and OpenAI's error type and code for it.
# Ray's own listing of its applications' routes (its HAProxy answers it by itself).
RAY_ROUTES_PATH = "/-/routes"

EDGE_ERRORS = {
    400: (
        "The request could not be read (a malformed request, or a request line or headers too long).",
        "invalid_request_error",
        "bad_request",
    ),
    403: ("The request was refused.", "permission_error", "forbidden"),
    404: ("Unknown request URL.", "invalid_request_error", "unknown_url"),
    405: ("Method not allowed.", "invalid_request_error", "method_not_allowed"),
    408: (
        f"The request was not sent in time (its headers, and the start of a model request's body, within "
        f"{REQUEST_HEADERS_TIMEOUT_S}s).",
        "invalid_request_error",
        "request_timeout",
    ),
    413: ("The request is too large.", "invalid_request_error", "request_too_large"),
    429: ("Too many requests.", "rate_limit_error", "rate_limit_exceeded"),
    500: ("The server had an error processing your request.", "server_error", None),
    501: ("Not implemented.", "server_error", None),
    502: ("No replica of the service answered. Please retry.", "server_error", "bad_gateway"),
    503: (
        "The service has no replica ready. Please retry shortly.",
        "service_unavailable_error",
        "service_unavailable",
    ),
    504: ("The service did not answer in time. Please retry.", "server_error", "gateway_timeout"),
}

_DEFAULTS = re.compile(r"^defaults[^\n]*\n", re.MULTILINE)
_GLOBAL = re.compile(r"^global[^\n]*\n", re.MULTILINE)
_FRONTEND = re.compile(r"^frontend[^\n]*\n", re.MULTILINE)
_BUFSIZE = re.compile(r"^(\s*)tune\.bufsize (\d+)$", re.MULTILINE)
# Ray's ACL naming a direct application's backend (is_<backend>) by its route prefix
# (/direct/<model>/): the backend and the model, as the prefix writes it.
_DIRECT_ACL = re.compile(rf"^\s*acl is_(\S+) path_beg {re.escape(DIRECT_ROUTE_ROOT)}([^/\s]+)/$", re.MULTILINE)
_FIRST_USE_BACKEND = re.compile(r"^\s*use_backend ", re.MULTILINE)
_SERVER = re.compile(r"^(\s*)server (\S+) (\S+)(.*)$", re.MULTILINE)
# A name HAProxy's config reads as one word as it is (no space, '#', quote or backslash);
# a name with anything else takes the ingress' two hops.
_CONFIG_WORD = re.compile(r"[A-Za-z0-9._:/@+=-]+")
# A config line holds at most 64 words (HAProxy's MAX_LINE_ARGS): names go this many to a rule.
NAMES_PER_RULE = 48
# How long the edge waits for a direct route's replica to say its names, and for all
# routes together (HAProxy's start, which this delays, may take Ray's 30 s).
NAMES_TIMEOUT_S = 1.0
NAMES_BUDGET_S = 3.0
# HAProxy's statistics and metrics listeners (Ray binds them to every interface).
_ADMIN_SECTION = re.compile(r"^(listen stats|frontend prometheus)\b")
_ANY_INTERFACE_BIND = re.compile(r"^(\s*bind )(?:\*|0\.0\.0\.0|\[?::\]?)?:(\d+)", re.MULTILINE)
_ADMIN_SOCKET_MODE = re.compile(r"^(\s*stats socket \S+ mode )\d+", re.MULTILINE)


def admin_host() -> str:
    """Where HAProxy's statistics and metrics listen (``LLM_EDGE_ADMIN_HOST``)."""
    return os.environ.get("LLM_EDGE_ADMIN_HOST", "127.0.0.1")


def _private(section: str) -> str:
    """A section with HAProxy's own listeners bound to ``admin_host()`` and its admin
    socket readable by its user only."""
    section = _ADMIN_SOCKET_MODE.sub(lambda match: match.group(1) + "600", section)
    if _ADMIN_SECTION.match(section):
        section = _ANY_INTERFACE_BIND.sub(lambda match: f"{match.group(1)}{admin_host()}:{match.group(2)}", section)
    return section


_OWN_SETTINGS = re.compile(
    r"^\s*(timeout http-request|timeout http-keep-alive|timeout client|errorfile|option forwardfor)\b.*\n",
    re.MULTILINE,
)


def error_response(status: int) -> bytes:
    """HAProxy's errorfile for ``status``: a whole HTTP response, OpenAI's envelope as JSON."""
    message, kind, code = EDGE_ERRORS[status]
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    headers = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Cache-Control: no-cache",
        "Connection: close",
    ]
    if status in (429, 503):
        headers.append("Retry-After: 1")
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + body


def edge_config(config: str, error_dir: Path, names: RouteNames | None = None) -> str:
    """``config`` (Ray's) with the edge's timeouts and JSON error files in every
    ``defaults`` section (replacing Ray's own of each), the edge's time on every
    request of each ``frontend`` and its one hop to the direct routes (by ``names``,
    ``route_names``'s), HAProxy's own listeners private; the error files are written
    to ``error_dir``."""
    error_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        f"    timeout http-request {REQUEST_HEADERS_TIMEOUT_S}s",
        f"    timeout http-keep-alive {KEEP_ALIVE_TIMEOUT_S}s",
        f"    timeout client {client_silence_s()}s",
        # The client's address, after any X-Forwarded-For it sent: the gateway throttles
        # failed admin credentials per client (serve_app/identity/credential_guard.py).
        "    option forwardfor",
    ]
    for status in EDGE_ERRORS:
        path = error_dir / f"{status}.http"
        path.write_bytes(error_response(status))
        lines.append(f"    errorfile {status} {path}")
    own = "\n".join(lines) + "\n"
    stamp = f"    http-request set-header {EDGE_TIME_HEADER} %[date(0,us)]\n"  # first: before any rule answers
    stamp += f"    http-request set-header {EDGE_REQUEST_HEADER} %[uuid()]\n"  # the same for each try of it
    # Ray's HAProxy lists every application's route (each direct-route model's name) on
    # ``/-/routes`` to anyone: not through the edge, where no credential is asked.
    stamp += f"    http-request deny deny_status 404 if {{ path -i {RAY_ROUTES_PATH} }}\n"
    sections = re.split(r"(?m)^(?=\S)", config)  # each section starts at an unindented line
    # Each declared backend's replicas (its servers but Ray's fallback proxy).
    replicas = {
        backend: [name for name, _ in _replicas(section)]
        for section in sections
        if (backend := _backend_name(section)) is not None
    }
    # The direct applications' backends (named by a direct route's ACL, and declared)
    # whose replica HAProxy picks: those with an ingress request router have it picked
    # there, sessions included (serve_app/http/edge_router.py).
    direct_backends = {
        backend
        for backend, _ in _DIRECT_ACL.findall(config)
        if backend in replicas and backend + ROUTED_BACKEND_SUFFIX not in replicas
    }
    # Each backend a direct application's requests go by (its own, its router's and
    # its session copies): a try whose replica died before answering is sent again.
    retried = {backend for backend, _ in _DIRECT_ACL.findall(config)}
    retried |= {backend + ROUTED_BACKEND_SUFFIX for backend in retried}
    sections = [_with_retries(section) if _backend_name(section) in retried else section for section in sections]
    sections = [_private(section) for section in sections]
    return "".join(
        _DEFAULTS.sub(lambda head: head.group(0) + own, _OWN_SETTINGS.sub("", section))
        if section.startswith("defaults")
        else _with_session_rules(
            _FRONTEND.sub(
                lambda head, section=section: head.group(0) + stamp + one_hop_rules(section, replicas, names), section
            ),
            direct_backends,
        )
        if section.startswith("frontend")
        else _with_body_buffer(section)
        if section.startswith("global") and _DIRECT_ACL.search(config)
        else section + session_backend(section)
        if _backend_name(section) in direct_backends
        else section
        for section in sections
    )


# A direct route's request is sent to another replica (Ray's ``option redispatch 1``)
# when its replica refused the connection (Ray's own ``retry-on``) or closed it without
# a byte of an answer (it died, or its process was killed): nothing reached the client,
# and the try again is admitted under the first's id (contract.edge.EDGE_REQUEST_HEADER),
# so it is charged once. HAProxy tries again only a request whose body it holds whole,
# which a one-hop request is (``ONE_HOP_BODY_BYTES``). Never on a timeout or a 5xx: the
# replica may still run it, and the gateway in it sends it elsewhere itself
# (serve_app/pipeline/gateway.py ``_call``).
DIRECT_RETRY_ON = "conn-failure empty-response"


def _with_retries(section: str) -> str:
    """A direct application's backend section that tries again as ``DIRECT_RETRY_ON`` says."""
    head, _, rest = section.partition("\n")
    return f"{head}\n    retry-on {DIRECT_RETRY_ON}\n{rest}"


def _backend_name(section: str) -> str | None:
    head = section.split("\n", 1)[0].split()
    return head[1] if len(head) == 2 and head[0] == "backend" else None


# What a session's replica is hashed from: its credential's headers and the session
# header, so that a session is its tenant's: another tenant sending the same session id
# (known or guessed) is placed independently of it, never on its replica by design.
# (The gateway and the edge router hash sessions with the tenant's cache salt,
# serve_app/identity/cache_isolation.py; HAProxy has only the credential, which a
# rotation or a new identity token moves to another replica once.) A fetch of a header
# that is absent ends a sample chain, so the chain starts from a constant.
def _session_parts() -> list[tuple[str, str]]:
    """Each header a session is hashed from, with the variable HAProxy holds it in."""
    return [(f"llm_session_{i}", header) for i, header in enumerate((*CREDENTIAL_HEADERS, session_header()))]


def session_hash() -> str:
    """HAProxy's expression a session backend hashes (its variables set by its rules)."""
    return "str(llm)" + "".join(f",concat(|,txn.{var},)" for var, _ in _session_parts())


def session_backend(backend: str) -> str:
    """A copy of a direct application's ``backend`` section that places each session
    by a consistent hash of its header, bounded by the replicas' load; its servers
    track the originals' health checks (Ray's own router backends do the same)."""
    name = _backend_name(backend)
    lines = [
        f"backend {name}{SESSION_BACKEND_SUFFIX}",
        *(f"    http-request set-var(txn.{var}) req.hdr({header})" for var, header in _session_parts()),
        f"    balance hash {session_hash()}",
        "    hash-type consistent",
        f"    hash-balance-factor {SESSION_BALANCE_FACTOR}",
    ]
    for line in backend.splitlines()[1:]:
        server = _SERVER.match(line)
        if server is None:
            if not re.match(r"\s*(balance|hash-|option httpchk|http-check|default-server)", line):
                lines.append(line)
            continue
        indent, server_name, address, options = server.groups()
        backup = " backup" if re.search(r"\bbackup\b", options) else ""
        lines.append(f"{indent}server {server_name} {address} track {name}/{server_name}{backup}")
    return "\n".join(lines) + "\n"


def _with_session_rules(frontend: str, direct_backends: set[str]) -> str:
    """The frontend sending a direct application's requests that name a session to
    its session backend, before Ray's own ``use_backend`` rules (after its ACLs)."""
    backends = sorted({backend for backend, _ in _DIRECT_ACL.findall(frontend)} & direct_backends)
    first = _FIRST_USE_BACKEND.search(frontend)
    if not backends or first is None:
        return frontend
    rules = "".join(
        f"    use_backend {name}{SESSION_BACKEND_SUFFIX} if is_{name} {{ req.hdr({session_header()}) -m found }}\n"
        for name in backends
    )
    return frontend[: first.start()] + rules + frontend[first.start() :]


def one_hop_rules(frontend: str, replicas: dict[str, list[str]], names: RouteNames | None = None) -> str:
    """The rules that send a ``/v1`` request naming a model with a direct route to
    that route (before Ray's, whose path ACLs then pick the direct application's
    backend): by the model's name as the route writes it, and by each of the
    ``names`` its replicas gave; none when the frontend routes no direct application.

    Only while one of the route's ``replicas`` (its backend's servers, not Ray's fallback
    proxy) is up: a model scaled to zero, or whose replicas are all down, is reached
    through the ingress, whose handle wakes it and waits its ``queue_timeout_s`` (else
    503 with retry-after), as for a model without a direct route, instead of HAProxy's
    503 or Ray's fallback proxy. (A named ACL on several lines is their "or"; Ray
    reloads HAProxy, and so rewrites these, whenever a route's replicas change.)"""
    backends = {model: backend for backend, model in _DIRECT_ACL.findall(frontend) if replicas.get(backend)}
    models = sorted(backends)
    if not models:
        return ""
    routes = "{ path " + " ".join(ONE_HOP_ROUTES) + " }"
    rules = [
        f"http-request wait-for-body time {ONE_HOP_BODY_WAIT_S}s if METH_POST {routes}",
        f"http-request set-var(txn.llm_model) req.body,json_query('$.model') if METH_POST {routes}",
        # The name as the route prefix writes it ("/" as "--"): what the ACLs list.
        "http-request set-var(txn.llm_one_hop) var(txn.llm_model),regsub(/,--,g) if { var(txn.llm_model) -m found }",
    ]
    for model in models:
        whole, beginnings = (names or {}).get(model, ([], []))
        for match, words in (("str", whole), ("beg", beginnings)):
            words = [word for word in words if _CONFIG_WORD.fullmatch(word)]
            rules += [
                f"http-request set-var(txn.llm_one_hop) str({model}) "
                f"if {{ var(txn.llm_model) -m {match} {' '.join(words[i : i + NAMES_PER_RULE])} }}"
                for i in range(0, len(words), NAMES_PER_RULE)
            ]
    up = [
        f"acl llm_replica_up_{model} srv_is_up({backends[model]}/{server})"
        for model in models
        for server in replicas[backends[model]]
    ]
    rules += [
        f"http-request set-path {DIRECT_ROUTE_ROOT}{model}%[path]"
        f" if {{ var(txn.llm_one_hop) -m str {model} }} llm_replica_up_{model}"
        for model in models
    ]
    return "".join(f"    {line}\n" for line in up + rules)


def _replicas(backend: str) -> list[tuple[str, str]]:
    """The (name, address) of each server of a ``backend`` section but Ray's fallback proxy (a backup)."""
    return [
        (name, address)
        for _, name, address, options in _SERVER.findall(backend)
        if not re.search(r"\bbackup\b", options)
    ]


def route_names(config: str, timeout_s: float = NAMES_TIMEOUT_S, budget_s: float = NAMES_BUDGET_S) -> RouteNames:
    """What clients may name each direct route's model by (the route as its prefix writes
    it -> (whole names, beginnings of names)), asked of its replicas (the servers of its
    backend in ``config``, one after another until one answers). A route none answered
    for within the budget is left out."""
    sections = {_backend_name(section): section for section in re.split(r"(?m)^(?=\S)", config)}
    deadline = time.monotonic() + budget_s
    found: RouteNames = {}
    for backend, route in sorted(set(_DIRECT_ACL.findall(config))):
        for _, address in _replicas(sections.get(backend, "")):
            left = deadline - time.monotonic()
            if left <= 0:
                return found
            answer = _ask_names(f"http://{address}{DIRECT_ROUTE_ROOT}{route}{EDGE_NAMES_PATH}", min(timeout_s, left))
            if answer is not None:
                found[route] = answer
                break
    return found


# A replica is asked directly, never through a proxy the environment names.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _ask_names(url: str, timeout_s: float) -> tuple[list[str], list[str]] | None:
    try:
        with _DIRECT.open(url, timeout=timeout_s) as response:
            answer = json.loads(response.read(1 << 20))
        whole, beginnings = answer["names"], answer["beginnings"]
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError):  # HTTPException: not HTTP there
        return None
    if not all(isinstance(words, list) and all(isinstance(w, str) for w in words) for words in (whole, beginnings)):
        return None
    return whole, beginnings


def _with_body_buffer(section: str) -> str:
    """The global section with a request buffer that holds ``ONE_HOP_BODY_BYTES``."""
    if _BUFSIZE.search(section):
        return _BUFSIZE.sub(lambda m: f"{m.group(1)}tune.bufsize {max(int(m.group(2)), ONE_HOP_BODY_BYTES)}", section)
    return _GLOBAL.sub(lambda head: head.group(0) + f"    tune.bufsize {ONE_HOP_BODY_BYTES}\n", section)


def rewrite_args(args: list[str]) -> list[str]:
    """haproxy's arguments with each ``-f <file>`` replaced by that file passed
    through ``edge_config`` (written beside it, as ``<file>.edge``), loading the
    edge router's Lua patched by ``edge_router_lua`` (beside Ray's, as ``<lua>.edge``)."""
    out = list(args)
    for i, arg in enumerate(args[:-1]):
        if arg == "-f":
            source = Path(args[i + 1])
            target = source.with_name(source.name + ".edge")
            config = source.read_text()
            config = edge_config(config, source.parent / "edge-errors", route_names(config))
            target.write_text(_LUA_LOAD.sub(_patched_lua, config))
            out[i + 1] = str(target)
    return out


_LUA_LOAD = re.compile(r"(?m)^(\s*lua-load-per-thread\s+)(\S+)$")

# Ray's Lua (ray/serve/_private/ingress_request_router.lua.tmpl, as Ray 2.60 writes it):
# each anchor is found exactly once, or the edge refuses to start (a Ray upgrade
# that moved them must be looked at, not routed around).
_LUA_PATCHES = (
    (
        "local function call_router(router, body, truncated_length, session_id, request_id)\n",
        "local LLM_CREDENTIAL_HEADERS = {" + ", ".join(f'"{name}"' for name in CREDENTIAL_HEADERS) + "}\n"
        "-- The client's credential headers as request lines (llm-cluster: cluster/haproxy_edge.py).\n"
        "local function llm_credentials(hdrs)\n"
        '    local lines = ""\n'
        "    for _, name in ipairs(LLM_CREDENTIAL_HEADERS) do\n"
        "        local entry = hdrs and hdrs[name]\n"
        "        if entry and entry[0] then\n"
        '            lines = lines .. name .. ": " .. entry[0] .. "\\r\\n"\n'
        "        end\n"
        "    end\n"
        "    return lines\n"
        "end\n\n"
        "local function call_router(router, body, truncated_length, session_id, request_id, credentials)\n",
    ),
    ("        .. request_id_header\n", '        .. request_id_header\n        .. (credentials or "")\n'),
    (
        "response = call_router(router, body, truncated, session_id, request_id)\n",
        "response = call_router(router, body, truncated, session_id, request_id, llm_credentials(hdrs))\n",
    ),
)


def edge_router_lua(source: str) -> str:
    """Ray's ingress-request-router Lua forwarding the client's credential headers too."""
    for anchor, replacement in _LUA_PATCHES:
        if source.count(anchor) != 1:
            raise ValueError(f"Ray's ingress request router Lua changed: {anchor.strip()!r} not found once")
        source = source.replace(anchor, replacement)
    return source


def _patched_lua(load: re.Match) -> str:
    source = Path(load.group(2))
    target = source.with_name(source.name + ".edge")
    target.write_text(edge_router_lua(source.read_text()))
    return load.group(1) + str(target)
