"""Real data: tokenizers (bytes, a BPE tokenizer.json trained here, a tiktoken file), the shard format and its
checks, addressed batches over shards (pure, replayable, validation split by documents), and bad input as one line
before anything starts. Ray-free; the prepare command and training on shards are in test_data_prepare.py."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from k3ray.config import ConfigError, load_config
from k3ray.control.cli import main
from k3ray.control.prepare import Unit, prepare_unit
from k3ray.data import check_data, open_token_data
from k3ray.io import shards
from k3ray.shard_data import ShardData, permute
from k3ray.tokenizer import load_tokenizer

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MULTIBYTE = "héllo wörld: 日本語のテキスト ✓ 🙂 naïve café"


def corpus_texts() -> list[str]:
    """k3ray's own non-empty sources (prepare skips empty documents)."""
    return [t for p in sorted((REPO / "k3ray").rglob("*.py")) if (t := p.read_text())]


def train_bpe(folder: Path, vocab_size: int = 400) -> Path:
    """A byte-level BPE tokenizer.json trained on k3ray's own sources, with a tokenizer_config.json beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_texts() + [MULTIBYTE], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                              "chat_template": TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("bpe"))


def write_tiktoken(folder: Path) -> Path:
    """A tiktoken BPE file: the 256 bytes and a few merges, its special token in tokenizer_config.json."""
    merges = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b"\xc3\xa9"]
    ranks = [bytes([b]) for b in range(256)] + merges
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tiktoken.model"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(ranks)))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|eot|>", "added_tokens_decoder": {str(len(ranks)): {"content": "<|eot|>"}}}))
    return path


def streamed(tok, ids: list[int], stop: tuple[str, ...] = (), step: int = 1) -> tuple[list[str], object]:
    detok = tok.detokenizer(stop)
    pieces = [detok.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    return pieces + [detok.push([], final=True)], detok


# -- tokenizers ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bytes", "bpe", "tiktoken"])
def test_streamed_text_equals_whole_text_and_never_splits_a_character(kind, bpe, tmp_path):
    spec = {"bytes": "bytes", "bpe": str(bpe), "tiktoken": str(write_tiktoken(tmp_path))}[kind]
    tok = load_tokenizer(spec)
    ids = tok.encode(MULTIBYTE)
    assert tok.decode(ids) == MULTIBYTE
    pieces, _ = streamed(tok, ids)
    assert "".join(pieces) == MULTIBYTE
    assert all("\ufffd" not in p for p in pieces)  # no piece ends inside a character
    assert sum(len(p.encode()) for p in pieces) == len(MULTIBYTE.encode())


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_stop_strings_cut_the_text_and_are_never_streamed(kind, bpe):
    tok = load_tokenizer("bytes" if kind == "bytes" else str(bpe))
    text = "def f(x):\n    return x\n\nclass Y:\n    pass\n"
    ids = tok.encode(text)
    pieces, detok = streamed(tok, ids, stop=("\n\nclass",))
    assert "".join(pieces) == "def f(x):\n    return x" and detok.stopped
    assert detok.tokens < len(ids)  # the tokens after the stop string were not consumed
    # a stop string that only starts at the very end is held back, then released when the output ends
    pieces, detok = streamed(tok, tok.encode("abc\n\ncl"), stop=("\n\nclass",))
    assert "".join(pieces[:-1]) == "abc" and pieces[-1] == "\n\ncl" and not detok.stopped


def test_end_of_text_ends_the_stream(bpe):
    tok = load_tokenizer(str(bpe))
    pieces, detok = streamed(tok, tok.encode("ab") + [tok.eos_id] + tok.encode("cd"))
    assert "".join(pieces) == "ab" and detok.tokens == len(tok.encode("ab"))


def test_chat_template_from_tokenizer_config_rendered_with_jinja(bpe):
    tok = load_tokenizer(str(bpe))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    assert tok.chat_prompt(messages) == "<|system|>be brief<|endoftext|>\n<|user|>héllo<|endoftext|>\n<|assistant|>"
    assert tok.chat_stop == ()  # the template's model ends a reply with end-of-text
    byte = load_tokenizer("bytes")
    assert byte.chat_prompt(messages) == "### system\nbe brief\n### user\nhéllo\n### assistant\n"
    assert byte.chat_stop == ("\n### ",)


def test_tiktoken_special_tokens_and_vocabulary(tmp_path):
    tok = load_tokenizer(str(write_tiktoken(tmp_path)))
    assert tok.vocab_size == 264 and tok.eos_id == 263
    assert tok.encode("hello<|eot|>") == [259, 263]  # "hello" is the 4th merge


def test_bad_tokenizers_are_one_line_naming_the_file(tmp_path, bpe):
    with pytest.raises(ConfigError, match="nothere.json: tokenizer file not found"):
        load_tokenizer(str(tmp_path / "nothere.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json: not a readable tokenizer.json"):
        load_tokenizer(str(tmp_path / "bad.json"))
    (tmp_path / "bad.tiktoken").write_text("%%% 1\n")
    with pytest.raises(ConfigError, match="bad.tiktoken: not a tiktoken BPE file"):
        load_tokenizer(str(tmp_path / "bad.tiktoken"))
    cfg = tiny_on(None, **{"data.tokenizer": str(bpe)})
    with pytest.raises(ConfigError, match=r"vocabulary of 400 tokens is larger than model.vocab_size=256"):
        check_data(cfg)


# -- shards -------------------------------------------------------------------------------------------------------
def make_shards(folder: Path, tokenizer: str, texts: list[str], per_shard: int = 8) -> Path:
    """A prepared folder without Ray: the prepare command's own unit function, one unit per group of files."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "in").mkdir(exist_ok=True)
    files = []
    for i, text in enumerate(texts):
        files.append(folder / "in" / f"{i:04d}.txt")
        files[-1].write_text(text)
    out = folder / "shards"
    out.mkdir(exist_ok=True)
    tok = load_tokenizer(tokenizer)
    entries = [prepare_unit(Unit("text", tuple(map(str, files[i:i + per_shard]))), n, tokenizer, tok.fingerprint,
                            "text", str(out)) for n, i in enumerate(range(0, len(files), per_shard))]
    shards.write_json(out / shards.MANIFEST, {
        "format": shards.FORMAT, "shards": [{k: v for k, v in e.items() if k not in ("input_bytes", "cpu_seconds")}
                                              for e in entries],
        "tokenizer": {"name": tokenizer, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                      "fingerprint": tok.fingerprint}})
    return out


