"""Every YAML block of the docs is a valid cluster config, or a valid section of one (added to three
demo pools named as the default routes name them): a reader who copies it gets no config error."""

import pytest
import yaml

from raylane.config import ClusterConfig
from tests.docs_examples import all_examples

BLOCKS = [e for e in all_examples() if e.language == "yaml" and e.not_tested is None]
DEMO_POOLS = [{"name": name, "model": "demo:raylane-llama-tiny"} for name in ("coding", "reasoning", "chat")]


def test_the_docs_have_config_examples():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.page}:{b.line}" for b in BLOCKS])
def test_a_config_example_is_valid(block):
    data = yaml.safe_load(block.code)
    assert isinstance(data, dict) and set(data) <= set(ClusterConfig.model_fields), data
    ClusterConfig.from_dict(data if "pools" in data else {"pools": DEMO_POOLS} | data)
