"""Training of the reference models: Llama-architecture causal LMs (transformers' module, trained by a plain torch
loop: bf16 autocast on a GPU, AdamW, warm-up then cosine learning rate, packed windows of the token stream), their
held-out loss, and their Hugging Face checkpoint.

The step count fits a time budget: the first steps are timed and the rest of the schedule is laid out from their
rate, so a run on another card trains as long, not as far. `steps` fixes it instead (the manifest records the count
each run chose, to reproduce it).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

# Model shapes: (hidden, layers, heads, kv heads, intermediate). Head dim 64, two query heads a KV head (the attention
# kernels' tiles hold a power-of-two group whole).
TARGET_LADDER = {
    "300m": (1024, 22, 16, 8, 2816),
    "150m": (768, 16, 12, 6, 2048),
    "80m": (640, 10, 10, 5, 1792),
}
DRAFT_SHAPE = (512, 4, 8, 4, 1024)
TINY_TARGET = (64, 2, 4, 2, 128)
TINY_DRAFT = (64, 1, 4, 2, 128)  # the tiny target's width (the GPU kernels' smallest tested shapes)


@dataclass
class TrainSpec:
    shape: tuple
    seq_len: int
    batch: int  # windows a step
    lr: float
    minutes: float
    steps: int = 0  # 0: from the budget
    warmup: int = 50
    seed: int = 0
    compile: bool = False


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def hf_config(shape: tuple, vocab_size: int, max_positions: int, bos_id: int, eos_ids: list[int]):
    from transformers import LlamaConfig

    h, layers, heads, kv, inter = shape
    return LlamaConfig(vocab_size=vocab_size, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=h // heads,
                       max_position_embeddings=max_positions, rope_theta=10000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, bos_token_id=bos_id, eos_token_id=eos_ids,
                       pad_token_id=eos_ids[0], initializer_range=0.02, attention_bias=False, mlp_bias=False)


def build_model(config, seed: int, device: str):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.float32)
    return model


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


class Windows:
    """Random windows of seq_len + 1 tokens of one token stream, drawn from a seeded generator."""

    def __init__(self, stream: np.ndarray, seq_len: int, seed: int):
        self.stream, self.seq_len = stream, seq_len
        self.rng = np.random.default_rng(seed)

    def batch(self, n: int, device: str) -> torch.Tensor:
        starts = self.rng.integers(0, len(self.stream) - self.seq_len - 1, size=n)
        rows = np.stack([self.stream[s:s + self.seq_len + 1] for s in starts]).astype(np.int64)
        return torch.from_numpy(rows).to(device, non_blocking=True)


def lr_at(step: int, total: int, spec: TrainSpec) -> float:
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    frac = min(1.0, (step - spec.warmup) / max(1, total - spec.warmup))
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _loss(model, rows: torch.Tensor, device: str) -> torch.Tensor:
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(input_ids=rows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())


def measure_step_s(model, data: Windows, spec: TrainSpec, device: str, steps: int = 4) -> float:
    """Seconds a training step (forward, backward, no update) after one warm-up step; nothing is learned."""
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        _loss(model, data.batch(spec.batch, device), device).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return float(np.median(times[1:]))


def train(model, data: Windows, spec: TrainSpec, device: str, name: str) -> dict:
    """Train in place; the step count from spec.steps or the budget (the rate of the steps before warm-up ends)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, fused=device == "cuda")
    step_fn = torch.compile(lambda rows: _loss(model, rows, device)) if spec.compile else \
        (lambda rows: _loss(model, rows, device))
    total = spec.steps or 10 ** 9
    budget = spec.minutes * 60
    t0 = time.perf_counter()
    t_mark, mark = t0, 0
    losses = []
    step = skipped = 0
    while step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, spec)
        loss = step_fn(data.batch(spec.batch, device))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        # One non-finite gradient would make every weight NaN (clipping multiplies inf by 0): that batch's update
        # is skipped instead. The check waits for the step's kernels; the next step's launches then overlap its
        # start only.
        if bool(torch.isfinite(norm)):
            opt.step()
        else:
            skipped += 1
            if skipped <= 3:
                log(f"{name}: step {step + 1}: gradient norm {float(norm)}, loss {float(loss.detach())}; skipped")
            if skipped > max(10, total // 100 if total < 10 ** 9 else 10):
                raise RuntimeError(f"{name}: {skipped} steps had non-finite gradients; lower the learning rate")
        opt.zero_grad(set_to_none=True)
        step += 1
        if step == 3:  # compile and allocator warm-up behind: time from here
            if device == "cuda":
                torch.cuda.synchronize()
            t_mark, mark = time.perf_counter(), step
        if not spec.steps and step == min(spec.warmup, 20) + 3:
            if device == "cuda":
                torch.cuda.synchronize()
            rate = (step - mark) / (time.perf_counter() - t_mark)
            total = max(step + 1, int(step + (budget - (time.perf_counter() - t0)) * rate))
            log(f"{name}: {rate:.2f} steps/s, {rate * spec.batch * spec.seq_len:,.0f} tokens/s: {total} steps "
                f"in {spec.minutes:.1f} min")
        if step % 50 == 0 or step == total:
            losses.append((step, float(loss.detach())))
            log(f"{name}: step {step}/{total if total < 10 ** 9 else '?'} loss {float(loss.detach()):.3f} "
                f"({time.perf_counter() - t0:.0f}s)")
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if skipped:
        log(f"{name}: {skipped} of {step} steps skipped (non-finite gradients)")
    return {"steps": step, "train_s": wall, "tokens": step * spec.batch * spec.seq_len, "losses": losses,
            "skipped_steps": skipped, "spec": asdict(spec)}


@torch.no_grad()
def heldout_loss(model, stream: np.ndarray, seq_len: int, windows: int, device: str) -> float:
    """Mean next-token cross-entropy (nats) over the first `windows` consecutive windows of the held-out stream."""
    model.eval()
    n = min(windows, (len(stream) - 1) // seq_len)
    total, count = 0.0, 0
    for i in range(0, n, 8):
        rows = np.stack([stream[j * seq_len:(j + 1) * seq_len + 1] for j in range(i, min(n, i + 8))])
        rows = torch.from_numpy(rows.astype(np.int64)).to(device)
        loss = _loss(model, rows, device)
        total += float(loss) * rows.shape[0]
        count += rows.shape[0]
    model.train()
    return total / max(1, count)


def heldout_windows(stream: np.ndarray, seq_len: int, windows: int) -> list[list[int]]:
    """The windows heldout_loss reads, as token lists (the engine's loss reads the same)."""
    n = min(windows, (len(stream) - 1) // seq_len)
    return [stream[j * seq_len:(j + 1) * seq_len + 1].tolist() for j in range(n)]


def save_checkpoint(model, path: str, eos_ids: list[int], bos_id: int) -> None:
    """model.safetensors (bf16), config.json, generation_config.json."""
    from transformers import GenerationConfig

    os.makedirs(path, exist_ok=True)
    model.config.torch_dtype = torch.bfloat16
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_ids, pad_token_id=eos_ids[0], do_sample=False,
                     max_new_tokens=256).save_pretrained(path)
