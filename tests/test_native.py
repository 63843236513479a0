"""engine/native.py: the batch size sample() picks when none is given (what the memory holds). The engine it runs:
test_engine.py."""
import pytest

pytest.importorskip("transformers")

from engine import native  # noqa: E402
from engine.engine import Engine  # noqa: E402
from tiny import tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("llama"))


def test_default_batch_size_is_what_the_memory_holds(model, monkeypatch):
    """Without --batch-size the KV cache takes a quarter of the available memory (CPU), at most 64 rows, at least 1;
    a row holds keys and values of every layer for the longest prompt plus its cap."""
    import engine.native as mg
    cfg = model.cfg
    per_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 100 * 4  # fp32, 100 columns
    for available, rows in ((per_row * 4 * 10, 10), (per_row * 4 * 1000, 64), (per_row, 1)):
        monkeypatch.setattr(mg, "_mem_available", lambda: available)
        assert mg.default_batch_size(model, 100) == rows
    monkeypatch.setattr(mg, "_mem_available", lambda: per_row * 4 * 3)  # 3 rows of 100 columns
    seen = []
    real = Engine.__init__

    def spy(self, m, max_seqs=32, **kw):
        seen.append(max_seqs)
        real(self, m, max_seqs=max_seqs, **kw)
    monkeypatch.setattr(Engine, "__init__", spy)
    native.sample(model, [[1] * 60] * 8, max_new_tokens=[40, 1, 1, 1, 1, 1, 1, 1], temperature=0.0, progress=False)
    assert seen == [3]
