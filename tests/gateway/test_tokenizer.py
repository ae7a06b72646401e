"""Tokenizer loading, chat templates and incremental detokenization."""
from __future__ import annotations

import random

import pytest

from shared.engine.detokenizer import Detokenizer
from shared.tokenizer import Tokenizer, build_tiny_hf_tokenizer, save_tiny_tokenizer

TEXT = "Hello, world! Ünïcödé: 日本語テキスト, emoji 🎉 and more text. STOP here."


@pytest.fixture(scope="module")
def tk():
    return Tokenizer.load("tiny-random")


def test_round_trip_and_disk_equivalence(tk, tmp_path):
    ids = tk.encode(TEXT)
    assert tk.decode(ids) == TEXT
    save_tiny_tokenizer(str(tmp_path))
    assert Tokenizer.load(str(tmp_path)).encode(TEXT) == ids


def test_chat_template_and_strftime_now(tk):
    out = tk.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    t = Tokenizer(raw=build_tiny_hf_tokenizer(), eos_token="<|im_end|>",
                  chat_template="{{ strftime_now('%Y') }}|{% for m in messages %}{{ m['content'] }}{% endfor %}")
    year, text = t.apply_chat_template([{"role": "user", "content": "hi"}]).split("|")
    assert year.isdigit() and text == "hi"


def test_template_sandbox_refuses_attribute_escapes(tk):
    evil = Tokenizer(raw=build_tiny_hf_tokenizer(), eos_token="<|im_end|>",
                     chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Exception):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("seed", range(5))
def test_incremental_decoding_equals_full_decode(tk, seed):
    """Token by token, or in random chunks, the emitted text is exactly the full decode (multi-byte
    characters split across tokens never show as replacement characters mid-stream)."""
    d = Detokenizer(tk)
    ids = tk.encode(TEXT)
    rng = random.Random(seed)
    st = d.new_state([], prompt_tail=tk.encode("Prompt: "))
    out, i = "", 0
    while i < len(ids):
        n = rng.randint(1, 3)
        text, _ = d.add_tokens(st, ids[i:i + n])
        assert "\ufffd" not in text
        out += text
        i += n
    out += d.flush(st)
    assert out == TEXT


def test_stop_string_is_held_back_then_trimmed(tk):
    d = Detokenizer(tk)
    st = d.new_state(["STOP"])
    seen = ""
    for t in tk.encode(TEXT):
        text, hit = d.add_tokens(st, [t])
        seen += text
        assert "STOP" not in seen and "STO" not in seen[-3:] or hit
        if hit:
            break
    assert seen == TEXT[:TEXT.index("STOP")]
    assert d.final_text(st) == TEXT[:TEXT.index("STOP")]


def test_reset_output_after_rewritten_tail(tk):
    d = Detokenizer(tk)
    st = d.new_state([])
    first = tk.encode("{\"na")
    text, _ = d.add_tokens(st, first)
    rewritten = tk.encode("{\"name\": \"")
    more, _ = d.reset_output(st, rewritten)
    assert text + more == "{\"name\": \""


@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_reset_output_decoding_past_its_anchor_equals_decoding_all_of_it(tk, seed, skip_special):
    """A byte-level tokenizer's reset_output decodes only the output past its last whole-character point;
    along jump-like rewrites (sampled tokens, then the last one replaced by a longer run; multi-byte
    characters split across tokens, special tokens, prompt tails ending mid-character) every step
    returns what decoding the whole output returns."""
    d, ref = Detokenizer(tk), Detokenizer(tk)
    assert d._bytewise
    ref._bytewise = False  # the whole output decoded at every reset
    rng = random.Random(seed)
    ids = tk.encode(TEXT, add_special_tokens=False)
    byte_ids = [i for i in range(3, tk.vocab_size) if len(tk.raw.decode([i]).encode()) == 1]
    pool = ids + [0, 1, 2] + rng.sample(byte_ids, 20)  # whole tokens, specials, lone bytes
    prompt = tk.encode("Prompt ü", add_special_tokens=False)
    if seed % 2:
        prompt = prompt + [t for t in tk.encode("日", add_special_tokens=False)][:1]  # ends mid-character
    st, st_ref = (x.new_state([], skip_special_tokens=skip_special, prompt_tail=prompt) for x in (d, ref))
    out: list[int] = []
    for step in range(60):
        if out and rng.random() < 0.6:  # a jump: the last token rewritten, a forced run appended
            rewrite = len(out) if rng.random() < 0.05 else rng.randint(0, 1)  # rarely: all of it
            del out[len(out) - rewrite:]
            out += [rng.choice(pool) for _ in range(rng.randint(1, 6))]
            got, want = d.reset_output(st, out), ref.reset_output(st_ref, out)
        else:  # a sampled token
            t = rng.choice(pool)
            out.append(t)
            got, want = d.add_tokens(st, [t]), ref.add_tokens(st_ref, [t])
        assert got == want, step
        assert st.text == st_ref.text
    assert d.flush(st) == ref.flush(st_ref)
