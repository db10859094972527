"""A K3-style tokenizer for serving benchmarks: a byte-level BPE whose chat and tool-call markers are special tokens
(one id each, as in Kimi K2's tiktoken vocabulary) and whose chat template is Kimi K2's shape, rendering `tools`,
an assistant's `tool_calls` and `role: tool` turns itself.

    python benchmarks/k3_style_tokenizer.py OUT_DIR [--vocab 16384] [--corpus PATHS...]

OUT_DIR gets tokenizer.json (the `tokenizers` library, trained on --corpus: by default the repository's own *.py and
*.md files, so it runs offline wherever the repository is) and tokenizer_config.json (eos_token <|im_end|>: a chat
turn ends there, so end-of-text ends a reply; the chat template). --vocab counts the special tokens and is a multiple
of 64; a corpus too small to learn that many merges is padded with reserved special tokens, so the size is exactly
--vocab. The last line printed is the vocabulary size: `model.vocab_size` must be at least that.

The template (k3ray.tokenizer renders it with messages, tools and add_generation_prompt):

    <|im_system|>tool_declare<|im_middle|>[tools as JSON]<|im_end|>                       (where there are tools)
    <|im_system|>system<|im_middle|>{content}<|im_end|>                                  (system, developer, tool)
    <|im_user|>user<|im_middle|>{content}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>{content}<|tool_calls_section_begin|>...<|im_end|>
    <|im_system|>tool<|im_middle|>## Return of {tool_call_id}\\n{content}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>                                               (the generation prompt)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3ray.serve.tool_calls import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END  # noqa: E402

EOS = "<|im_end|>"
ROLES = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>"}
MIDDLE = "<|im_middle|>"
SPECIALS = (EOS, *ROLES.values(), MIDDLE, SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END,
            "<|endoftext|>")
TEMPLATE = (
    "{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}"
    "{% for m in messages %}"
    "{{ '<|im_user|>' if m.role == 'user' else '<|im_assistant|>' if m.role == 'assistant' else '<|im_system|>' }}"
    "{{ m.role }}<|im_middle|>"
    "{% if m.role == 'tool' %}## Return of {{ m.tool_call_id }}\n{% endif %}"
    "{{ m.content or '' }}"
    "{% if m.tool_calls %}<|tool_calls_section_begin|>"
    "{% for c in m.tool_calls %}<|tool_call_begin|>{{ c.id }}<|tool_call_argument_begin|>"
    "{{ c.function.arguments }}<|tool_call_end|>{% endfor %}"
    "<|tool_calls_section_end|>{% endif %}"
    "<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")


def corpus_texts(paths: list[str] | None = None, suffixes: tuple[str, ...] = (".py", ".md")) -> list[str]:
    """The text of every file under `paths` (files or folders; default the repository's own sources) whose name
    ends in one of `suffixes`, in sorted order; virtual environments and caches skipped."""
    texts = []
    for spec in paths or [str(ROOT)]:
        path = Path(spec)
        files = [path] if path.is_file() else sorted(
            p for p in path.rglob("*") if p.suffix in suffixes and p.is_file()
            and not any(part.startswith(".") or part in ("__pycache__", "node_modules") for part in
                        p.relative_to(path).parts))
        texts += [f.read_bytes().decode("utf-8", errors="replace") for f in files]
    return texts


def build(out: Path, vocab: int = 16384, texts: list[str] | None = None) -> int:
    """Train the tokenizer on `texts` (default `corpus_texts()`), write it to `out` and return its vocabulary size
    (exactly `vocab`, a multiple of 64)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab % 64 or vocab < 256 + 64:
        raise SystemExit(f"--vocab {vocab}: must be a multiple of 64 and at least 320 (the 256 bytes and the "
                         f"{len(SPECIALS)} special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                  special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIALS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts if texts is not None else corpus_texts(), trainer)
    short = vocab - tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens([AddedToken(f"<|reserved_token_{i}|>", special=True, normalized=False)
                            for i in range(short)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "chat_template": TEMPLATE}, indent=1))
    return tok.get_vocab_size(with_added_tokens=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=int, default=16384, help="tokens, special ones included (a multiple of 64)")
    ap.add_argument("--corpus", nargs="+", help="files or folders (*.py, *.md); default this repository")
    args = ap.parse_args()
    texts = corpus_texts(args.corpus)
    size = build(args.out, args.vocab, texts)
    print(f"{args.out}: {size} tokens ({len(SPECIALS)} special) from {len(texts)} files, "
          f"{sum(map(len, texts)) / 2**20:.1f} MiB of text", file=sys.stderr)
    print(size)


if __name__ == "__main__":
    main()
