"""PoolingParams and --pooler-config: every value a user can get wrong is refused with its name."""

from __future__ import annotations

import pytest

from tideserve.pooling_params import PoolerConfig, PoolingParams, parse_pooler_config


def test_pooler_config_from_json_dict_or_none():
    assert parse_pooler_config(None) is None
    assert parse_pooler_config('{"pooling_type": "mean"}') == PoolerConfig("MEAN", True)
    assert parse_pooler_config({"normalize": False}) == PoolerConfig("LAST", False)


@pytest.mark.parametrize(("value", "message"), [
    ("{not json", "pooler_config must be a JSON object such as"),
    ("[1]", "pooler_config must be a JSON object (a dict)"),
    ({"pooling": "MEAN"}, "pooler_config has unknown key(s) ['pooling']"),
    ({"pooling_type": "MAX"}, "pooler_config.pooling_type must be one of LAST, MEAN, CLS, got 'MAX'"),
    ({"normalize": "yes"}, "pooler_config.normalize must be true or false, got 'yes'"),
])
def test_bad_pooler_configs_name_the_key(value, message):
    with pytest.raises(ValueError) as err:
        parse_pooler_config(value)
    assert str(err.value).startswith(message)


def test_a_request_takes_the_engine_defaults_it_leaves_unset():
    assert PoolingParams().resolved(None, 8) == PoolingParams("LAST", True, 8)
    assert PoolingParams(normalize=False).resolved(PoolerConfig("MEAN"), 8) == PoolingParams("MEAN", False, 8)
    assert PoolingParams("cls", dimensions=8).resolved(PoolerConfig("MEAN", False), 8) == PoolingParams("CLS", False, 8)
    with pytest.raises(ValueError, match="dimensions=4 is not supported: this model's embeddings have 8"):
        PoolingParams(dimensions=4).resolved(None, 8)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dimensions": 0}, "dimensions must be an integer >= 1, got 0"),
    ({"dimensions": True}, "dimensions must be an integer >= 1, got True"),
    ({"normalize": 1}, "normalize must be true or false, got 1"),
    ({"pooling_type": 3}, "pooling_type must be one of LAST, MEAN, CLS, got 3"),
])
def test_bad_pooling_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        PoolingParams(**kwargs)


def test_only_last_pooling_may_take_prefix_cache_hits():
    assert [PoolingParams(t).needs_every_prompt_position for t in ("LAST", "MEAN", "CLS")] == [False, True, True]
