"""The native generation engine: continuous batching over a slot KV cache, a static-shape decode step (captured as a
CUDA graph on a GPU), fused projections, shared prefill of repeated prompts, exact raw log-probs.

    engine = Engine(model, max_seqs=32)
    outs = engine.generate(prompts, temperature=0.1, max_new_tokens=512, stop_ids={2}, seed=0)
    outs[i] = {"token_ids": [...], "logprobs": [...], "finish_reason": "stop" | "length"}

The cache. Keys and values live in one preallocated tensor per layer, [max_seqs, n_kv, max_len, head_dim]; a
sequence owns one slot (row) from its admission to its last token, its token at position p in column p. The live
sequences are kept in slots 0..n-1, so a decode step reads the views [:n] (no gather, no copy): a finished sequence
frees its slot at once, a waiting prompt is admitted into it, and only when nothing waits is the highest live slot
moved down into the hole (one sequence's columns copied, never the whole batch's).

The schedule (nano-vllm's, simplified). Prompts wait in token order, so that prompts sharing a prefix (a task's
instruction, evaluation's repeats) meet. Each iteration admits waiting prompts into free slots (at most
`max_prefill_tokens` prompt tokens per iteration, one packed forward, only the last position of each prompt through
lm_head), then runs one decode step of every live sequence. On the CPU (no graphs) the live sequences' decode step
rides in the admission's forward (vLLM's mixed batches): a product of a few rows reads the whole weight anyway, so an
admission no longer costs a forward of its own. A prompt that shares a prefix with a resident sequence or an earlier
admission copies that prefix's cache columns (in each layer, once the donor's are written) and prefills only the rest.
The KV cache is allocated once per engine (grown when a call needs longer sequences), so CUDA graphs captured in one
call serve the next.

The decode step is a pure function of static-shape tensors: tokens, positions, per-row sampling keys and counters
of the `n` live rows padded up to a batch bucket, attention over the first `span` cache columns (a multiple of
`key_bucket`), sampling on the device, no host sync. On a GPU each (bucket, span) is captured once as a CUDA graph and
replayed; the scheduler syncs once per step (the sampled tokens). On the CPU it runs eagerly, unpadded (a pad row
costs as much as a real one there, and there is no launch overhead to save).

Sampling: the raw log-prob of each sampled token is log_softmax(logits)[token] in fp32, before temperature (vLLM's
raw_logprobs). The token is drawn by the Gumbel-max trick, argmax(logits / T + g), with g = -log(-log u) and u a
counter-based hash of (the row's key, the token's index in its response, the vocabulary id): exact sampling from
softmax(logits / T), and a prompt's draws depend on its own key only, never on its neighbours in a batch, the batch
size, the schedule or the device. Keys: `seeds[i]` when given (train.py's SDFT: one per example and step), else a
function of (seed, i). temperature 0 is greedy. The noise is bounded (u has 32 bits), so only tokens whose scaled logit
lies within that bound of the top token's drawn score can win: outside a CUDA graph the sampler draws noise for
those alone (at T 0.1 a handful), the same tokens bit for bit as the draw over the whole vocabulary.
"""
import os
import time
from collections import deque

import torch
import torch.nn.functional as F

from kernels import varlen_attention
from model.transformer import Transformer, apply_rope, linear, rope_cos_sin, rope_inv_freq

M32 = 0xFFFFFFFF


# ---- counter-based random numbers: the same bits on every device and for every batch ---------------------------
def _mul32(x, c: int):
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without ever overflowing int64 (two 16-bit halves of c)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def hash32(x):
    """lowbias32 (C. Wellons' integer hash), a bijection of [0, 2^32), on int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_hash(keys, counters):
    """Each row's 32-bit stream id from its int64 key [n] (any non-negative value < 2^63) and counter [n]."""
    row = hash32(hash32(keys & M32) ^ ((keys >> 32) & M32))  # not symmetric in the halves: (s, i) != (i, s)
    return hash32(row ^ (counters & M32))


def _noise(row, ids):
    """The Gumbel noise (fp64) of vocabulary ids under row hashes `row` (broadcast together)."""
    u = (hash32(row ^ ids).double() + 0.5) * 2.0 ** -32  # in (0, 1)
    return -torch.log(-torch.log(u))


