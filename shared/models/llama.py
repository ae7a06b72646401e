"""One decoder-only implementation for Llama 2/3/3.1, Mistral, Qwen2/2.5 and Qwen3; ModelConfig flags
select the differences (qkv bias, q/k norm, rope scaling, tied embeddings).

Tokens of all requests arrive packed along one axis; the attention backend owns the paged KV pool and
the per-request causal structure, so every other op here is a plain row-wise op over [T, ...].
Module names follow the HF checkpoint except the fused qkv_proj and gate_up_proj.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from kernels.residual_norm import NORM_SLOTS, ResidualNorm
from kernels.rope_store import RopeStore
from shared.models.forward_batch import ForwardBatch, ForwardMode
from shared.models.config import ModelConfig
from shared.models.layers import Embedding, Linear, MergedLinear, RMSNorm, rms_norm
from shared.models.parallel import (all_gather_last, even_shard, head_shard, kv_shard, local_heads, local_kv_heads,
                                    tp_size)
from shared.models.quantization import is_fp8
from shared.models.rope import RotaryEmbedding
from shared.models.weight_prefetch import WeightPrefetcher


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = cfg.head_dim
        # This rank's heads (all of them without tensor parallelism; kv heads may be replicated).
        self.q_size = local_heads(cfg.num_attention_heads) * cfg.head_dim
        self.kv_size = local_kv_heads(cfg.num_key_value_heads) * cfg.head_dim
        q, kv = head_shard(cfg.num_attention_heads, cfg.head_dim), kv_shard(cfg.num_key_value_heads, cfg.head_dim)
        self.qkv_proj = MergedLinear(cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size],
                                     ["q_proj", "k_proj", "v_proj"], bias=cfg.attention_bias,
                                     shards=[q, kv, kv])
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias, parallel="row")
        self.eps = cfg.rms_norm_eps
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, hidden: torch.Tensor, rotary: RotaryEmbedding, fb: ForwardBatch,
                norm_in: ResidualNorm | None = None, add_norm: ResidualNorm | None = None,
                prefetch: WeightPrefetcher | None = None, fuse_rope: bool = False) -> torch.Tensor:
        """norm_in / add_norm: the split residual norms before qkv_proj and after o_proj (LlamaModel._forward_row).
        prefetch: o_proj's weight is asked into L2 beside rope and attention (shared/models/weight_prefetch.py).
        fuse_rope: a decode pass; rope and the KV store run in qkv_proj's epilogue (kernels/rope_store.py) instead
        of the backend's rope + KV-store kernel (LlamaModel.fuse_row_rope and _rope_in_qkv say where it applies;
        several rows only where the GEMV takes them)."""
        rope = None
        if fuse_rope and hidden.shape[0] > 1:  # several rows: only where the GEMV takes them
            fuse_rope = ops.gemv_applies(hidden, self.qkv_proj.weight, self.qkv_proj.weight_scale)
        if fuse_rope:
            k_buf, v_buf = fb.kv_pool.get_kv(self.layer_id)
            # The epilogue converts to an FP8 pool at unit scales only (ModelRunner turns the fusion off otherwise).
            assert k_buf.element_size() > 1 or fb.kv_pool.scales[self.layer_id] == (1.0, 1.0)
            rope = RopeStore(fb.positions, rotary.cos_sin_cache, k_buf, v_buf, fb.out_cache_loc, self.q_size,
                             self.kv_size, self.head_dim)
        q, k, v = self.qkv_proj(hidden, norm_in=norm_in, rope=rope).split([self.q_size, self.kv_size, self.kv_size],
                                                                         dim=-1)
        if prefetch is not None:
            prefetch.prefetch(self.o_proj.weight)
        if self.q_norm is not None:
            q = self._per_head_norm(q, self.q_norm)
            k = self._per_head_norm(k, self.k_norm)
        # Rope is applied by the backend, fused with the KV store (or was, in qkv_proj's epilogue).
        o = fb.attn_backend.forward(q, k, v, self.layer_id, fb, rotary=None if fuse_rope else rotary,
                                    stored=fuse_rope)
        return self.o_proj(o, add_norm=add_norm)

    def _per_head_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        T = x.shape[0]
        return rms_norm(x.reshape(-1, self.head_dim), norm.weight, self.eps).view(T, -1)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                         ["gate_proj", "up_proj"], bias=cfg.mlp_bias,
                                         shards=[even_shard(cfg.intermediate_size)] * 2)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, parallel="row")

    def forward(self, x: torch.Tensor, norm_in: ResidualNorm | None = None,
                add_norm: ResidualNorm | None = None) -> torch.Tensor:
        w = self.gate_up_proj.weight
        fp8 = is_fp8(w)
        # The MLP gated in gate_up_proj's GEMV epilogue (kernels.gemv gated_out: down_proj then reads I values, not
        # 2I with silu(gate) * up computed in its load; the same bits) where that measured faster (docs/kernels.md):
        # one bf16 row, two bf16 rows on the GEMV's one-row kernel, and FP8 rows past one where the GEMV takes them.
        if x.shape[0] == 1:
            gated = not fp8
        else:
            scale = self.gate_up_proj.weight_scale
            gated = ops.gemv_applies(x, w, scale) if fp8 else ops.two_row_gating_applies(x, w, scale)
        if gated:  # silu_and_mul in its epilogue
            return self.down_proj(self.gate_up_proj(x, norm_in=norm_in, gated_out=True), add_norm=add_norm)
        # silu_and_mul inside the down projection
        return self.down_proj(self.gate_up_proj(x, norm_in=norm_in), gated=True, add_norm=add_norm)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryEmbedding,
                fb: ForwardBatch, prefetch: WeightPrefetcher | None = None,
                fuse_rope: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each add fuses into the following norm.
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, fb, prefetch=prefetch, fuse_rope=fuse_rope)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, parallel=True)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                          cfg.rope_scaling)
        self.cfg = cfg
        # Set by split_row_norms: the partial sums of the split norms of a one-token pass, and of a two-token one
        # (on the GEMV's one-row kernel).
        self.row_norm_sums: torch.Tensor | None = None
        self.row2_norm_sums: torch.Tensor | None = None
        # One-token passes ask each layer's o_proj weight into L2 beside rope and attention (the engine's
        # --decode-l2-prefetch sets it).
        self.row_prefetcher: WeightPrefetcher | None = None
        # Set by fuse_row_rope: one-token decode passes run rope and the KV store in qkv_proj's epilogue.
        self.row_rope = False

    def fuse_row_rope(self, enabled: bool) -> bool:
        """One-token decode passes rotate q and k and store k, v in the qkv GEMV's epilogue instead of a rope +
        KV-store kernel a layer (kernels/rope_store.py). Not with q/k norms (they come between), a qkv bias
        (added after the GEMV), partial rotary, tensor parallelism or FP8 qkv weights (the FP8 GEMV with the
        epilogue lost more than the kernel it saves: docs/kernels.md). Returns whether it is on."""
        cfg = self.cfg
        fp8 = is_fp8(self.layers[0].self_attn.qkv_proj.weight) if self.layers else False
        self.row_rope = bool(enabled and not cfg.qk_norm and not cfg.attention_bias and tp_size() == 1
                             and not fp8
                             and self.rotary_emb.cos_sin_cache.shape[1] == cfg.head_dim)
        return self.row_rope

    def split_row_norms(self, enabled: bool) -> bool:
        """One-token passes (decode at batch 1) split every residual norm after the first between the GEMVs
        around it (_forward_row). Not where a producer GEMV has a bias or is row-parallel. Returns whether
        it is on."""
        cfg = self.cfg
        ok = enabled and not cfg.o_proj_bias and not cfg.mlp_bias and tp_size() == 1
        self.row_norm_sums = self.row2_norm_sums = None
        if ok:  # one row of partial sums a split norm, the final norm's last (forward_split_final); two for two rows
            dev, n = self.norm.weight.device, 2 * len(self.layers)
            self.row_norm_sums = torch.zeros(n, NORM_SLOTS, dtype=torch.float64, device=dev)
            self.row2_norm_sums = torch.zeros(n, 2, NORM_SLOTS, dtype=torch.float64, device=dev)
        return ok

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        if self.row_norm_sums is not None and (fb.input_ids.shape[0] == 1 or self._two_row_norms(fb)):
            return self._forward_row(fb)
        hidden, residual = self.embed_tokens(fb.input_ids), None
        prefetch = self.row_prefetcher if hidden.shape[0] == 1 else None
        fuse_rope = self._rope_in_qkv(fb)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, self.rotary_emb, fb, prefetch=prefetch, fuse_rope=fuse_rope)
        hidden, _ = self.norm(hidden, residual)
        if prefetch is not None:
            prefetch.join()
        return hidden

    def _rope_in_qkv(self, fb: ForwardBatch) -> bool:
        """Whether this pass runs rope and the KV store in qkv_proj's epilogue: a decode pass of rows the GEMV takes
        (LlamaAttention checks; an extend pass's attention reads the new k and v as the backend's rope kernel lays
        them out)."""
        return self.row_rope and fb.mode == ForwardMode.DECODE

    def _two_row_norms(self, fb: ForwardBatch) -> bool:
        """A two-token pass whose GEMVs all take both rows on their two-row kernel with the split norms
        (kernels.ops.two_row_norms_apply, asked of the first layer's linears with a [2, H] activation of the model's
        dtype): it runs down the one-token path, its norms split as one row's are."""
        if fb.input_ids.shape[0] != 2 or not self.layers:
            return False
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return ops.two_row_norms_apply(self.embed_tokens.weight[:2], [(m.weight, m.weight_scale) for m in linears])

    def forward_split_final(self, fb: ForwardBatch) -> tuple[torch.Tensor, ResidualNorm] | None:
        """A one-token pass with split norms whose final norm is split too: (gamma * residual, the norm) for a
        consumer GEMV (the lm_head: LlamaForCausalLM.forward_logits) to scale; None where the pass is not a
        split one-token pass (the caller runs forward)."""
        if self.row_norm_sums is None or fb.input_ids.shape[0] != 1:
            return None
        return self._forward_row(fb, split_final=True)

    def _forward_row(self, fb: ForwardBatch, split_final: bool = False):
        """One token (or two, each with its own partial sums: _two_row_norms). The embedding lookup and the first
        norm run as one kernel (it also clears the partial
        sums; the embedding is not sharded here: split norms are off under tensor parallelism); every later
        residual add + RMSNorm is split between the GEMV that produces the residual's update (o_proj,
        down_proj) and the one that consumes the norm (gate_up_proj, the next qkv_proj): kernels/residual_norm.py.
        The final norm runs as its own kernel again, or with split_final is split as well: the last down_proj
        produces it and (gamma * residual, the norm) is returned for the lm_head to consume."""
        sums = self.row_norm_sums if fb.input_ids.shape[0] == 1 else self.row2_norm_sums
        eps, layers = self.cfg.rms_norm_eps, self.layers
        x, residual = ops.embed_rms_norm(fb.input_ids, self.embed_tokens.weight, layers[0].input_layernorm.weight, eps,
                                         zero=sums)
        norm_in = None
        fuse_rope = self._rope_in_qkv(fb)
        for i, layer in enumerate(layers):
            post = ResidualNorm(residual, layer.post_attention_layernorm.weight, sums[2 * i], eps)
            x = layer.self_attn(x, self.rotary_emb, fb, norm_in=norm_in, add_norm=post, prefetch=self.row_prefetcher,
                                fuse_rope=fuse_rope)
            gamma = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else self.norm.weight
            norm_in = (ResidualNorm(residual, gamma, sums[2 * i + 1], eps)
                       if i + 1 < len(layers) or split_final else None)
            x = layer.mlp(x, norm_in=post, add_norm=norm_in)
        if self.row_prefetcher is not None:
            self.row_prefetcher.join()
        if split_final:
            return x, norm_in
        hidden, _ = self.norm(x, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Build under `torch.device(...)` and a default dtype (see loader.build_empty_model); weights are
    uninitialized until loaded.

    forward(fb) -> final hidden states [T, hidden_size] for every packed token; the caller picks the rows
    it needs and passes them to compute_logits. The caller also runs
    fb.attn_backend.init_forward_metadata(fb) before forward (outside any CUDA graph).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head = Embedding(cfg.vocab_size, cfg.hidden_size, parallel=True)
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, parallel="vocab")

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb)

    def forward_logits(self, fb: ForwardBatch, out: torch.Tensor) -> torch.Tensor:
        """compute_logits(forward(fb), out) for every token of the pass (the CUDA-graph runner's decode step).
        A one-token pass with split norms splits the final norm as well: the last
        down_proj produces it and the lm_head GEMV consumes it, writing the logits straight from its sums (one
        norm kernel fewer; cuBLAS's lm_head would not chain under PDL)."""
        if self.lm_head.shard is None and self.lm_head.weight.shape[0] == out.shape[1]:
            split = self.model.forward_split_final(fb)
            if split is not None:
                return ops.linear(split[0], self.lm_head.weight, norm_in=split[1], out=out)
        return self.compute_logits(self.model(fb), out=out)

    @property
    def logits_dtype(self) -> torch.dtype:
        """The dtype the lm_head's GEMM produces logits in (the model's activation dtype)."""
        return self.lm_head.weight.dtype

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, hidden_size] -> logits [N, vocab_size], the same on every rank: fp32 when out is None
        (a fresh result), else written to out, [N, vocab_size] of any float dtype. An out of logits_dtype takes
        the GEMM's result directly (the CUDA-graph runner's buffer: no widening copy, which at batch 256 and a
        128k vocabulary moved ~200 MB a step; the sampler widens only where it needs fp32)."""
        if out is not None and out.dtype == self.logits_dtype and self.lm_head.shard is None \
                and hidden.dtype == out.dtype and out.shape[1] == self.lm_head.weight.shape[0]:
            if (logits := ops.gemv_into(hidden, self.lm_head.weight, out)) is not None:  # decode rows on the GEMV
                return logits
            return torch.mm(hidden, self.lm_head.weight.t(), out=out)
        logits = torch.nn.functional.linear(hidden, self.lm_head.weight)
        if self.lm_head.shard is not None:
            logits = all_gather_last(logits)
            logits = logits[:, :self.config.vocab_size]
        if out is None:
            return logits.float().contiguous()
        return out.copy_(logits)
