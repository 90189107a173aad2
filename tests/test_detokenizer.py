"""Tokenizer loading and chat templates; incremental detokenization and stop strings.

The tokenizer is a byte-level BPE trained here on a small mixed-script corpus, so characters are
regularly split across tokens (Chinese and emoji are 3-4 bytes, and rare ones fall back to single
bytes), which is exactly what incremental detokenization has to get right.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from sits.engine.detokenizer import IncrementalDetokenizer
from sits.engine.errors import InvalidRequestError, ModelLoadError
from sits.engine.tokenizer import Tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
          " + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Streaming text must never break a character.",
    "Serverless inference starts cold, warms up, and then serves tokens as fast as it can.",
    "café naïve résumé façade jalapeño Ångström über straße Ελληνικά русский язык",
    "我们今天去公园散步，天气很好。大语言模型可以生成中文文本。推理服务需要低延迟。",
    "你好，世界！这是一个用于测试分词器的句子，包含标点符号和数字 12345。",
    "Emoji time 😀🎉👍🚀❤️🔥✨ and mixed 中文 with English words 🙂 done.",
    "def step(self, token_id: int) -> str:\n    return self.text  # code, too\n",
]
# Mostly pieces the tokenizer knows (so merges split characters), some multi-code-point emoji,
# and any other code point (which falls back to single bytes).
PIECES = list("abcdefghijklmnopqrstuvwxyz ABC.,!?\n\t#-0123456789") + list("éèüñßåøΩЖ") + \
    list("我们今天去公园散步中文龘鼎") + ["😀", "🎉", "🚀", "❤️", "🧪", "👩‍🔬", " the", "ing"]
pieces = st.sampled_from(PIECES) | st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd")
texts = st.lists(pieces, max_size=40).map("".join)
nonempty_texts = st.lists(pieces, min_size=1, max_size=40).map("".join)
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory) -> Path:
    """Train once per session (a fraction of a second) instead of shipping a binary fixture."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    path = tmp_path_factory.mktemp("trained") / "tokenizer.json"
    tok.save(str(path))
    return path


