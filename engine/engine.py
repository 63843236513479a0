"""The native generation engine: continuous batching over a slot KV cache, a static-shape decode
step (captured as a CUDA graph on a GPU), fused projections, shared prefill of repeated prompts,
exact raw log-probs.

    engine = Engine(model, max_seqs=32)
    outs = engine.run(prompts, temperature=0.1, max_new_tokens=512, stop_ids={2}, seed=0)
    outs[i] = {"token_ids": [...], "logprobs": [...], "finish_reason": "stop" | "length"}

The cache. Keys and values live in one preallocated tensor per layer, [max_seqs, n_kv, max_len,
head_dim]; a sequence owns one slot (row) from its admission to its last token, its token at
position p in column p; the scheduler (engine/scheduler.py) keeps the live sequences in slots
0..n-1, so a decode step reads the views [:n] (no gather, no copy). An engine allocates its cache
once (again when a run needs longer sequences) and keeps it, and the CUDA graphs captured over it,
from one run() to the next. engine.native.sample, the scripts' and sdft's entry, builds a new
engine at every call and keeps none, so nothing is reused across its calls: an engine packs the
weights as they are when it is built, and sdft's change between calls. A caller that generates
repeatedly from fixed weights keeps its own Engine to reuse the cache and graphs.

The model. The engine runs the model's own blocks (model/transformer.py), plugging its cache into
their attention (`attend`); on the CPU in fp32 their products read weights packed once for oneDNN
(transformer.Packed). A forward's attention takes one of three paths, each a method: _attend_c
(the CPU: each token over its own slot's columns 0..pos in one C call per layer, kernels/cpu.py,
the decode rows and the prompts admitted after a cached prefix alike; the other prompts by one
varlen call), else _attend_rows (the decode rows over the cache) and _attend_docs (the prompts:
varlen, or SDPA over the slot's columns after a cached prefix).

The decode step is a pure function of static-shape tensors: tokens, positions, per-row sampling keys
and counters of the `n` live rows padded up to a batch bucket, attention over the first `span` cache
columns (a multiple of `key_bucket`), sampling on the device, no host sync. On a GPU each
(bucket, span) is captured once as a CUDA graph and replayed; the scheduler syncs once per step (the
sampled tokens). On the CPU it runs eagerly, unpadded (a pad row costs as much as a real one there,
and there is no launch overhead to save).
"""
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.sampler import row_keys, sample
from engine.scheduler import Decode, Scheduler, Sequence
from kernels import cpu, varlen_attention
from model.transformer import (Transformer, pack_all, packed_products, packs, rope_cos_sin,
                               rope_inv_freq)


@dataclass
class Context:
    """One packed forward's attention context (Engine._context): built once, read by every layer
    (nano-vllm's Context)."""
    slots: torch.Tensor          # [T]: each token's slot (the decode rows' are 0..n_rows-1)
    pos: torch.Tensor            # [T]: its position, i.e. its column in the slot
    copies: list                 # [(src slot, dst slot, columns)]: shared prefixes, made in order
    docs: list                   # [(slot, start, end)]: the prefill documents, after the rows
    lens: list                   # per document: its tokens, end - start
    cu: torch.Tensor             # [len(docs) + 1] int32: the documents' cu_seqlens
    cached: bool                 # some document has a shared prefix (start > 0)
    row_mask: torch.Tensor | None = None  # torch: the rows' mask (_row_mask)
    masks: list | None = None    # torch, with prefixes: per document, its mask if it has a prefix
    doc_cu: list | None = None   # torch, with prefixes: per document without one, its cu_seqlens
    via_cache: torch.Tensor | None = None  # C: the tokens attending over the cache (rows, prefixed)
    own: torch.Tensor | None = None        # C: the others, causal among their document's tokens
    own_lens: list | None = None           # C: the lengths of those documents
    own_cu: torch.Tensor | None = None     # C: their cu_seqlens


