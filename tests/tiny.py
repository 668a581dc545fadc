"""Tiny random Llama-style models and a character tokenizer, built in-process (no downloads)."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

CHARS = [chr(i) for i in range(32, 127)] + ["\n"]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def char_tokenizer(chat: bool = False, shift: int = 0) -> PreTrainedTokenizerFast:
    """One token per character; ids 0-2 are <unk>, <s>, </s>. `shift` rotates the ids (an incompatible twin)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({c: 3 + (i + shift) % len(CHARS) for i, c in enumerate(CHARS)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


VOCAB = 3 + len(CHARS)


def tiny_llama(seed: int, layers: int = 2, hidden: int = 64, vocab: int = VOCAB, init: float = 0.35,
               dtype=torch.float64, max_pos: int = 256) -> LlamaForCausalLM:
    """float64 keeps one-token and many-token passes bit-close, so greedy ties cannot flip between them."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      initializer_range=init, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = 2
    return model


def noisy_copy(model: LlamaForCausalLM, noise: float, seed: int) -> LlamaForCausalLM:
    """A draft that agrees with the target often but not always."""
    torch.manual_seed(seed)
    copy = LlamaForCausalLM(model.config).to(model.dtype).eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(noise * p.std() * torch.randn_like(p))
    return copy


_REFERENCE: dict = {}


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Target alone, no cache, one full forward per token: the slowest, most obviously correct reference."""
    key = (id(model), tuple(prompt))
    seq = _REFERENCE.get(key, list(prompt))
    while len(seq) < len(prompt) + n:
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    _REFERENCE[key] = seq
    return seq[len(prompt):len(prompt) + n]