def write_model_dir(path: Path, tokenizer_file: Path, tokenizer_config: dict | None = None,
                    extra_files: dict | None = None) -> Path:
    """A model directory holding the trained tokenizer.json and the given metadata files."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_file, path / "tokenizer.json")
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, content in (extra_files or {}).items():
        (path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory, tokenizer_file) -> Tokenizer:
    model_dir = write_model_dir(
        tmp_path_factory.mktemp("model"), tokenizer_file,
        {"eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>", "special": True},
         "bos_token": None, "chat_template": CHATML},
        {"generation_config.json": {"eos_token_id": [0, 2]}})
    return Tokenizer.from_dir(model_dir)


def stream(tok: Tokenizer, ids: list[int], **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.step(i) for i in ids]
    deltas.append(detok.finish())
    return deltas, detok


# --- tokenizer ---------------------------------------------------------------------------------

def test_metadata_from_dir(tokenizer):
    assert tokenizer.vocab_size == 600
    assert tokenizer.eos_token_ids == [0, 2]  # generation_config's ids, the tokenizer's eos merged in
    assert tokenizer.pad_token_id == 0 and tokenizer.bos_token_id is None


def test_encode_decode_round_trip_and_special_tokens(tokenizer):
    text = "héllo 世界 🚀<|im_end|>"
    ids = tokenizer.encode(text)
    assert ids[-1] == 2
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == "héllo 世界 🚀"


def test_chat_template_renders_chatml(tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tokenizer.apply_chat_template(messages[:1], add_generation_prompt=False) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n"


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": 3}], "messages[1].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    (["hi"], "messages[0]"),
])
def test_bad_messages_are_request_errors(tokenizer, messages, param):
    with pytest.raises(InvalidRequestError) as info:
        tokenizer.apply_chat_template(messages)
    assert info.value.param == param and info.value.code == "invalid_messages"


def test_template_helpers_raise_exception_and_tojson(tmp_path, tokenizer_file):
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
                "{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}")
    tok = Tokenizer.from_dir(write_model_dir(tmp_path, tokenizer_file, {"chat_template": template}))
    assert tok.apply_chat_template([{"role": "user", "content": "<a & b>"}]) == \
        '{"role": "user", "content": "<a & b>"}'
    with pytest.raises(InvalidRequestError, match="first must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_chat_template_file_takes_precedence(tmp_path, tokenizer_file):
    tok = Tokenizer.from_dir(write_model_dir(tmp_path, tokenizer_file, {"chat_template": "inline"},
                                             {"chat_template.jinja": "from file"}))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "from file"


def test_no_chat_template(tmp_path, tokenizer_file):
    tok = Tokenizer.from_dir(write_model_dir(tmp_path, tokenizer_file))
    with pytest.raises(InvalidRequestError) as info:
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert info.value.code == "no_chat_template"


def test_broken_chat_template_fails_at_load(tmp_path, tokenizer_file):
    with pytest.raises(ModelLoadError, match="syntax error"):
        Tokenizer.from_dir(write_model_dir(tmp_path, tokenizer_file, {"chat_template": "{% for %}"}))


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_invalid_tokenizer_files(tmp_path, tokenizer_file):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizers library"):
        Tokenizer.from_dir(tmp_path)
    write_model_dir(tmp_path, tokenizer_file)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)


# --- incremental detokenization ----------------------------------------------------------------

def test_characters_really_span_tokens(tokenizer):
    """Guard for the property tests below: the tokenizer must split multi-byte characters."""
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("龘🧪")]
    assert len(pieces) > 2 and "\ufffd" in "".join(pieces)


@PROPERTY
@given(text=texts)
def test_stream_of_encoded_text_is_valid_and_complete(tokenizer, text):
    ids = tokenizer.encode(text)
    deltas, detok = stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text
    assert not detok.stopped


@PROPERTY
@given(prompt=texts, text=texts)
def test_stream_with_prompt_context(tokenizer, prompt, text):
    ids = tokenizer.encode(text)
    deltas, _ = stream(tokenizer, ids, prompt_ids=tokenizer.encode(prompt))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


@PROPERTY
@given(ids=st.lists(st.integers(0, 599), max_size=40), skip=st.booleans())
def test_stream_of_arbitrary_ids_matches_decode(tokenizer, ids, skip):
    """Even invalid byte sequences: the stream is exactly what decoding everything at once gives."""
    deltas, _ = stream(tokenizer, ids, skip_special_tokens=skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_incomplete_character_is_held_then_flushed(tokenizer):
    ids = tokenizer.encode("a龘")
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.step(i) for i in ids[:-1]][-1] == ""
    assert detok.text == "a"
    assert detok.finish() == tokenizer.decode(ids[:-1])[1:]


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("hi<|im_end|> there")
    assert "".join(stream(tokenizer, ids)[0]) == "hi there"
    assert "".join(stream(tokenizer, ids, skip_special_tokens=False)[0]) == "hi<|im_end|> there"


def test_window_stays_bounded(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("x" * 100))
    for i in tokenizer.encode("我们今天去公园散步 😀 " * 50):
        detok.step(i)
        assert len(detok._ids) <= 8


@PROPERTY
@given(data=st.data(), text=nonempty_texts)
def test_stop_string_truncates_and_never_leaks(tokenizer, data, text):
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start:data.draw(st.integers(start + 1, min(len(text), start + 8)))]
    deltas, detok = stream(tokenizer, tokenizer.encode(text), stop=[stop])
    expected = text[:text.find(stop)]
    assert "".join(deltas) == detok.text == expected
    assert detok.stopped and detok.stop_reason == stop


def test_stop_string_spanning_tokens(tokenizer):
    text, stop = "The quick brown fox jumps over the lazy dog", "own fox ju"
    ids = tokenizer.encode(text)
    ends = [len(tokenizer.decode(ids[:k])) for k in range(1, len(ids) + 1)]
    lo, hi = text.index(stop), text.index(stop) + len(stop)
    assert sum(lo < e < hi for e in ends) >= 2  # the stop string covers parts of 3+ tokens
    deltas, detok = stream(tokenizer, ids, stop=["zzz", stop])
    assert "".join(deltas) == "The quick br" and detok.stop_reason == stop
    assert detok.step(ids[0]) == "" and detok.finish() == ""


def test_stop_hold_back_is_released(tokenizer):
    deltas, detok = stream(tokenizer, tokenizer.encode("ab#cd##ef#"), stop=["###"])
    assert "".join(deltas) == "ab#cd##ef#" and not detok.stopped and deltas[-1].endswith("#")


def test_earliest_ending_stop_string_wins(tokenizer):
    deltas, detok = stream(tokenizer, tokenizer.encode("xxabcdyy"), stop=["abcd", "c"])
    assert "".join(deltas) == "xxab" and detok.stop_reason == "c"
    deltas, detok = stream(tokenizer, tokenizer.encode("xxabcdyy"), stop=["bc", "abc"])
    assert "".join(deltas) == "xx" and detok.stop_reason == "abc"  # same end: the longer one
