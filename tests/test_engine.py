"""The generation engine (engine/engine.py) against a plain reference: a full forward over the whole sequence for
every new token (no cache, no batching, no fusion), sampling with the same keyed noise. Greedy and sampled tokens
must be equal and log-probs within 1e-5 (fp32), whatever the batch mix, batch size, prompt order, prefix sharing or
fusion; the slot bookkeeping must survive thousands of admissions and finishes; the decode step must compile whole."""
import random

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402

from model.checkpoint import load_model  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampler import row_keys, sample  # noqa: E402
from engine import native  # noqa: E402
from tiny import tiny_llama  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """Qwen2 layout: q/k/v biases, tied embeddings (the fused qkv carries a fused bias)."""
    path = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(1)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)).save_pretrained(path)
    return load_model(path)


PROMPTS = [[5, 17, 33, 2, 9, 41, 12, 7], [88, 3], [60, 6, 20, 14, 9], [42, 42, 42, 11, 25, 8, 19, 60, 4, 77, 31],
           [1], [88, 3, 5]]


def reference(model, prompts, *, temperature, max_new_tokens, stop_ids=(), seed=0, seeds=None):
    """A full forward per new token, one prompt at a time."""
    keys = row_keys(len(prompts), seed, seeds)
    outs = []
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids, toks, lps = list(p), [], []
            for t in range(max_new_tokens):
                x = torch.tensor(ids)[None]
                logits = model(x, torch.arange(len(ids))[None])[0, -1:]
                tok, lp = sample(logits, temperature, torch.tensor([keys[i]]), torch.tensor([t]))
                toks.append(tok.item())
                lps.append(lp.item())
                ids.append(toks[-1])
                if toks[-1] in stop_ids:
                    break
            outs.append({"token_ids": toks, "logprobs": lps,
                         "finish_reason": "stop" if toks[-1] in stop_ids else "length"})
    return outs


def reference_alone(model, prompts, caps, seed):
    """Each prompt through the reference on its own, with its own cap and the key it has in a call of all of them."""
    keys = row_keys(len(prompts), seed)
    return [reference(model, [p], temperature=1.0, max_new_tokens=c, seeds=[k])[0]
            for p, c, k in zip(prompts, caps, keys)]


def assert_same(outs, ref):
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in ref]
    assert [o["finish_reason"] for o in outs] == [o["finish_reason"] for o in ref]
    for o, r in zip(outs, ref):
        assert max(abs(a - b) for a, b in zip(o["logprobs"], r["logprobs"])) <= TOL


def a_stop_id(model, prompt, at):
    return reference(model, [prompt], temperature=0.0, max_new_tokens=at + 1)[0]["token_ids"][at]


