"""Whose prompt cache a request uses (serve_app/identity/cache_isolation.py), as pure
logic and on the gateway with its replica faked: the salt comes from the tenant the
level names and a server secret, never from the client alone; a client's salt only
divides its tenant's cache; every salt is one vLLM takes; ``prompt_cache_key`` is a
session within the tenant; routers and the replica's published blocks hash the salt
with the prompt. (On the real stack, the attacker's timing test:
tests/e2e/shared_stack/test_cache_isolation_e2e.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from cache_secret import salts
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.exceptions import ConnectionError as RedisConnectionError
from test_gateway_run import USAGE, Access, Response
from vllm.entrypoints.generate.base.protocol import validate_cache_salt

from contract.edge import CREDENTIAL_HEADERS
from contract.model_config import ModelConfig
from contract.prompt_blocks import block_hashes, prompt_text
from contract.replica_wire import ReplicaAnswer
from serve_app.errors import OpenAIError
from serve_app.identity.authentication import secret_from
from serve_app.identity.cache_isolation import (
    HEADER_SESSION,
    PROMPT_CACHE_SESSION,
    SALT_CHARS,
    client_salt_of,
    isolation_level,
    salt_for,
    take_prompt_cache_key,
    tenant_of,
)
from serve_app.identity.keys import KeyRecord
from serve_app.identity.teams import TeamRecord
from serve_app.pipeline.gateway import Gateway
from serve_app.telemetry import RequestRecord, Telemetry

TEAM = TeamRecord(id="tm1", name="team-one", created_at=0)
IN_TEAM = KeyRecord(id="k1", name="a", created_at=0, team="tm1")
ALSO_IN_TEAM = KeyRecord(id="k2", name="b", created_at=0, team="tm1")
ALONE = KeyRecord(id="k3", name="c", created_at=0)
MODEL = ModelConfig(name="m")
SECRET = b"s" * 32


def test_the_level_is_the_keys_else_its_teams_else_the_models():
    assert isolation_level(IN_TEAM, TEAM, MODEL) == "team"  # the default
    assert isolation_level(IN_TEAM, TEAM, ModelConfig(name="m", cache_isolation="shared")) == "shared"
    strict_team = TEAM.model_copy(update={"cache_isolation": "key"})
    assert isolation_level(IN_TEAM, strict_team, ModelConfig(name="m", cache_isolation="shared")) == "key"
    shared_key = IN_TEAM.model_copy(update={"cache_isolation": "shared"})
    assert isolation_level(shared_key, strict_team, MODEL) == "shared"


def test_a_team_shares_one_cache_a_key_without_a_team_has_its_own():
    assert tenant_of("team", IN_TEAM, TEAM) == tenant_of("team", ALSO_IN_TEAM, TEAM) == "team:tm1"
    assert tenant_of("key", IN_TEAM, TEAM) != tenant_of("key", ALSO_IN_TEAM, TEAM)
    assert tenant_of("team", ALONE, None) == "key:k3"
    assert tenant_of("shared", IN_TEAM, TEAM) == ""


def test_shared_without_a_client_salt_is_no_salt_and_a_client_salt_divides_a_tenant():
    assert salt_for(SECRET, "", None) is None
    team = salt_for(SECRET, "team:tm1", None)
    assert team == salt_for(SECRET, "team:tm1", None)  # every process salts alike
    assert salt_for(SECRET, "team:tm1", "chat-7") not in (team, salt_for(SECRET, "team:tm2", "chat-7"))
    assert salt_for(b"t" * 32, "team:tm1", None) != team  # the secret decides, not the id alone


# Tenants and client salts as an adversary picks them: any text, the separators, NULs.
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(st.tuples(st.sampled_from(["key:", "team:", ""]), _TEXT), st.one_of(st.none(), _TEXT.filter(bool)))
def test_every_salt_is_one_vllm_takes(tenant, client_salt):
    salt = salt_for(SECRET, tenant[0] + tenant[1], client_salt)
    if salt is None:
        assert tenant == ("", "") and client_salt is None
        return
    validate_cache_salt(salt)  # raises for a salt vLLM refuses
    assert len(salt) == SALT_CHARS


@settings(max_examples=300, deadline=None)
@given(_TEXT, _TEXT, st.one_of(st.none(), _TEXT.filter(bool)))
def test_no_client_salt_reaches_another_tenants_cache(victim, attacker, client_salt):
    """Whatever salt a client of ``attacker`` sends, its requests' salt is never the
    one ``victim``'s requests carry (with or without their own salt)."""
    if victim == attacker:
        return
    victims = {salt_for(SECRET, "key:" + victim, None), salt_for(SECRET, "team:" + victim, None)}
    assert salt_for(SECRET, "key:" + attacker, client_salt) not in victims
    assert salt_for(SECRET, "", client_salt) not in victims  # a shared model's tenant neither