def gumbel(keys, counters, vocab: int):
    """Gumbel noise [n, vocab] (fp64) for rows with int64 keys [n] drawing their counters[n]-th token: a function of
    (key, counter, vocabulary id) only."""
    return _noise(_row_hash(keys, counters)[:, None], torch.arange(vocab, device=keys.device))


# The largest noise any token can draw (u's largest value, (2^32 - 0.5) / 2^32). A token whose scaled logit plus it
# falls short of some token's drawn score cannot win the argmax, so its noise need never be drawn.
G_MAX = -torch.log(-torch.log(torch.tensor((2.0 ** 32 - 0.5) * 2.0 ** -32, dtype=torch.float64))).item()
# Above this temperature the tokens within T * G_MAX logits of the top are most of a language model's vocabulary, and
# looking for them costs more than it saves; below it, a few (both ways give the same tokens)
CANDIDATE_MAX_T = 0.5


def sample(logits, temperature: float, keys, counters):
    """logits [n, V] -> (token ids [n], raw fp32 log-prob of each [n]); see the module docstring."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
    elif (temperature > CANDIDATE_MAX_T or (logits.is_cuda and torch.cuda.is_current_stream_capturing())
          or torch.compiler.is_compiling()):
        tokens = _full_draw(logits, temperature, keys, counters)  # static shapes
    else:
        tokens = _sample_candidates(logits, temperature, keys, counters)
    logprobs = logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return tokens, logprobs


def _full_draw(logits, temperature: float, keys, counters, rows: int | None = None):
    """argmax(logits / T + gumbel) over the whole vocabulary, `rows` rows at a time: the draw makes ~20 fp64/int64
    temporaries of its input's size, which for a whole batch miss the CPU's caches (and are fresh pages each call)."""
    n, vocab = logits.shape
    rows = rows or (n if logits.is_cuda else max(1, (1 << 18) // vocab))
    return torch.cat([(logits[i:i + rows].double() / temperature
                       + gumbel(keys[i:i + rows], counters[i:i + rows], vocab)).argmax(-1) for i in range(0, n, rows)])


def _sample_candidates(logits, temperature: float, keys, counters):
    """_full_draw's tokens, bit for bit, with noise drawn only for the tokens that can win: those whose scaled logit
    plus G_MAX reaches the top logit's drawn score: at T 0.1 a handful (the noise's range, ~26, is 2.6 logits there).
    Its shapes depend on the data: not under a CUDA graph's capture or torch.compile."""
    n, vocab = logits.shape
    row = _row_hash(keys, counters)
    top = logits.argmax(-1)
    best = logits.gather(-1, top[:, None]).squeeze(-1).double() / temperature + _noise(row, top)
    floor = ((best - G_MAX) * temperature).float()
    floor -= floor.abs() * 1e-6 + 1e-6  # fp32 rounding of the bound: keep a superset of the exact candidates
    r, j = (logits >= floor[:, None]).nonzero(as_tuple=True)  # row-major: ids ascending within a row
    if r.numel() * 8 > logits.numel():  # a flat distribution: most tokens can win
        return _full_draw(logits, temperature, keys, counters)
    score = logits[r, j].double() / temperature + _noise(row[r], j)  # the full draw's ops, element for element
    row_max = torch.full((n,), -torch.inf, dtype=score.dtype, device=score.device).scatter_reduce(0, r, score, "amax")
    won = score == row_max[r]
    # argmax's rule among equal maxima: the first id
    return torch.full((n,), vocab, device=r.device).scatter_reduce(0, r[won], j[won], "amin")


def row_keys(n: int, seed: int, seeds=None) -> list[int]:
    """One sampling key per prompt: seeds[i], or (seed, i) packed into 63 bits."""
    if seeds is not None:
        return [int(s) & ((1 << 63) - 1) for s in seeds]
    return [((seed & 0x7FFFFFFF) << 32) | i for i in range(n)]