def tiny_on(source, **overrides):
    base = {"parallel.pp": 1, "parallel.ep": 2, "train.eval_every": 0}
    if source is not None:
        base["data.source"] = str(source)
    return load_config(REPO / "configs/tiny.yaml", {**base, **overrides})


@pytest.fixture(scope="module")
def bpe_shards(bpe, tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("shards"), str(bpe), corpus_texts()[:40])


def test_shards_hold_every_document_with_end_of_text(bpe, bpe_shards):
    tok = load_tokenizer(str(bpe))
    s = shards.ShardSet.open(bpe_shards, checksums=True)
    texts = corpus_texts()[:40]
    assert len(s.doc_ends) == len(texts)
    assert s.n_tokens == sum(len(tok.encode(t)) + 1 for t in texts)
    start = 0
    for text, end in zip(texts, s.doc_ends):
        ids = s.read(start, int(end) - start)
        assert ids[-1] == tok.eos_id and tok.decode(ids[:-1].tolist()) == text
        start = int(end)


def test_shard_batches_are_pure_and_cover_the_global_order(bpe, bpe_shards):
    cfg = tiny_on(bpe_shards, **{"data.tokenizer": str(bpe), "model.vocab_size": 512})
    data = open_token_data(cfg)
    assert isinstance(data, ShardData)
    first = data.batch(7, 1, 1)
    assert first.shape == (8, 129) and first.dtype == torch.int64
    assert torch.equal(first, open_token_data(cfg).batch(7, 1, 1))  # a fresh reader (a replacement worker) agrees
    numbers = np.concatenate([data.sample_numbers(3, d, m) for d in range(2) for m in range(2)])
    assert sorted(numbers) == list(range(3 * 32, 4 * 32))  # batch 3 is global samples 96..127, each once
    # an epoch is a permutation of the training samples; the next epoch another one
    epoch = data.train_samples(np.arange(data.n_train))
    assert sorted(epoch) == list(range(data.n_train))
    assert not np.array_equal(epoch, data.train_samples(np.arange(data.n_train, 2 * data.n_train)))
    # the rows are the packed token stream at those samples; targets are inputs shifted by one
    sample = int(data.train_samples(np.array([7 * 32 + (1 * 2 + 1) * 8]))[0])
    assert torch.equal(first[0], torch.from_numpy(data.shards.read(sample * 128, 129)))


