"""Token ids against a second independent tokenizer: HF transformers' own GGUF integration
(fixtures recorded by tests/python/make_token_fixtures.py, by hand)."""

import json

import pytest

from support.cli import run
from support.paths import GEMMA, SMOL, load_fixture, model_path


@pytest.mark.parametrize("name", [GEMMA.name, SMOL.name])
def test_token_ids_equal_transformers(name, tmp_path):
    fx = load_fixture("tokens-transformers.json")[name]
    texts = [c["text"] for c in fx["cases"]]
    f = tmp_path / "texts.json"
    f.write_text(json.dumps(texts))
    ours = json.loads(run(["debug", "tokenize", "-m", model_path(name), "--texts", f]).stdout)
    bad = [f"{c['text']!r}: ours {ids} transformers {c['ids']}" for c, ids in zip(fx["cases"], ours) if ids != c["ids"]]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ:\n" + "\n".join(bad)
