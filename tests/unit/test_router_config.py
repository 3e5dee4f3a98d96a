"""Router, tier and API-key config: working defaults, and bad config named by its field."""

import pytest
from pydantic import ValidationError

from raylane.config import ApiKeysConfig, RouteConfig, RouterConfig, TierConfig, default_tiers


def error_text(excinfo) -> str:
    return str(excinfo.value)


def test_defaults_route_three_kinds_of_traffic_and_three_tiers():
    config = RouterConfig()
    assert [(r.name, r.pool) for r in config.routes] == [
        ("coding", "coding"),
        ("reasoning", "reasoning"),
        ("chat", "chat"),
    ]
    assert config.default_route == "chat"
    tiers = {t.name: t for t in default_tiers()}
    assert [tiers[n].priority for n in ("premium", "standard", "free")] == [0, 1, 2]
    assert tiers["free"].sheddable and not tiers["premium"].sheddable


def test_default_route_must_be_a_route():
    with pytest.raises(ValidationError) as excinfo:
        RouterConfig(default_route="poetry")
    assert "default_route" in error_text(excinfo) and "poetry" in error_text(excinfo)


def test_bad_regex_is_named():
    with pytest.raises(ValidationError) as excinfo:
        RouterConfig.model_validate({"routes": [{"name": "chat", "pool": "chat", "regex": ["(unclosed"]}]})
    assert "routes.0.regex" in error_text(excinfo)


def test_route_cannot_fall_back_to_itself_and_names_are_unique():
    with pytest.raises(ValidationError) as excinfo:
        RouteConfig(name="coding", pool="coding", fallbacks=["coding"])
    assert "fallbacks" in error_text(excinfo)
    with pytest.raises(ValidationError) as excinfo:
        twins = [RouteConfig(name="a", pool="x"), RouteConfig(name="a", pool="y")]
        RouterConfig(routes=twins, default_route="a")
    assert "routes" in error_text(excinfo) and "'a'" in error_text(excinfo)


def test_unknown_field_is_rejected():
    with pytest.raises(ValidationError) as excinfo:
        TierConfig.model_validate({"name": "gold", "priority": 0, "requests_per_min": 5})
    assert "requests_per_min" in error_text(excinfo)


def test_check_pools_names_the_route_field():
    with pytest.raises(ValueError, match=r"router\.routes\[0\]\.fallbacks: no pool is named 'reasoning'"):
        RouterConfig().check_pools(["coding", "chat"])


def test_api_keys_must_name_known_tiers():
    with pytest.raises(ValueError, match="api_keys.keys"):
        ApiKeysConfig(keys={"sk-1": "gold"}).check_tiers(["premium", "standard"])
    with pytest.raises(ValueError, match="api_keys.default_tier"):
        ApiKeysConfig(default_tier="gold").check_tiers(["premium", "free"])


def test_inline_keys_do_not_show_in_repr_or_errors():
    config = ApiKeysConfig(keys={"sk-very-secret": "premium"})
    assert "sk-very-secret" not in repr(config) and "sk-very-secret" not in str(config.model_dump())