def test_validation_is_split_by_documents(bpe, bpe_shards):
    data = open_token_data(tiny_on(bpe_shards, **{"data.tokenizer": str(bpe), "model.vocab_size": 512,
                                                  "data.val_fraction": 0.1}))
    ends = data.shards.doc_ends
    assert data.val_start == int(ends[len(ends) - 4 - 1])  # 4 of 40 documents
    assert (data.n_train - 1) * 128 + 129 <= data.val_start  # no training sample reaches a validation document
    assert torch.equal(data.val_batch(0)[0], torch.from_numpy(data.shards.read(data.val_start, 129)))


def test_documents_the_model_masks_are_the_shard_index_documents(bpe, bpe_shards):
    """Document masking finds documents from the end-of-text tokens of a batch (k3ray.model.layers.Documents); they
    are exactly the documents the shard index records (documents end where `doc_ends` says)."""
    import numpy as np

    from k3ray.model.layers import Documents

    data = open_token_data(tiny_on(bpe_shards, **{"data.tokenizer": str(bpe), "model.vocab_size": 512}))
    for b in range(20):
        starts = data.train_samples(data.sample_numbers(b, 0, 0)) * data.cfg.seq_len
        indexed = np.searchsorted(data.shards.doc_ends, starts[:, None] + np.arange(data.cfg.seq_len), side="right")
        want = torch.from_numpy(indexed - indexed[:, :1])
        assert torch.equal(Documents(data.batch(b, 0, 0)[:, :-1], data.eos_id).doc, want)


def test_permutation_is_a_bijection_for_any_size():
    for n in (1, 2, 3, 17, 1000, 4097):
        for key in (0, 12345):
            p = permute(np.arange(n), n, np.full(n, key, dtype=np.uint64))
            assert sorted(p) == list(range(n))
    big = permute(np.array([0, 5, 10**11 - 1]), 10**11, np.zeros(3, dtype=np.uint64))
    assert ((0 <= big) & (big < 10**11)).all() and len(set(big)) == 3


def test_byte_corpus_batches_are_unchanged():
    cfg = tiny_on(None)
    assert not isinstance(open_token_data(cfg), ShardData)
    check_data(cfg)


# -- bad shards: one line naming the file, before anything starts -------------------------------------------------
def copy_shards(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_bad_shard_sets_are_one_line_naming_the_file(bpe, bpe_shards, tmp_path):
    over = {"data.tokenizer": str(bpe), "model.vocab_size": 512}
    check_data(tiny_on(bpe_shards, **over))
    truncated = copy_shards(bpe_shards, tmp_path / "truncated")
    with open(truncated / "shard_00001.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError, match=r"shard_00001.bin: 100 bytes, the manifest says \d+ .*\(truncated\)"):
        check_data(tiny_on(truncated, **over))
    corrupt = copy_shards(bpe_shards, tmp_path / "corrupt")
    data = bytearray((corrupt / "shard_00000.bin").read_bytes())
    data[40] ^= 1
    (corrupt / "shard_00000.bin").write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="shard_00000.bin: checksum differs"):
        shards.verify(corrupt, checksums=True)
    with pytest.raises(ConfigError, match="manifest.json: prepared with tokenizer .*, not data.tokenizer='bytes'"):
        check_data(tiny_on(bpe_shards))
    missing = copy_shards(bpe_shards, tmp_path / "missing")
    (missing / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match="manifest.json: format None"):
        check_data(tiny_on(missing, **over))


def test_cli_reports_bad_data_in_one_line_before_starting(bpe_shards, tmp_path, capsys):
    assert main(["data", "prepare", "--input", str(tmp_path), "--tokenizer", str(tmp_path / "t.json"),
                 "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "t.json: tokenizer file not found" in err
    assert main(["train", "--config", str(REPO / "configs/tiny.yaml"), "--single-process",
                 "--set", f"data.source={bpe_shards}", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "manifest.json: prepared with tokenizer" in err
