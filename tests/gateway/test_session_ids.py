"""Session identities on the wire: every form built by session_ids parses back to the same ids, malformed ones don't."""

import base64

import pytest

from polar_mitm import session_ids
from polar_mitm.gateway import identity
from polar_mitm.session_ids import SessionId

# Task ids may hold '/', session ids may not (the compact forms split at the last slash).
IDS = [
    SessionId("s1"),
    SessionId("s1", "t1"),
    SessionId("a b%20c", "suite/a b"),
    SessionId("100%", "%2F/%"),
    SessionId("séance-日本", "tâche/ü?x=1#frag"),
    SessionId("$(x);`y`", "a:b@c"),
    SessionId("+plus&amp", "~tilde"),
]


@pytest.mark.parametrize("ids", IDS, ids=str)
def test_every_form_round_trips(ids):
    rest = "/v1/messages"
    assert session_ids.parse_path(ids.path_prefix + rest) == (ids, rest)
    assert session_ids.parse_path(ids.path_prefix) == (ids, "/")
    assert session_ids.parse_proxy_user(ids.proxy_user) == ids
    assert session_ids.parse_api_key(ids.api_key) == ids
    assert session_ids.parse_compact(ids.compact) == ids


@pytest.mark.parametrize("ids", IDS, ids=str)
def test_the_gateway_resolves_every_built_form(ids):
    """The forms as the gateway meets them: a path, a Basic proxy header, a bearer API key."""
    user = ids.proxy_url("127.0.0.1:8080").split("://", 1)[1].rsplit("@", 1)[0]
    header = "Basic " + base64.b64encode(user.encode()).decode()
    cases = [
        ({}, ids.path_prefix + "/v1/messages", None),
        ({}, "/v1/messages", identity.proxy_user(header)),
        ({"authorization": f"Bearer {ids.api_key}"}, "/v1/messages", None),
    ]
    for headers, path, proxy_user in cases:
        who, rest = identity.resolve(headers, path, {}, proxy_user_name=proxy_user, connection_id="c")
        assert (who.session_id, who.task_id, rest) == (ids.session, ids.task, "/v1/messages")


def test_the_forms_are_the_documented_strings():
    ids = SessionId("s 1", "suite/t")
    assert ids.compact == "suite/t/s 1"
    assert ids.path_prefix == "/t/suite%2Ft/s/s%201"
    assert ids.proxy_user == "suite%2Ft%2Fs%201"
    assert ids.proxy_url("127.0.0.1:8080") == "http://suite%2Ft%2Fs%201:x@127.0.0.1:8080"
    assert ids.proxy_url("gw:1", "https") == "https://suite%2Ft%2Fs%201:x@gw:1"
    assert ids.api_key == "polar-suite/t/s 1"
    assert ids.base_url("http://gw:8081/", "/v1") == "http://gw:8081/t/suite%2Ft/s/s%201/v1"
    no_task = SessionId("s1", "")  # an empty task is no task
    assert (no_task.compact, no_task.path_prefix, no_task.proxy_user, no_task.api_key) == (
        "s1",
        "/s/s1",
        "s1",
        "polar-s1",
    )


@pytest.mark.parametrize(
    "path",
    ["/v1/messages", "/s/", "/s//v1", "/t/tk/v1/messages", "/t//s/x", "s/x/v1", "/x/s/abc", "/t/a/b/s/c"],
)
def test_paths_without_a_well_formed_prefix_are_left_alone(path):
    assert session_ids.parse_path(path) == (None, path)


@pytest.mark.parametrize("key", [None, "", "polar-", "sk-ant-123", "Polar-s1", "xpolar-s1"])
def test_keys_that_name_no_session_are_rejected(key):
    assert session_ids.parse_api_key(key) is None


def test_empty_compact_forms_are_rejected_and_a_trailing_slash_is_no_task():
    assert session_ids.parse_compact("") is None and session_ids.parse_compact(None) is None
    assert session_ids.parse_proxy_user("") is None and session_ids.parse_proxy_user(None) is None
    assert session_ids.parse_compact("t/") == SessionId("t/")
    assert session_ids.parse_compact("/s") == SessionId("s")