# ---- the engine -------------------------------------------------------------------------------------------------
class Engine:
    """See the module docstring. model: a Transformer (plain tensors, or an FSDP2 model whose units are unsharded
    for the duration, as train.py's SDFT does). max_seqs: live sequences at once (the KV cache holds this many
    rows of max prompt + max_new_tokens columns). graphs: capture the decode step as CUDA graphs (default: on CUDA
    unless OPR_ENGINE_GRAPHS=0).
    lm_head_fp32: compute the logits in fp32 from a bf16 model (an fp32 copy of lm_head's weight).
    mix: run the live sequences' decode step inside each admission's prefill forward (default: on the CPU).
    pack: multiply by copies of the weights packed once for oneDNN (default: on the CPU in fp32, unless the weights
    are being trained: train.py's SDFT samples from them between optimizer steps)."""

    def __init__(self, model: Transformer, max_seqs: int = 32, *, graphs: bool | None = None,
                 max_prefill_tokens: int | None = None, key_bucket: int | None = None, lm_head_fp32: bool = False,
                 mix: bool | None = None, pack: bool | None = None):
        self.model, self.cfg = model, model.cfg
        w = model.lm_head.weight
        self.device, self.dtype = w.device, w.dtype
        cuda = self.device.type == "cuda"
        self.max_seqs = max_seqs
        # weights that train (train.py's SDFT, under torch.distributed): capturing beside NCCL's watchdog is fragile,
        # each capture empties the allocator's cache, which training's memory relies on, and packed copies go stale.
        # Generation workers (model/workers.py) sample from frozen weights in a gloo group: graphs and packing stay
        training = any(p.requires_grad for p in model.parameters())
        if graphs is None:
            graphs = cuda and os.environ.get("OPR_ENGINE_GRAPHS", "1") != "0" and not training
        self.graphs = graphs
        self.mix = not cuda if mix is None else mix
        self.key_bucket = key_bucket or (256 if cuda else 1)
        self.max_prefill_tokens = max_prefill_tokens or (16384 if cuda else 4096)
        if pack is None:
            pack = (self.device.type == "cpu" and self.dtype == torch.float32 and torch.backends.mkldnn.is_available()
                    and not training)
        self.layers = [_layer_weights(block, pack) for block in model.model.layers]
        self.lm_head = w.float() if lm_head_fp32 else w
        if pack:
            self.lm_head = Packed.of(self.lm_head)
        self.inv_freq = rope_inv_freq(self.cfg, self.device)
        self._graphs, self.K = {}, None

    # -- the model, as the engine runs it --------------------------------------------------------------------------
    def _block(self, L, x, cos, sin, attend):
        """One transformer block on hidden states x [T, H]; attend(layer_idx, q, k, v) -> [T, Hq*D]."""
        cfg = self.cfg
        T = x.shape[0]
        h = L["ln1"](x)
        q, k, v = _mm(h, *L["qkv"]).split([L["q_dim"], L["kv_dim"], L["kv_dim"]], dim=-1)
        q = q.reshape(T, cfg.num_attention_heads, cfg.head_dim)
        k = k.reshape(T, cfg.num_key_value_heads, cfg.head_dim)
        v = v.reshape(T, cfg.num_key_value_heads, cfg.head_dim)
        if L["q_norm"] is not None:
            q, k = L["q_norm"](q), L["k_norm"](k)
        q, k = apply_rope(q[None], cos, sin)[0], apply_rope(k[None], cos, sin)[0]
        x = x + _mm(attend(L["idx"], q, k, v), *L["o"])
        h = L["ln2"](x)
        g, u = _mm(h, *L["gate_up"]).chunk(2, dim=-1)
        return x + _mm(F.silu(g) * u, *L["down"])

    def _logits(self, h):
        h = self.model.model.norm(h)
        return F.linear(h.to(self.lm_head.dtype), self.lm_head) if self.lm_head.dtype != h.dtype else \
            _mm(h, self.lm_head)

    def _forward(self, ids, pos, slots, docs, copies, n_rows: int = 0, span: int = 0):
        """One packed forward of n_rows decode rows and then prefill documents -> the logits of each row and of each
        document's last token [n_rows + len(docs), V]; every token's keys and values are written into its slot.
        ids, pos, slots [T]: the tokens, their positions and slots. The first n_rows are the live sequences' last
        tokens (slots 0..n_rows-1), attending over cache columns [0, span) as decode_step's rows do. docs: per
        document (slot, start, end): its tokens are positions start..end-1 of its sequence; positions before `start`
        (a shared prefix) are in its slot, or get there through `copies` [(src slot, dst slot, columns)], made in
        order in each layer once that layer's new keys and values are written, so a prefix may come from a document
        of this same forward. Each document attends causally over its slot's columns: all in one varlen call when
        none has a prefix, else one call each."""
        dev = ids.device
        lens = [e - b for _, b, e in docs]
        cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
        cached = any(b > 0 for _, b, _ in docs)
        hkv, g = self.cfg.num_key_value_heads, self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        if cached:  # built once, the same in every layer: per document with a prefix, the mask by which new token j
            # (position b + j) sees columns 0..b+j; per document without one, its own cu_seqlens for the varlen call
            masks = [(torch.arange(e, device=dev)[None, :] <= torch.arange(b, e, device=dev)[:, None]).repeat(g, 1)
                     if b else None for _, b, e in docs]
            own_cu = [None if b else torch.tensor([0, e], device=dev, dtype=torch.int32) for _, b, e in docs]
        row_mask = _row_mask(pos[:n_rows], span) if n_rows else None

        def attend(i, q, k, v):
            self.k[i][slots, :, pos] = k
            self.v[i][slots, :, pos] = v
            for src, dst, n in copies:
                self.k[i][dst, :, :n] = self.k[i][src, :, :n]
                self.v[i][dst, :, :n] = self.v[i][src, :, :n]
            out = [self._attend_rows(i, q[:n_rows], row_mask)] if n_rows else []
            q, k, v = q[n_rows:], k[n_rows:], v[n_rows:]
            if docs and not cached:
                out.append(varlen_attention(q, k, v, cu, max(lens)).flatten(1))
            elif docs:
                at = 0
                for (slot, b, e), n, mask, cu_d in zip(docs, lens, masks, own_cu):  # sees the slot's columns 0..e-1
                    if not b:  # no prefix: causal among its own tokens, as in a forward without prefixes
                        out.append(varlen_attention(q[at:at + n], k[at:at + n], v[at:at + n], cu_d, n).flatten(1))
                        at += n
                        continue
                    # [n, Hq, D] -> [1, Hkv, G * n, D]: each kv head's G query heads as G * n queries (_attend_rows)
                    qd = q[at:at + n].view(n, hkv, g, -1).permute(1, 2, 0, 3).reshape(1, hkv, g * n, -1)
                    kd, vd = self.k[i][slot:slot + 1, :, :e], self.v[i][slot:slot + 1, :, :e]
                    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)
                    out.append(od.view(hkv, g, n, -1).permute(2, 0, 1, 3).reshape(n, -1))
                    at += n
            return torch.cat(out) if len(out) > 1 else out[0]
        x = self.model.model.embed_tokens(ids)
        cos, sin = rope_cos_sin(self.inv_freq, pos[None], self.dtype)  # [1, T, D], as the training model
        for L in self.layers:
            x = self._block(L, x, cos, sin, attend)
        last = torch.cat([torch.arange(n_rows, device=dev), n_rows + cu[1:].long() - 1])
        return self._logits(x[last])

    def _attend_rows(self, i, q, mask):
        """Layer i's attention of one new token in each slot 0..n-1 (q [n, Hq, D]) over the cache columns that
        mask [n, 1, 1, span] (_row_mask) lets it see."""
        n, span = q.shape[0], mask.shape[-1]
        # the G query heads of each kv head as G queries of one head (q head h reads kv head h // G, as enable_gqa
        # does): a boolean mask with enable_gqa sends CUDA to the math kernel, this shape does not
        qg = q.view(n, self.cfg.num_key_value_heads, -1, q.shape[-1])
        out = F.scaled_dot_product_attention(qg, self.k[i][:n, :, :span], self.v[i][:n, :, :span], attn_mask=mask)
        return out.reshape(n, -1)

    def decode_step(self, tokens, pos, keys, counters, span: int, temperature: float):
        """One token for each of the first len(tokens) slots: tokens, pos, keys, counters [n] (int64, device);
        attention over cache columns [0, span). Returns (next tokens [n], their raw log-probs [n]). Static shapes,
        no host sync: compiles with fullgraph=True and is what the CUDA graphs capture."""
        n = tokens.shape[0]
        rows = torch.arange(n, device=tokens.device)
        mask = _row_mask(pos, span)

        def attend(i, q, k, v):
            self.k[i][rows, :, pos] = k
            self.v[i][rows, :, pos] = v
            return self._attend_rows(i, q, mask)
        x = self.model.model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(self.inv_freq, pos[None], self.dtype)  # [1, T, D], as the training model
        for L in self.layers:
            x = self._block(L, x, cos, sin, attend)
        return sample(self._logits(x), temperature, keys, counters)

    def _round(self, n: int) -> int:
        """n up to a multiple of key_bucket (CUDA: spans repeat, so graphs and attention plans do)."""
        return -(-n // self.key_bucket) * self.key_bucket

    # -- CUDA graphs --------------------------------------------------------------------------------------------------
    def _bucket(self, n: int) -> int:
        if not self.graphs:
            return n
        b = 1
        while b < n:
            b *= 2
        return min(b, self.max_seqs)

    def _decode(self, tokens, pos, keys, counters, span, temperature):
        if not self.graphs:
            return self.decode_step(tokens, pos, keys, counters, span, temperature)
        n = tokens.shape[0]
        key = (n, span, temperature)
        if key not in self._graphs:
            static = [t.clone() for t in (tokens, pos, keys, counters)]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up off the capture: lazy initialisations happen here
                self.decode_step(*static, span, temperature)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self.decode_step(*static, span, temperature)
            self._graphs[key] = (graph, static, out)
        graph, static, out = self._graphs[key]
        for dst, src in zip(static, (tokens, pos, keys, counters)):
            dst.copy_(src)
        graph.replay()
        return out

    def allocate(self, cols: int):
        """The KV cache for sequences of up to `cols` tokens (and no CUDA graphs yet: they capture its addresses). It
        stays with the engine: the next call reuses it, and the graphs captured over it, when its sequences fit."""
        shape = (len(self.layers), self.max_seqs, self.cfg.num_key_value_heads, cols, self.cfg.head_dim)
        # zeros, not empty: a masked column still enters attention's weighted sum (0 * NaN would be NaN)
        self.K = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.V = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.k, self.v = list(self.K.unbind(0)), list(self.V.unbind(0))
        self._graphs, self._pool = {}, torch.cuda.graph_pool_handle() if self.graphs else None

    # -- the scheduler ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], *, temperature: float = 0.1, max_new_tokens: int | list = 512,
                 stop_ids=(), seed: int = 0, seeds: list[int] | None = None, progress: bool = True) -> list[dict]:
        """One response per prompt (token id lists), in the input order. See the module docstring.
        max_new_tokens: one cap for all, or one per prompt (tasks of one call may need 4 tokens or 512)."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        caps = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(caps) != len(prompts):
            raise ValueError(f"generate: {len(caps)} max_new_tokens for {len(prompts)} prompts")
        if any(c < 1 for c in caps):
            raise ValueError(f"max_new_tokens must be >= 1, got {min(caps)}")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("generate: empty prompt (no token ids)")
        if not prompts:
            return []
        stop = set(int(t) for t in stop_ids)
        keys = row_keys(len(prompts), seed, seeds)
        max_len = max(len(p) + c for p, c in zip(prompts, caps))
        cols = self._round(max_len)
        if self.K is None or self.K.shape[3] < cols:  # else the cache (and the graphs that read it) serve again
            self.allocate(cols)

        out_tokens = [[] for _ in prompts]
        out_logprobs = [[] for _ in prompts]
        finish = [None] * len(prompts)
        # in token order: prompts that share a prefix (a task's instruction, repeats) are admitted together
        waiting = deque(sorted(range(len(prompts)), key=lambda i: (prompts[i], i)))
        self._prefix, self._hashes, self._prompt = {}, {}, {}  # block hash -> slots; slot -> hashes, prompt
        live = []  # slot -> prompt index: the live sequences are slots 0..len(live)-1
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(prompts), unit="prompt", desc="generate", dynamic_ncols=True)
        t0, n_new = time.perf_counter(), 0

        def step_done(rows, tokens, logprobs):
            """Append each row's new token and free the slots of the rows that are done."""
            nonlocal live, n_new
            done = set()
            for r, tok, lp in zip(rows, tokens, logprobs):
                out_tokens[r].append(tok)
                out_logprobs[r].append(lp)
                if tok in stop or len(out_tokens[r]) == caps[r]:
                    finish[r] = "stop" if tok in stop else "length"
                    done.add(r)
            n_new += len(rows)
            if done:
                live = self._free(live, done, prompts, out_tokens)
                if bar is not None:
                    bar.update(len(done))
                    bar.set_postfix(tok_s=f"{n_new / (time.perf_counter() - t0):.1f}", live=len(live))

        while waiting or live:
            rows = []
            if waiting and len(live) < self.max_seqs:
                # the next waiting prompts into free slots, in one forward; on the CPU the live sequences' decode
                # step rides along (their tokens share its products: a few rows' GEMMs read the weights anyway)
                rows = list(live) if self.mix else []
                take, docs, copies = self._take(waiting, prompts, len(live))
                pos = [len(prompts[r]) + len(out_tokens[r]) - 1 for r in rows]  # of the token fed in
                dev = self.device
                ids = [out_tokens[r][-1] for r in rows] + [t for r, d in zip(take, docs) for t in prompts[r][d[1]:]]
                pos += [q for _, b, e in docs for q in range(b, e)]
                slots = list(range(len(rows))) + [slot for slot, b, e in docs for _ in range(e - b)]
                logits = self._forward(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
                                       torch.tensor(slots, device=dev), docs, copies, len(rows),
                                       self._round(max(pos[:len(rows)], default=0) + 1))
                counters = [len(out_tokens[r]) for r in rows] + [0] * len(take)  # the token's index in its response
                tokens, logprobs = sample(logits, temperature, torch.tensor([keys[r] for r in rows + take], device=dev),
                                          torch.tensor(counters, device=dev))
                live += take
                step_done(rows + take, tokens.tolist(), logprobs.tolist())
            if rows or not live:
                continue
            n = len(live)
            pos = [len(prompts[r]) + len(out_tokens[r]) - 1 for r in live]  # of the token fed in
            span = self._round(max(pos) + 1)
            pad = [0] * (self._bucket(n) - n)  # pad rows write into free slots, which a prefill overwrites
            dev = dict(device=self.device, dtype=torch.long)
            tokens, logprobs = self._decode(
                torch.tensor([out_tokens[r][-1] for r in live] + pad, **dev), torch.tensor(pos + pad, **dev),
                torch.tensor([keys[r] for r in live] + pad, **dev),
                torch.tensor([len(out_tokens[r]) for r in live] + pad, **dev), span, temperature)
            step_done(list(live), tokens[:n].tolist(), logprobs[:n].tolist())  # the step's one host sync
        if bar is not None:
            bar.close()
        return [{"token_ids": out_tokens[i], "logprobs": out_logprobs[i], "finish_reason": finish[i]}
                for i in range(len(prompts))]

    def _take(self, waiting: deque, prompts, first_slot: int):
        """The next waiting prompts for slots first_slot.., at most max_prefill_tokens tokens to prefill. A prompt
        that repeats, or shares a prefix of at least BLOCK tokens with, a resident sequence or a prompt taken before
        it copies that prefix's cache columns and prefills only the rest (a repeat: its last token).
        Returns (prompt indices, their documents [(slot, start, end)], copies [(src, dst, columns)]) for _forward."""
        take, docs, copies, n_tok = [], [], [], 0
        while waiting and first_slot + len(take) < self.max_seqs:
            r, slot = waiting[0], first_slot + len(take)
            donor, shared = self._donor(prompts[r])
            if take and n_tok + len(prompts[r]) - shared > self.max_prefill_tokens:
                break
            take.append(waiting.popleft())
            n_tok += len(prompts[r]) - shared
            docs.append((slot, shared, len(prompts[r])))
            if donor is not None:
                copies.append((donor, slot, shared))
            self._index(slot, prompts[r])
        return take, docs, copies

    def _donor(self, prompt) -> tuple:
        """(slot, shared length) of the resident sequence whose prompt shares the longest prefix with `prompt` (the
        whole prompt, or at least BLOCK tokens: found through _prefix_keys; at most len(prompt) - 1, since the last
        token is prefilled for its logits), or (None, 0)."""
        for h in reversed(_prefix_keys(prompt)):
            slots = self._prefix.get(h)
            if slots:
                slot = min(slots)
                other = self._prompt[slot]
                n = next((i for i, (a, b) in enumerate(zip(prompt, other)) if a != b), min(len(prompt), len(other)))
                n = min(n, len(prompt) - 1)
                return (slot, n) if n > 0 else (None, 0)
        return None, 0

    def _index(self, slot: int, prompt):
        """Make slot's prompt findable as a donor (None: forget it)."""
        for h in self._hashes.pop(slot, ()):
            self._prefix[h].discard(slot)
        self._prompt[slot] = prompt
        if prompt is not None:
            self._hashes[slot] = _prefix_keys(prompt)
            for h in self._hashes[slot]:
                self._prefix.setdefault(h, set()).add(slot)

    def _copy_slot(self, src: int, dst: int, n_cols: int):
        for t in (self.K, self.V):  # every layer in one copy
            t[:, dst, :, :n_cols] = t[:, src, :, :n_cols]

    def _free(self, live: list, done: set, prompts, out_tokens) -> list:
        """Drop finished sequences, keeping the live ones in slots 0..n-1: the last live sequence moves into each
        hole (its columns are copied; nothing else moves)."""
        for s in sorted((s for s, r in enumerate(live) if r in done), reverse=True):
            last = len(live) - 1
            if s != last:
                r = live[last]
                self._copy_slot(last, s, len(prompts[r]) + len(out_tokens[r]) - 1)
                live[s] = r
                self._index(s, prompts[r])
            self._index(last, None)
            live.pop()
        return live


