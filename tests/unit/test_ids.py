"""protocol.ids: user ids, tiers and tokens are validated before they reach a key name."""

from __future__ import annotations

import pytest

from protocol.ids import USER_ID_MAX, InvalidId, validate_tier, validate_token, validate_user_id

VALID_USERS = [
    ("alice", "alice"),
    ("a.b@c+d-e_f", "a.b@c+d-e_f"),
    ("x" * USER_ID_MAX, "x" * USER_ID_MAX),
    ("0", "0"),
    (b"alice", "alice"),  # bytes straight from Redis are decoded
]

INVALID_USERS = [
    pytest.param("x" * (USER_ID_MAX + 1), id="65-chars"),
    pytest.param("", id="empty"),
    pytest.param("a b", id="space"),
    pytest.param("a{b}", id="braces"),
    pytest.param("{a", id="open-brace"),
    pytest.param("a}", id="close-brace"),
    pytest.param("a:b", id="colon"),
    pytest.param("é", id="non-ascii"),
    pytest.param("alice\n", id="trailing-newline"),
    pytest.param("a\tb", id="tab"),
    pytest.param("a\x00b", id="nul"),
    pytest.param("a|b", id="pipe"),
    pytest.param("a*b", id="glob"),
    pytest.param(b"\xff\xfe", id="bytes-not-utf8"),
    pytest.param(b"a b", id="bytes-with-space"),
    pytest.param(None, id="none"),
    pytest.param(5, id="int"),
    pytest.param(["alice"], id="list"),
]


@pytest.mark.parametrize(("user", "expected"), VALID_USERS)
def test_valid_user_ids(user: object, expected: str) -> None:
    assert validate_user_id(user) == expected


@pytest.mark.parametrize("user", INVALID_USERS)
def test_invalid_user_ids(user: object) -> None:
    with pytest.raises(InvalidId):
        validate_user_id(user)


def test_invalid_id_is_a_value_error_with_the_rule() -> None:
    with pytest.raises(ValueError, match="1-64 characters"):
        validate_user_id("a b")


def test_not_utf8_reason() -> None:
    with pytest.raises(InvalidId, match="UTF-8"):
        validate_user_id(b"\xff")


def test_wrong_type_reason_names_the_type() -> None:
    with pytest.raises(InvalidId, match="int"):
        validate_user_id(5)


@pytest.mark.parametrize(
    ("tier", "ok"),
    [
        ("chat", True),
        ("gpu-2", True),
        ("a_b", True),
        ("0tier", True),
        ("t" * 32, True),
        ("t" * 33, False),
        ("", False),
        ("Chat", False),
        ("-chat", False),
        ("_chat", False),
        ("a b", False),
        ("a:b", False),
        ("{chat}", False),
        ("chat\n", False),
        (None, False),
        (3, False),
        (b"chat", False),
    ],
)
def test_tier_table(tier: object, ok: bool) -> None:
    if ok:
        assert validate_tier(tier) == tier
    else:
        with pytest.raises(InvalidId):
            validate_tier(tier)


@pytest.mark.parametrize(
    ("token", "ok"),
    [
        ("abc", True),
        ("1700000000000-0", True),
        ("A.b_c-9", True),
        ("x" * 64, True),
        ("x" * 65, False),
        ("", False),
        ("a:b", False),
        ("a{b", False),
        ("a b", False),
        ("a@b", False),
        ("a|b", False),
        (None, False),
        (1, False),
    ],
)
def test_token_table(token: object, ok: bool) -> None:
    if ok:
        assert validate_token(token, "turn id") == token
    else:
        with pytest.raises(InvalidId, match="turn id"):
            validate_token(token, "turn id")
