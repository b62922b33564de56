"""The placement x feature table of docs/cluster.md (posttrain.config.placement_table): every test it
names exists, no tested cell is refused on a CPU, and the docs hold what the code prints."""

from __future__ import annotations

import re

from posttrain.config import placement_table as table
from posttrain.paths import PROJECT_ROOT


def test_every_named_test_exists():
    for (placement, feature), name in {**table.TESTED, ("multi-node", "megatron"): table.MULTI_NODE_MEGATRON}.items():
        path, _, function = name.partition("::")
        function, _, params = function.partition("[")
        source = (PROJECT_ROOT / path).read_text()
        assert re.search(rf"^def {function}\(", source, re.M), (placement, feature, name)
        if params:  # the parametrisation names values the test takes
            for value in params.rstrip("]").split("-"):
                assert f'"{value}"' in source or f", {value}" in source or f"({value}," in source, (name, value)


def test_no_tested_cell_is_refused_and_the_docs_are_current():
    rendered = table.render()
    for placement, feature in table.TESTED:  # a tested cell runs on a CPU (where the tests run)
        assert table.cell(placement, feature)[0] == "tested", (placement, feature, table.cell(placement, feature))
        assert table.refusal(placement, feature, "cpu") is None, (placement, feature)
    assert table.current_doc() == rendered, "docs/cluster.md is stale: python -m posttrain.config.placement_table --write"