def _row_mask(pos, span: int):
    """[n, 1, 1, span]: row i (at position pos[i]) sees cache columns 0..pos[i]."""
    return (torch.arange(span, device=pos.device)[None, :] <= pos[:, None])[:, None, None, :]


BLOCK = 16  # prefix sharing looks prompts up by hashes of their first 16, 32, 48, ... tokens


def _prefix_keys(prompt) -> list:
    """Keys of the prompt's prefixes, shortest first: chained hashes of its full BLOCK-token prefixes (key k
    identifies prompt[:BLOCK * (k + 1)]), then the whole prompt (a repeat of a short prompt shares it too)."""
    out, h = [], 0
    for k in range(len(prompt) // BLOCK):
        h = hash((h, tuple(prompt[k * BLOCK:(k + 1) * BLOCK])))
        out.append(h)
    return out + [("prompt", tuple(prompt))]


class Packed:
    """A weight [N, K] copied once into the blocked layout oneDNN's fp32 kernels read (the layout vLLM's CPU backend
    packs its weights into too): its products run at 2-4x F.linear's on plain weights at decode and prefill sizes."""
    PACK_ROWS = 64  # the row count the layout is chosen for; other row counts use it as it is

    def __init__(self, w):
        self.shape, self.dtype = w.shape, w.dtype
        self.w = torch.ops.mkldnn._reorder_linear_weight(w.detach(), self.PACK_ROWS)

    @classmethod
    def of(cls, w):
        return cls(w) if w.dim() == 2 and w.dtype == torch.float32 else w


def _mm(x, w, b=None):
    """x @ w.T + b for a plain weight (model.transformer.linear) or a Packed one."""
    if not isinstance(w, Packed):
        return linear(x, w, b)
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, w.shape[1]).contiguous(), w.w, b, "none", [], "")
    return y.view(*x.shape[:-1], w.shape[0])


def _layer_weights(block, pack: bool = False) -> dict:
    """A block's weights as the engine reads them (the model's own: fused q/k/v and gate/up, model/transformer.py),
    packed for oneDNN when `pack`."""
    a, m = block.self_attn, block.mlp
    w = Packed.of if pack else (lambda t: t)
    return dict(idx=a.layer_idx, ln1=block.input_layernorm, ln2=block.post_attention_layernorm, q_dim=a.q_dim,
                kv_dim=a.kv_dim, q_norm=getattr(a, "q_norm", None), k_norm=getattr(a, "k_norm", None),
                qkv=(w(a.qkv_proj.weight), a.qkv_proj.bias), o=(w(a.o_proj.weight), a.o_proj.bias),
                gate_up=(w(m.gate_up_proj.weight), m.gate_up_proj.bias), down=(w(m.down_proj.weight), m.down_proj.bias))
