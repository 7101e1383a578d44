"""A tiny Qwen2-shaped model with a character tokenizer, made locally (no downloads).

The tokenizer is byte level with no merges: token id == byte value for every byte (so every
ASCII character is one token), then three special tokens for the chat template. It is a real
`tokenizers` BPE with a ByteLevel pre-tokenizer, the shape Qwen2's tokenizer class expects,
so vLLM, transformers and the trainer all tokenize and decode it identically.

The model: hidden 128, 2 layers, 2 attention heads of dimension 64 (vLLM's CPU attention needs
32, 64, 80, ...), 1 KV head, float32, weights from a fixed seed. The output head is not tied to
the input embedding: vLLM-CPU prepacks the head's weights, and `reload_weights` does not refresh a
tied head, so a reloaded tied model would serve new embeddings with the old head.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentstream.stack.chat_template import tool_chat_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

UNLISTED: dict[str, Any] = {"head_dim": 64, "torch_dtype": "float32"}
"""config fields Qwen2Config's signature does not list; the config keeps them, and the model reads head_dim"""
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, with hermes-style tool calls (agentstream/stack/chat_template.py)
CHAT_TEMPLATE = tool_chat_template()


def byte_vocab() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, so that the ByteLevel pre-tokenizer's symbols map to their byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(vocab=byte_vocab(), merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out: Path, seed: int = 0, hidden: int = 128, layers: int = 2, output_gain: float = 1.0) -> Path:
    """The model in `out`. `output_gain` is the final norm's weight: at 1 (a fresh model's) every logit stays within
    ±|head row|·√hidden ≈ ±2.6, so a LoRA adapter, which trains neither that norm nor the head, cannot raise the
    digits' share of the answer above ~0.10 however it turns the hidden state (`demo.tenants`)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        **UNLISTED,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.fill_(output_gain)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
