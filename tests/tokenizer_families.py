"""A second tokenizer family, built locally the way the demo model's is (trained on
LICENSE, nothing downloaded): SentencePiece-style BPE with byte fallback, as Llama 2,
Mistral and Gemma ship it (a "▁" for each space and one before the text, unknown
characters spelled as their UTF-8 bytes "<0xNN>"), with a Llama-2 chat template. The
demo model's own is byte-level BPE (GPT-2, Llama 3, Qwen). Only what vLLM's renderer
reads is written: the tokenizer and a model config (no weights)."""

from __future__ import annotations

from pathlib import Path

from replicas.demo_model import CORPUS, SIZES, build_once

VOCAB_SIZE = 1024
LLAMA2_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set content = message['content'] if message['content'] is string else "
    "message['content'] | map(attribute='text') | join('') %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + content + ' [/INST]' }}"
    "{% elif message['role'] == 'system' %}{{ '<<SYS>>\\n' + content + '\\n<</SYS>>\\n\\n' }}"
    "{% else %}{{ ' ' + content + eos_token }}{% endif %}"
    "{% endfor %}"
)


def build_sentencepiece_model(path: Path) -> Path:
    def build(out: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, normalizers, trainers
        from transformers import LlamaConfig, PreTrainedTokenizerFast

        specials = ["<unk>", "<s>", "</s>"]
        byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE, special_tokens=specials + byte_tokens, min_frequency=2, show_progress=False
        )
        tokenizer.train([str(CORPUS)], trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"
        )
        fast.chat_template = LLAMA2_TEMPLATE
        fast.save_pretrained(out)
        LlamaConfig(
            vocab_size=len(fast), bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, **SIZES["tiny"]
        ).save_pretrained(out)

    return build_once(path, "config.json", build)