@pytest.mark.parametrize("bad", [7, "", ["a"], {"a": 1}, True, "x" * 1025])
def test_a_client_salt_that_is_not_a_string_is_a_400_naming_it(bad):
    with pytest.raises(OpenAIError) as caught:
        client_salt_of({"cache_salt": bad})
    assert caught.value.status == 400 and caught.value.param == "cache_salt"


@pytest.mark.parametrize("bad", [7, ["a"], {"a": 1}, True, "x" * 1025])
def test_a_prompt_cache_key_that_is_not_a_string_is_a_400_naming_it(bad):
    with pytest.raises(OpenAIError) as caught:
        take_prompt_cache_key({"prompt_cache_key": bad})
    assert caught.value.status == 400 and caught.value.param == "prompt_cache_key"


def test_the_routers_text_and_blocks_carry_the_salt():
    body = {"messages": [{"role": "system", "content": "x" * 600}]}
    plain = prompt_text(body)
    salted = prompt_text({**body, "cache_salt": "A" * 43})
    other = prompt_text({**body, "cache_salt": "B" * 43})
    assert salted.endswith(plain) and len({plain, salted, other}) == 3
    assert not set(block_hashes(salted, 256)) & set(block_hashes(other, 256))
    assert prompt_text({"cache_salt": "A" * 43}) == ""  # no prompt: nothing to route on


async def test_the_secret_is_made_once_and_shared():
    one = salts()
    other = type(one)(one.redis)  # another process over the same Redis
    assert await one.secret() == await other.secret()
    assert len(await one.secret()) == 64


class _Failing:
    async def set(self, *_, **__):
        raise RedisConnectionError("down")

    get = set


async def test_a_process_that_cannot_read_the_secret_salts_with_its_own_and_still_isolates():
    cut_off = type(salts())(_Failing())
    first = await cut_off.salt(IN_TEAM, TEAM, MODEL, None)
    assert first == await cut_off.salt(ALSO_IN_TEAM, TEAM, MODEL, None)
    assert first != await cut_off.salt(ALONE, None, MODEL, None)


# -- on the gateway ------------------------------------------------------------


class RecordingHandle:
    """A model's handle whose replica answers at once; records each call's body and the
    options (session, adapter) the handle carried."""

    def __init__(self, calls: list, options: dict | None = None):
        self.calls, self._options = calls, options or {}
        self.call_streamed = SimpleNamespace(remote=self._remote)

    def options(self, **options):
        return RecordingHandle(self.calls, {**self._options, **options})

    def _remote(self, operation, body, *_, **__):
        self.calls.append((body, self._options))
        return Response(result=ReplicaAnswer(b"{}", USAGE, "r1"))


async def _sent(
    key: KeyRecord,
    body: dict,
    team: TeamRecord | None = TEAM,
    operation: str = "chat",
    session: str | None = None,
    **config,
):
    """(the body the replica got, the handle's options) for ``body`` sent by ``key``
    (with the session header ``session``)."""

    class TeamAccess(Access):
        async def team_of(self, key, model):
            return team

    calls: list = []
    gateway = Gateway(
        TeamAccess(), {"m": RecordingHandle(calls)}, [ModelConfig(name="m", **config)], Telemetry(False, False), SALTS
    )
    await gateway.run(key, operation, json.loads(json.dumps(body)), 100, RequestRecord("openai", "x"), session=session)
    return calls[-1]


