"""Helpers for model tests: tiny random HF checkpoints written by `transformers` itself, and a minimal
paged-KV harness (consecutive slot allocation) to run our model through the real attention path."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from shared.models.attention.torch_backend import TorchAttentionBackend
from shared.cache.kv_pool import KVPool, ReqToTokenPool
from shared.models.forward_batch import ForwardBatch, ForwardMode
from shared.models.config import ModelConfig
from shared.tokenizer import save_tiny_tokenizer

_SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, initializer_range=0.1)

# family -> (HF config class name, overrides of _SMALL). Rope scalings use a short original context so
# that every frequency band they treat differently actually rotates within the test prompts.
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama31": ("LlamaConfig", dict(rope_theta=10000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "llama2": ("LlamaConfig", dict(num_key_value_heads=4, rms_norm_eps=1e-5)),
    "llama_bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True,
                                       rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral": ("MistralConfig", dict(head_dim=32, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=1, rope_theta=1000000.0)),
    "qwen2_yarn": ("Qwen2Config", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64})),
    "qwen3": ("Qwen3Config", dict(head_dim=32, attention_bias=False)),
    "tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
}


def make_hf_model(family: str, seed: int = 0):
    """A float32 HF model of the family with random weights, including norms and biases (which HF
    initializes to ones/zeros and would otherwise leave untested)."""
    import transformers

    cls_name, overrides = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**_SMALL, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        # Peakier logits: greedy ties between near-equal candidates would make the decode test fragile.
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = None  # greedy runs must not stop early
    model.generation_config.pad_token_id = 0
    return model


def write_hf_checkpoint(model, path: str, max_shard_size: str | None = None) -> str:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    save_tiny_tokenizer(path)
    return path


# ------------------------------------------------------------------ paged harness
@dataclass
class PagedHarness:
    """Runs a model over the real KV pool with slots handed out consecutively (page size 1)."""

    model: torch.nn.Module
    cfg: ModelConfig
    max_tokens: int = 2048
    max_reqs: int = 16
    next_slot: int = 1  # slot 0 is the pool's reserved padding slot
    rows: dict[int, int] = field(default_factory=dict)  # request key -> req_to_token row
    lens: dict[int, int] = field(default_factory=dict)  # request key -> tokens in the pool
    backend: object = None  # an AttentionBackend; the torch reference when None

    def __post_init__(self):
        dtype = next(self.model.parameters()).dtype
        device = next(self.model.parameters()).device
        self.device = device
        self.kv = KVPool(self.cfg.num_hidden_layers, self.cfg.num_key_value_heads, self.cfg.head_dim,
                         num_pages=self.max_tokens, page_size=1, dtype=dtype, device=device)
        self.req_pool = ReqToTokenPool(self.max_reqs, self.cfg.context_length, device)
        self.backend = self.backend or TorchAttentionBackend(self.cfg.num_attention_heads, self.cfg.num_key_value_heads,
                                             self.cfg.head_dim)

    def _alloc(self, n: int) -> torch.Tensor:
        slots = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int64)
        self.next_slot += n
        return slots

    def step(self, mode: ForwardMode, batch: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Append batch[key] (new token ids) to each request's context in one forward pass.
        Returns each request's fp32 logits for its new tokens."""
        keys = list(batch)
        rows, prefix, ext, ids, locs = [], [], [], [], []
        for key in keys:
            if key not in self.rows:
                self.rows[key], self.lens[key] = self.req_pool.alloc(), 0
            new = batch[key]
            slots = self._alloc(len(new))
            self.req_pool.write(self.rows[key], self.lens[key], slots)
            rows.append(self.rows[key])
            prefix.append(self.lens[key])
            ext.append(len(new))
            ids += new
            locs.append(slots)
            self.lens[key] += len(new)
        fb = ForwardBatch.build(mode, ids, rows, prefix, ext, torch.cat(locs), self.req_pool.req_to_token,
                                self.kv, self.backend, self.device)
        with torch.inference_mode():
            self.backend.init_forward_metadata(fb)
            # As the CUDA-graph runner runs a decode step (forward_logits: compute_logits(forward) unless the
            # final norm is folded into the lm_head), into a buffer of the lm_head's dtype.
            out = torch.empty(len(ids), self.cfg.vocab_size, dtype=self.model.logits_dtype, device=self.device)
            logits = self.model.forward_logits(fb, out=out).float()
        return dict(zip(keys, logits.split(ext)))


def paged_greedy(model, cfg: ModelConfig, prompts: list[list[int]], steps: int,
                 backend=None) -> list[list[int]]:
    """Batched greedy: one EXTEND over all prompts, then `steps` DECODE passes. Returns 1 + steps
    tokens per prompt."""
    h = PagedHarness(model, cfg, backend=backend)
    logits = h.step(ForwardMode.EXTEND, dict(enumerate(prompts)))
    out = {k: [int(v[-1].argmax())] for k, v in logits.items()}
    for _ in range(steps):
        logits = h.step(ForwardMode.DECODE, {k: toks[-1:] for k, toks in out.items()})
        for k, v in logits.items():
            out[k].append(int(v[-1].argmax()))
    return [out[k] for k in range(len(prompts))]


def checkpoint_dir(tmp_root: str, name: str) -> str:
    path = os.path.join(tmp_root, name)
    os.makedirs(path, exist_ok=True)
    return path
