"""model/logprobs.py: per-token log-probs and KL, chunked and packed, against naive full-vocabulary math and
transformers' own Llama."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.checkpoint import load_model  # noqa: E402
from model.logprobs import chunked_token_stats, response_stats  # noqa: E402
from tiny import hf, naive  # noqa: E402


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_chunked_token_stats_equal_full_vocabulary_math(chunk):
    g = torch.Generator().manual_seed(0)
    M, H, V = 11, 8, 50
    h, w = torch.randn(M, H, generator=g), torch.randn(V, H, generator=g)
    rh, rw = torch.randn(M, H, generator=g), torch.randn(V, H, generator=g)
    tgt = torch.randint(0, V, (M,), generator=g)
    lp, rlp, kl = chunked_token_stats(h, w, tgt, rh, rw, chunk=chunk)
    p, q = torch.log_softmax((h @ w.T).double(), -1), torch.log_softmax((rh @ rw.T).double(), -1)
    assert torch.allclose(lp.double(), p.gather(1, tgt[:, None]).squeeze(1), atol=1e-5)
    assert torch.allclose(rlp.double(), q.gather(1, tgt[:, None]).squeeze(1), atol=1e-5)
    assert torch.allclose(kl.double(), torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1),
                          atol=1e-5)
    assert (kl > 0).all()
    # without a reference only the log-probs; against itself the KL is exactly 0
    lp2, none1, none2 = chunked_token_stats(h, w, tgt, chunk=chunk)
    assert torch.equal(lp2, lp) and none1 is None and none2 is None
    assert torch.equal(chunked_token_stats(h, w, tgt, h, w, chunk=chunk)[2], torch.zeros(M))


SEQS = [([5, 17, 33, 2, 9, 41], [12, 7, 88, 3]), ([88, 3], [120, 6, 200]), ([42], [11]),
        ([42, 42, 42, 11, 250, 8, 19, 60], [4, 77, 31, 9, 9, 9, 100]), ([7, 8], [])]


def test_response_stats_equals_transformers_and_ignores_packing_and_chunking(ckpts):
    cur, ref = load_model(ckpts / "cur"), load_model(ckpts / "prev")
    hf_cur, hf_ref = hf(ckpts / "cur"), hf(ckpts / "prev")
    # one row holding every sequence vs one row each; 1-position chunks vs one chunk
    a = response_stats(cur, SEQS, ref, max_tokens=10_000, chunk=1000)
    b = response_stats(cur, SEQS, ref, max_tokens=1, chunk=1)
    c = response_stats(cur, SEQS, ref, max_tokens=12, chunk=2)
    for (prompt, response), x, y, z in zip(SEQS, a, b, c):
        assert len(x["logprobs"]) == len(x["kl"]) == len(response)
        for key in ("logprobs", "ref_logprobs", "kl"):
            assert x[key] == pytest.approx(y[key], abs=1e-5) and x[key] == pytest.approx(z[key], abs=1e-5)
        if response:
            lp, lq, kl = naive(hf_cur, hf_ref, prompt, response)
            assert x["logprobs"] == pytest.approx(lp.tolist(), abs=1e-4)
            assert x["ref_logprobs"] == pytest.approx(lq.tolist(), abs=1e-4)
            assert x["kl"] == pytest.approx(kl.tolist(), abs=1e-5, rel=1e-3)
    assert sum(sum(x["kl"]) for x in a) > 0.01  # the perturbation is visible: the comparison above is not 0 == 0
    only = response_stats(cur, SEQS)
    assert [set(x) for x in only] == [{"logprobs"}] * len(SEQS)
    assert only[0]["logprobs"] == pytest.approx(a[0]["logprobs"], abs=1e-5)
    with pytest.raises(ValueError, match="sequence 1 has an empty prompt"):
        response_stats(cur, [([1], [2]), ([], [3])])