SALTS = salts()
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_the_gateway_replaces_a_clients_salt_with_its_tenants():
    body, _ = await _sent(IN_TEAM, {**CHAT, "cache_salt": "whatever-i-like"})
    mate, _ = await _sent(ALSO_IN_TEAM, {**CHAT, "cache_salt": "whatever-i-like"})
    plain, _ = await _sent(IN_TEAM, CHAT)
    alone, _ = await _sent(ALONE, {**CHAT, "cache_salt": "whatever-i-like"}, team=None)
    assert body["cache_salt"] == mate["cache_salt"] != "whatever-i-like"  # one team, one salt
    assert len({body["cache_salt"], plain["cache_salt"], alone["cache_salt"]}) == 3


async def test_shared_sends_no_salt_unless_the_client_divides_and_the_tokenizer_gets_none():
    shared, _ = await _sent(IN_TEAM, CHAT, cache_isolation="shared")
    assert "cache_salt" not in shared
    divided, _ = await _sent(IN_TEAM, {**CHAT, "cache_salt": "mine"}, cache_isolation="shared")
    assert divided["cache_salt"] not in ("mine", None)
    tokens, _ = await _sent(IN_TEAM, {"model": "m", "prompt": "hi"}, operation="tokenize")
    assert "cache_salt" not in tokens


async def test_a_prompt_cache_key_is_a_session_of_its_tenant_and_never_reaches_the_engine():
    body, handle = await _sent(IN_TEAM, {**CHAT, "prompt_cache_key": "conversation-1"})
    _, mate = await _sent(ALSO_IN_TEAM, {**CHAT, "prompt_cache_key": "conversation-1"})
    _, stranger = await _sent(ALONE, {**CHAT, "prompt_cache_key": "conversation-1"}, team=None)
    assert "prompt_cache_key" not in body
    assert handle["session_id"].startswith(PROMPT_CACHE_SESSION)
    assert handle["session_id"] == mate["session_id"] != stranger["session_id"]


@pytest.mark.parametrize("isolation", ["team", "key", "shared"])
@pytest.mark.parametrize("operation", ["chat", "tokenize"])
async def test_a_session_header_is_a_session_of_its_tenant_at_every_isolation_level(isolation, operation):
    """A tenant sending a victim's session id is not placed with the victim's session:
    the id is hashed with the tenant's salt (sharing everyone's cache, its team's), on
    operations that carry no salt too; one tenant's turns keep one session."""
    body = CHAT if operation == "chat" else {"model": "m", "prompt": "hi"}

    async def session_of(key, team=TEAM, session="conversation-1", **extra):
        _, options = await _sent(key, {**body, **extra}, team, operation, session, cache_isolation=isolation)
        return options["session_id"]

    mine = await session_of(IN_TEAM)
    assert mine == await session_of(IN_TEAM) != "conversation-1"
    assert mine.startswith(HEADER_SESSION) and len(mine) <= 256
    assert mine != await session_of(ALONE, team=None)  # another tenant, the same id
    assert mine != await session_of(IN_TEAM, session="conversation-2")
    mate = await session_of(ALSO_IN_TEAM)
    assert (mate == mine) is (isolation != "key")  # one team shares its cache, so its sessions
    if operation == "chat":  # the header names the session, not the prompt_cache_key beside it
        assert await session_of(IN_TEAM, prompt_cache_key="other") == mine


async def test_sharing_everyones_cache_a_prompt_cache_key_is_still_its_teams_session():
    _, mine = await _sent(IN_TEAM, {**CHAT, "prompt_cache_key": "agent"}, cache_isolation="shared")
    _, mate = await _sent(ALSO_IN_TEAM, {**CHAT, "prompt_cache_key": "agent"}, cache_isolation="shared")
    _, other = await _sent(ALONE, {**CHAT, "prompt_cache_key": "agent"}, team=None, cache_isolation="shared")
    assert mine["session_id"] == mate["session_id"] != other["session_id"]
    assert mine["session_id"].startswith(PROMPT_CACHE_SESSION)


@pytest.mark.parametrize("header", CREDENTIAL_HEADERS)
def test_every_header_the_edge_forwards_is_one_a_credential_is_read_from(header):
    """The edge router authenticates from the headers HAProxy hands it (cluster/haproxy_edge.py)."""
    assert secret_from({header: "Bearer sk-x" if header == "authorization" else "sk-x"}) == "sk-x"