class Engine:
    """See the module docstring. model: a Transformer (plain tensors, or an FSDP2 model whose units
    are unsharded for the duration, as train.py's SDFT does). max_seqs: live sequences at once (the
    KV cache holds this many rows of max prompt + max_new_tokens columns). graphs: capture the
    decode step as CUDA graphs (default: on CUDA unless OPR_ENGINE_GRAPHS=0).
    lm_head_fp32: compute the logits in fp32 from a bf16 model (an fp32 copy of lm_head's weight).
    mix: run the live sequences' decode step inside each admission's prefill forward (default: on
    the CPU). pack: multiply by copies of the weights packed once for oneDNN (default: on the CPU
    in fp32, unless the weights are being trained: train.py's SDFT samples from them between
    optimizer steps)."""

    def __init__(self, model: Transformer, max_seqs: int = 32, *, graphs: bool | None = None,
                 max_prefill_tokens: int | None = None, key_bucket: int | None = None,
                 lm_head_fp32: bool = False, mix: bool | None = None, pack: bool | None = None):
        self.model, self.cfg = model, model.cfg
        w = model.lm_head.weight
        self.device, self.dtype = w.device, w.dtype
        cuda = self.device.type == "cuda"
        self.max_seqs = max_seqs
        # weights that train (train.py's SDFT, under torch.distributed): capturing beside NCCL's
        # watchdog is fragile, each capture empties the allocator's cache, which training's memory
        # relies on, and packed copies go stale. Generation workers (engine/workers.py) sample from
        # frozen weights in a gloo group: graphs and packing stay
        training = any(p.requires_grad for p in model.parameters())
        if graphs is None:
            graphs = cuda and os.environ.get("OPR_ENGINE_GRAPHS", "1") != "0" and not training
        self.graphs = graphs
        self.mix = not cuda if mix is None else mix
        self.key_bucket = key_bucket or (256 if cuda else 1)
        self.max_prefill_tokens = max_prefill_tokens or (16384 if cuda else 4096)
        self.packs = packs(model) if pack is None else (pack_all(model) if pack else {})
        self.lm_head_fp32 = w.float() if lm_head_fp32 and w.dtype != torch.float32 else None
        self.inv_freq = rope_inv_freq(self.cfg, self.device)
        # on the CPU each token attends over its own slot's columns in one C call (kernels/cpu.c),
        # where the batched products read every row up to the longest's position (BENCHMARKS.md,
        # "Attention over each sequence's own cache span, in C")
        self.c_attention = cpu.runs_attention(self.device, self.dtype, self.cfg.num_attention_heads,
                                              self.cfg.num_key_value_heads, self.cfg.head_dim)
        self._graphs, self.K = {}, None

    # -- the model, as the engine runs it ----------------------------------------------------------
    def _run(self, ids, pos, attend, last=None):
        """The model's blocks over tokens ids [T] at positions pos [T], attention through `attend`
        -> the logits of the rows `last` (all when None) [len, V]."""
        x = self.model.model.embed_tokens(ids)[None]
        # [1, T, D], as the training model
        cos, sin = rope_cos_sin(self.inv_freq, pos[None], self.dtype)
        for layer in self.model.model.layers:
            # forward, not __call__: no FSDP hooks, no compiled block
            x = layer.forward(x, cos, sin, attend=attend)
        h = self.model.model.norm(x[0] if last is None else x[0, last])
        if self.lm_head_fp32 is not None:
            return F.linear(h.float(), self.lm_head_fp32)
        return self.model.lm_head(h)

    def _forward(self, ids, pos, slots, docs, copies, n_rows: int = 0, span: int = 0):
        """One packed forward of n_rows decode rows and then prefill documents -> the logits of each
        row and of each document's last token [n_rows + len(docs), V]; every token's keys and
        values are written into its slot. ids, pos, slots [T]: the tokens, their positions and
        slots. The first n_rows are the live sequences' last tokens (slots 0..n_rows-1), attending
        over cache columns [0, span) as decode_step's rows do. docs: per document (slot, start,
        end): its tokens are positions start..end-1 of its sequence; positions before `start` (a
        shared prefix) are in its slot, or get there through `copies` [(src slot, dst slot,
        columns)], made in order in each layer once that layer's new keys and values are written,
        so a prefix may come from a document of this same forward. Each document attends causally
        over its slot's columns. Attention takes one of two paths in every layer: _attend_c (the
        CPU's C kernel) or the torch one, _attend_rows for the rows and _attend_docs for the
        documents."""
        ctx = self._context(pos, slots, docs, copies, n_rows, span)

        def attend(i, q, k, v):
            self._write_cache(i, k, v, ctx)
            if self.c_attention:
                return self._attend_c(i, q, k, v, ctx)
            out = [self._attend_rows(i, q[:n_rows], ctx.row_mask)] if n_rows else []
            if docs:
                out.append(self._attend_docs(i, q[n_rows:], k[n_rows:], v[n_rows:], ctx))
            return torch.cat(out) if len(out) > 1 else out[0]
        last = torch.cat([torch.arange(n_rows, device=ids.device), n_rows + ctx.cu[1:].long() - 1])
        return self._run(ids, pos, attend, last)

    def _context(self, pos, slots, docs, copies, n_rows: int, span: int) -> "Context":
        """What every layer's attention needs in one _forward (see there), built once: the
        documents' lengths and cu_seqlens, and the index tensors and masks of the path this engine
        takes."""
        dev = pos.device
        lens = [e - b for _, b, e in docs]
        ctx = Context(slots, pos, copies, docs, lens,
                      torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32),
                      any(b > 0 for _, b, _ in docs))
        if self.c_attention:  # the rows and the documents with a prefix through the cache (C), the
            # others by one varlen call
            plain = torch.tensor([False] * n_rows + [not b for _, b, _ in docs], device=dev)
            plain = plain.repeat_interleave(torch.tensor([1] * n_rows + lens, device=dev))
            ctx.via_cache, ctx.own = (~plain).nonzero().squeeze(1), plain.nonzero().squeeze(1)
            ctx.own_lens = [n for n, (_, b, _) in zip(lens, docs) if not b]
            ctx.own_cu = torch.tensor([0] + ctx.own_lens, device=dev).cumsum(0).to(torch.int32)
            return ctx
        if ctx.cached:  # per document with a prefix, the mask by which new token j (position b + j)
            # sees columns 0..b+j; per document without one, its own cu_seqlens for the varlen call
            g = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
            ctx.masks = [(torch.arange(e, device=dev)[None, :]
                          <= torch.arange(b, e, device=dev)[:, None]).repeat(g, 1) if b else None
                         for _, b, e in docs]
            ctx.doc_cu = [None if b else torch.tensor([0, e], device=dev, dtype=torch.int32)
                          for _, b, e in docs]
        if n_rows:
            ctx.row_mask = _row_mask(pos[:n_rows], span, self.cfg.num_key_value_heads, self.dtype)
        return ctx

    def _write_cache(self, i, k, v, ctx):
        """Layer i's new keys and values k, v [T, Hkv, D] into their slots' columns, then the
        shared prefixes' copies, in order (a donor of this forward is written by then)."""
        self.k[i][ctx.slots, :, ctx.pos] = k
        self.v[i][ctx.slots, :, ctx.pos] = v
        for src, dst, n in ctx.copies:
            self.k[i][dst, :, :n] = self.k[i][src, :, :n]
            self.v[i][dst, :, :n] = self.v[i][src, :, :n]

    def _attend_c(self, i, q, k, v, ctx):
        """The CPU path of layer i's attention, q [T, Hq, D] -> [T, Hq * D]: the decode rows and the
        documents with a shared prefix attend over their slot's cache columns in C
        (cpu.cache_attention), the other documents causally among their own tokens in one varlen
        call."""
        if not ctx.own_lens:
            return cpu.cache_attention(q, self.k[i], self.v[i], ctx.slots, ctx.pos)
        if not ctx.via_cache.numel():
            return varlen_attention(q, k, v, ctx.cu, max(ctx.lens)).flatten(1)
        via, own = ctx.via_cache, ctx.own
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        out[via] = cpu.cache_attention(q[via], self.k[i], self.v[i], ctx.slots[via], ctx.pos[via])
        out[own] = varlen_attention(q[own], k[own], v[own], ctx.own_cu,
                                    max(ctx.own_lens)).flatten(1)
        return out

    def _attend_docs(self, i, q, k, v, ctx):
        """The torch path of layer i's attention for the prefill documents, q, k, v [T, H, D] of
        their tokens -> [T, Hq * D]: all in one varlen call when none has a shared prefix, else one
        call each (a document with a prefix by SDPA over its slot's columns 0..end-1)."""
        if not ctx.cached:
            return varlen_attention(q, k, v, ctx.cu, max(ctx.lens)).flatten(1)
        hkv = self.cfg.num_key_value_heads
        g = self.cfg.num_attention_heads // hkv
        out, at = [], 0
        for (slot, b, e), n, mask, cu_d in zip(ctx.docs, ctx.lens, ctx.masks, ctx.doc_cu):
            if not b:  # no prefix: causal among its own tokens, as in a forward without prefixes
                qd, kd, vd = q[at:at + n], k[at:at + n], v[at:at + n]
                out.append(varlen_attention(qd, kd, vd, cu_d, n).flatten(1))
                at += n
                continue
            # [n, Hq, D] -> [1, Hkv, G * n, D]: each kv head's G query heads as G * n queries
            # (as _attend_rows folds them)
            qd = q[at:at + n].view(n, hkv, g, -1).permute(1, 2, 0, 3).reshape(1, hkv, g * n, -1)
            kd, vd = self.k[i][slot:slot + 1, :, :e], self.v[i][slot:slot + 1, :, :e]
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)
            out.append(od.view(hkv, g, n, -1).permute(2, 0, 1, 3).reshape(n, -1))
            at += n
        return torch.cat(out) if len(out) > 1 else out[0]

    def _attend_rows(self, i, q, mask):
        """Layer i's attention of one new token in each slot 0..n-1 (q [n, Hq, D]) over the cache
        columns that mask [n, 1, 1, span] (_row_mask) lets it see."""
        n, span, hkv, d = q.shape[0], mask.shape[-1], self.cfg.num_key_value_heads, q.shape[-1]
        # the G query heads of each kv head as G queries of one head (q head h reads kv head
        # h // G, as enable_gqa does): a boolean mask with enable_gqa sends CUDA to the math
        # kernel, this shape does not
        qg = q.view(n, hkv, -1, d)
        k, v = self.k[i][:n, :, :span], self.v[i][:n, :, :span]
        if q.is_cuda:
            return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).reshape(n, -1)
        # the CPU: two batched products over the (row, kv head) pairs and a softmax between them,
        # faster than SDPA's flash kernel with a mask at a few queries per head (BENCHMARKS.md,
        # "Numerics versions", 12)
        scores = torch.baddbmm(mask, qg.flatten(0, 1), k.flatten(0, 1).transpose(1, 2),
                               alpha=d ** -0.5)
        return torch.bmm(torch.softmax(scores, -1), v.flatten(0, 1)).view(n, -1)

    def decode_step(self, tokens, pos, keys, counters, span: int, temperature: float):
        """One token for each of the first len(tokens) slots: tokens, pos, keys, counters [n]
        (int64, device); attention over cache columns [0, span). Returns (next tokens [n], their raw
        log-probs [n]). Static shapes, no host sync: compiles with fullgraph=True and is what the
        CUDA graphs capture."""
        n = tokens.shape[0]
        rows = torch.arange(n, device=tokens.device)
        mask = (None if self.c_attention
                else _row_mask(pos, span, self.cfg.num_key_value_heads, self.dtype))

        def attend(i, q, k, v):
            self.k[i][rows, :, pos] = k
            self.v[i][rows, :, pos] = v
            if self.c_attention:
                return cpu.cache_attention(q, self.k[i], self.v[i], rows, pos)
            return self._attend_rows(i, q, mask)
        return sample(self._run(tokens, pos, attend), temperature, keys, counters)

    def _round(self, n: int) -> int:
        """n up to a multiple of key_bucket (CUDA: spans repeat, so graphs and
        attention plans do)."""
        return -(-n // self.key_bucket) * self.key_bucket

    # -- CUDA graphs -------------------------------------------------------------------------------
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
            # warm-up off the capture: lazy initialisations happen here
            with torch.cuda.stream(stream):
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
        """The KV cache for sequences of up to `cols` tokens (and no CUDA graphs yet: they capture
        its addresses). It stays with the engine: the engine's next run() reuses it, and the graphs
        captured over it, when its sequences fit (engine.native.sample builds a new engine per call:
        see the module docstring)."""
        shape = (self.cfg.num_hidden_layers, self.max_seqs, self.cfg.num_key_value_heads, cols,
                 self.cfg.head_dim)
        # zeros, not empty: a masked column still enters attention's weighted sum
        # (0 * NaN would be NaN)
        self.K = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.V = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.k, self.v = list(self.K.unbind(0)), list(self.V.unbind(0))
        self._graphs, self._pool = {}, torch.cuda.graph_pool_handle() if self.graphs else None

    # -- generation: the scheduler's batches, run --------------------------------------------------
    @torch.inference_mode()
    def run(self, prompts: list[list[int]], *, temperature: float = 0.1,
            max_new_tokens: int | list = 512, stop_ids=(), seed: int = 0,
            seeds: list[int] | None = None, progress: bool = True) -> list[dict]:
        """One response per prompt (token id lists), in the input order. See the module docstring.
        max_new_tokens: one cap for all, or one per prompt
        (tasks of one call may need 4 tokens or 512)."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        caps = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
                else list(max_new_tokens))
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
        seqs = [Sequence(i, p, c, k)
                for i, (p, c, k) in enumerate(zip(prompts, caps,
                                                  row_keys(len(prompts), seed, seeds)))]
        cols = self._round(max(len(p) + c for p, c in zip(prompts, caps)))
        # else the cache (and the graphs that read it) serve again
        if self.K is None or self.K.shape[3] < cols:
            self.allocate(cols)
        sched = Scheduler(seqs, self.max_seqs, self.max_prefill_tokens, self.mix)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(prompts), unit="prompt", desc="generate", dynamic_ncols=True)
        t0, n_new = time.perf_counter(), 0
        with packed_products(self.packs):
            while (batch := sched.schedule()) is not None:
                tokens, logprobs = self._step(batch, temperature)  # the step's one host sync
                for src, dst, n_cols in sched.postprocess(batch, tokens, logprobs, stop):
                    for t in (self.K, self.V):  # every layer in one copy
                        t[:, dst, :, :n_cols] = t[:, src, :, :n_cols]
                n_new += len(tokens)
                done = sum(s.finish is not None for s in batch.seqs)
                if bar is not None and done:
                    bar.update(done)
                    bar.set_postfix(tok_s=f"{n_new / (time.perf_counter() - t0):.1f}",
                                    live=len(sched.live))
        if bar is not None:
            bar.close()
        return [{"token_ids": s.tokens, "logprobs": s.logprobs, "finish_reason": s.finish}
                for s in seqs]

    def _step(self, batch, temperature: float) -> tuple[list, list]:
        """Run one batch of the scheduler's -> (a new token for each of batch.seqs,
        its raw log-prob)."""
        dev = dict(device=self.device, dtype=torch.long)
        seqs = batch.seqs
        if isinstance(batch, Decode):
            n = len(seqs)
            pos = [s.pos for s in seqs]
            # pad rows write into free slots, which a prefill overwrites
            pad = [0] * (self._bucket(n) - n)
            tokens, logprobs = self._decode(
                torch.tensor([s.tokens[-1] for s in seqs] + pad, **dev),
                torch.tensor(pos + pad, **dev),
                torch.tensor([s.key for s in seqs] + pad, **dev),
                torch.tensor([len(s.tokens) for s in seqs] + pad, **dev),
                self._round(max(pos) + 1), temperature)
            return tokens[:n].tolist(), logprobs[:n].tolist()
        # a prefill, with the live rows' decode step riding along
        rows, docs = batch.rows, batch.docs
        ids = ([s.tokens[-1] for s in rows]
               + [t for s, (_, b, _) in zip(batch.take, docs) for t in s.prompt[b:]])
        pos = [s.pos for s in rows] + [q for _, b, e in docs for q in range(b, e)]
        slots = list(range(len(rows))) + [slot for slot, b, e in docs for _ in range(e - b)]
        logits = self._forward(torch.tensor(ids, **dev), torch.tensor(pos, **dev),
                               torch.tensor(slots, **dev), docs, batch.copies, len(rows),
                               self._round(max(pos[:len(rows)], default=0) + 1))
        tokens, logprobs = sample(logits, temperature, torch.tensor([s.key for s in seqs], **dev),
                                  # the index in its response
                                  torch.tensor([len(s.tokens) for s in seqs], **dev))
        return tokens.tolist(), logprobs.tolist()


def _row_mask(pos, span: int, hkv: int = 1, dtype=torch.float32):
    """Row i (at position pos[i]) sees cache columns 0..pos[i]: on CUDA a boolean mask
    [n, 1, 1, span]; on the CPU one to add to the scores (the cache's dtype), 0 or -inf,
    [n * hkv, 1, span] (a row's for each of its kv heads)."""
    seen = torch.arange(span, device=pos.device)[None, :] <= pos[:, None]
    if pos.is_cuda:
        return seen[:, None, None, :]
    add = torch.zeros(seen.shape, device=pos.device, dtype=dtype).masked_fill_(~seen, float("-inf"))
    return add.repeat_interleave(hkv, 0)[:, None, :]