@pytest.mark.parametrize("temperature", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("batch_size", [1, 2, 4, 32])
@pytest.mark.parametrize("mix", [True, False])
def test_engine_equals_the_reference_sampler(model, temperature, batch_size, mix):
    """mix: admissions' prefill forwards carry the live rows' decode step (the CPU's schedule) or not (the GPU's)."""
    # a stop id that row 0 samples third, so that rows end at different steps
    stop = reference(model, PROMPTS[:1], temperature=temperature, max_new_tokens=3, seed=3)[0]["token_ids"][2]
    ref = reference(model, PROMPTS, temperature=temperature, max_new_tokens=9, stop_ids={stop}, seed=3)
    outs = Engine(model, max_seqs=min(batch_size, len(PROMPTS)), mix=mix).run(
        PROMPTS, temperature=temperature, max_new_tokens=9, stop_ids={stop}, seed=3, progress=False)
    assert_same(outs, ref)
    assert any(o["finish_reason"] == "stop" for o in outs) and any(o["finish_reason"] == "length" for o in outs)


def test_the_gpus_schedule_runs_on_the_cpu(model, monkeypatch):
    """What a GPU runs, less the capture: decode rows padded to a power-of-two bucket (the pad rows write into free
    slots, which an admission then overwrites), spans rounded up to 256 columns, admissions in forwards of their own,
    shared prefixes copied. The reference's tokens; every bucket size is met."""
    instruction = [(11 * i) % 90 + 3 for i in range(20)]
    prompts = PROMPTS + [instruction + [i + 1] for i in range(4)] + [PROMPTS[3]] * 2
    caps = [9, 3, 12, 5, 2, 7, 4, 10, 6, 3, 8, 2]
    eng = Engine(model, max_seqs=5, mix=False, key_bucket=256)
    eng.allocate(256)  # before graphs is set: allocate would ask CUDA for a graph memory pool
    eng.graphs = True  # _bucket pads the decode rows as for the CUDA graphs ...
    steps = []

    def eager(tokens, pos, keys, counters, span, temperature):  # ... and _decode runs them eagerly
        steps.append((tokens.shape[0], span))
        return eng.decode_step(tokens, pos, keys, counters, span, temperature)
    monkeypatch.setattr(eng, "_decode", eager)
    outs = eng.run(prompts, temperature=1.0, max_new_tokens=caps, seed=4, progress=False)
    assert_same(outs, reference_alone(model, prompts, caps, 4))
    assert {b for b, _ in steps} == {1, 2, 4, 5} and {s for _, s in steps} == {256}


def test_per_prompt_seeds_do_not_depend_on_the_batch(model):
    """seeds= (train.py's SDFT): a prompt's response is a function of its own seed, whatever prompts share its batch,
    the batch size, the order, or which rank samples it."""
    stop = a_stop_id(model, PROMPTS[0], 3)
    seeds = [7, 8, 9, 10, 11, 12]

    def run(idx, batch_size):
        return [o["token_ids"] for o in native.sample(model, [PROMPTS[i] for i in idx], temperature=1.0,
                                                      max_new_tokens=10, stop_ids={stop}, seeds=[seeds[i] for i in idx],
                                                 batch_size=batch_size, progress=False)]
    together = run(range(6), 6)
    assert [run([i], 1)[0] for i in range(6)] == together
    assert run(range(5, -1, -1), 3)[::-1] == together
    assert run([0, 2, 4], 2) == [together[i] for i in (0, 2, 4)]
    other = native.sample(model, PROMPTS, temperature=1.0, max_new_tokens=10, stop_ids={stop}, seeds=seeds[:5] + [13],
                          progress=False)
    assert [o["token_ids"] for o in other][:5] == together[:5] and other[5]["token_ids"] != together[5]
    with pytest.raises(ValueError, match="2 seeds for 6 prompts"):
        native.sample(model, PROMPTS, seeds=[1, 2], progress=False)


def test_seed_reproduces_and_differs(model):
    def run(seed, batch_size=2):
        return [o["token_ids"] for o in native.sample(model, PROMPTS, temperature=1.0, max_new_tokens=10, seed=seed,
                                                      batch_size=batch_size, progress=False)]
    assert run(0) == run(0) == run(0, batch_size=5)
    assert run(0) != run(1)


@pytest.fixture
def prefilled(monkeypatch):
    """The number of tokens of every prefill forward the engine runs."""
    sizes = []
    real = Engine._forward

    def counting(self, ids, pos, slots, docs, copies, n_rows=0, span=0):
        sizes.append(ids.numel() - n_rows)  # the documents' tokens, not the decode rows riding along
        return real(self, ids, pos, slots, docs, copies, n_rows, span)
    monkeypatch.setattr(Engine, "_forward", counting)
    return sizes


def test_repeated_prompts_prefill_once_and_sample_apart(model, prefilled):
    """Identical prompts admitted together are prefilled once (the others copy the first one's cache columns and
    prefill only their last token, for its logits) and give exactly what prefilling each would: the same tokens as
    the reference, each repeat with its own draws."""
    prompts = [PROMPTS[0]] * 4 + [PROMPTS[3]] * 3 + [PROMPTS[1]]
    outs = native.sample(model, prompts, temperature=1.0, max_new_tokens=8, seed=2, batch_size=8, progress=False)
    assert prefilled == [len(PROMPTS[0]) + len(PROMPTS[3]) + len(PROMPTS[1]) + 3 + 2]  # leaders + repeats' last
    assert_same(outs, reference(model, prompts, temperature=1.0, max_new_tokens=8, seed=2))
    assert len({tuple(o["token_ids"]) for o in outs[:4]}) > 1  # the repeats are separate samples


def test_shared_prefixes_prefill_once(model, prefilled):
    """Prompts that share a prefix of >= 16 tokens (a task's instruction) copy it from a sequence in the cache, or
    from one admitted before them, and prefill only the rest: the same tokens as prefilling everything."""
    instruction = [(7 * i) % 90 + 3 for i in range(37)]
    prompts = [instruction + [i + 1, 2 * i + 5] for i in range(10)] + [instruction[:20] + [1, 2, 3]] + PROMPTS[:2]
    outs = native.sample(model, prompts, temperature=1.0, max_new_tokens=6, seed=9, batch_size=4, progress=False)
    assert sum(prefilled) < sum(len(p) for p in prompts) - 8 * 32  # most of the 37-token instruction is shared
    assert_same(outs, reference(model, prompts, temperature=1.0, max_new_tokens=6, seed=9))


@pytest.mark.parametrize("mix", [True, False])
def test_prefixes_shared_with_live_sequences(model, mix, monkeypatch):
    """Admissions while sequences are live (3 slots, caps of 2-9 tokens): a prompt copies its prefix from a resident
    sequence or from a prompt of the same forward (in each layer, once the donor's columns are written), the decode
    rows ride along when mixing, and a small prefill budget leaves prompts waiting: the reference's tokens throughout."""
    twin = [2, 2, 2, 4, 6, 8, 10, 12, 14, 16, 18]  # sorts first: a repeat admitted with its donor
    instruction = [(7 * i) % 90 + 3 for i in range(37)]
    prompts = [twin, twin] + [instruction + [i + 1, 2 * i + 5] for i in range(9)] + [instruction[:20] + [1, 2, 3]] \
        + PROMPTS[:3]
    caps = [3, 5, 2, 7, 3, 9, 4, 6, 5, 8, 3, 2, 4, 6, 5]
    seen = []  # per forward: (decode rows, documents, copies)
    real = Engine._forward

    def spy(self, ids, pos, slots, docs, copies, n_rows=0, span=0):
        seen.append((n_rows, list(docs), list(copies)))
        return real(self, ids, pos, slots, docs, copies, n_rows, span)
    monkeypatch.setattr(Engine, "_forward", spy)
    outs = Engine(model, max_seqs=3, mix=mix, max_prefill_tokens=30).run(
        prompts, temperature=1.0, max_new_tokens=caps, seed=5, progress=False)
    assert_same(outs, reference_alone(model, prompts, caps, 5))
    # the twin prefills its last token only, from its donor in the same forward; the 23-token prompt (11 + 1 + 23
    # tokens > 30) waits with a slot free
    assert seen[0][1:] == ([(0, 0, 11), (1, 10, 11)], [(0, 1, 10)])
    resident = [src < docs[0][0] for _, docs, copies in seen[1:] for src, _, _ in copies]
    assert any(resident)  # donors in the cache too
    assert any(rows and copies for rows, _, copies in seen) == mix  # decode rows beside copied prefixes


def test_slot_bookkeeping_survives_thousands_of_admissions(tmp_path):
    """1,500 prompts of random lengths through 5 slots, random stops: every admission, finish and move of a slot
    must keep each sequence's own cache columns; any slot leaked or shared would change its tokens."""
    m = tiny_llama(tmp_path / "m", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, vocab_size=23)
    rng = random.Random(0)
    prompts = [[rng.randrange(23) for _ in range(rng.randint(1, 6))] for _ in range(1500)]
    stops = {3, 7, 11}  # with 23 tokens, responses end after ~1-8 tokens
    outs = native.sample(m, prompts, temperature=1.0, max_new_tokens=8, stop_ids=stops, seed=4, batch_size=5,
                         progress=False)
    lengths = [len(o["token_ids"]) for o in outs]
    assert min(lengths) == 1 and max(lengths) == 8 and sum(lengths) > 3000
    keys = row_keys(len(prompts), 4)
    for i in rng.sample(range(len(prompts)), 120):
        assert_same([outs[i]], reference(m, [prompts[i]], temperature=1.0, max_new_tokens=8, stop_ids=stops,
                                         seeds=[keys[i]]))


def test_decode_step_compiles_whole(model):
    """The decode step has static shapes and no host sync: one graph, no breaks (what a CUDA graph captures)."""
    engine = Engine(model, max_seqs=4)
    engine.allocate(16)
    args = [torch.tensor(v) for v in ([5, 6, 7], [3, 0, 9], [1, 2, 3], [0, 0, 4])]
    eager = engine.decode_step(*args, 16, 1.0)
    torch._dynamo.reset()
    compiled = torch.compile(engine.decode_step, fullgraph=True, backend="aot_eager")
    engine.allocate(16)
    out = compiled(*args, 16, 1.0)
    assert torch.equal(out[0], eager[0]) and torch.allclose(out[1], eager[1], atol=TOL)


def test_the_cpu_engine_packs_frozen_weights_only(model):
    """The reference comparisons above run the packed products (the CPU default), also inside a process group (the
    generation workers'); weights that train (train.py's SDFT: requires_grad) are sampled with the model's own
    tensors; packed and plain products give the same greedy tokens, log-probs within TOL."""
    import torch.distributed as dist
    from model.transformer import Linear
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * model.cfg.num_hidden_layers + 1  # q/k/v, o, gate/up, down and lm_head
    assert list(Engine(model).packs) == linears
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert list(Engine(model).packs) == linears
    finally:
        dist.destroy_process_group()
    model.requires_grad_(True)
    try:
        plain = Engine(model)
    finally:
        model.requires_grad_(False)
    assert not plain.packs
    kw = dict(temperature=0.0, max_new_tokens=12, progress=False)
    a, b = plain.run(PROMPTS, **kw), Engine(model).run(PROMPTS, **kw)
    assert [o["token_ids"] for o in a] == [o["token_ids"] for o in b]
    assert max(abs(x - y) for o, p in zip(a, b) for x, y in zip(o["logprobs"], p["logprobs"])) < TOL


def test_each_prompt_may_have_its_own_length_cap(model):
    caps = [1, 5, 3, 9, 2, 4]
    outs = native.sample(model, PROMPTS, temperature=1.0, max_new_tokens=caps, seed=6, batch_size=3, progress=False)
    assert [len(o["token_ids"]) for o in outs] == caps and {o["finish_reason"] for o in outs} == {"length"}
    assert [o["token_ids"] for o in outs] == [reference(model, [p], temperature=1.0, max_new_tokens=c,
                                                        seeds=[row_keys(6, 6)[i]])[0]["token_ids"]
                                              for i, (p, c) in enumerate(zip(PROMPTS, caps))]
    with pytest.raises(ValueError, match="2 max_new_tokens for 6 prompts"):
        native.sample(model, PROMPTS, max_new_tokens=[1, 2], progress=False)


