"""Tokenizers: the character vocabulary, and a real `tokenizer.json` built with `tokenizers`."""

import json

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from espo_jax.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer


# ---- CharTokenizer ---------------------------------------------------------------------------
def test_char_ids_are_fixed_and_round_trip():
    tok = CharTokenizer()
    # 3 specials + 10 digits + 52 letters + 32 punctuation + space + newline = 99.
    assert tok.vocab_size == 99
    # Digits come first after the 3 specials: "0" -> 3, "7" -> 10; "a" follows the 10 digits -> 13.
    assert tok.encode("07a") == [3, 10, 13]
    text = "12+34=46\nAnswer: {x_1} ~ 'ok'?"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id == 1 and ids[-1] == tok.eos_id == 2
    assert len(ids) == len(text) + 2
    assert tok.decode(ids) == text


def test_char_decode_stops_at_eos_and_drops_specials():
    tok = CharTokenizer()
    ids = [tok.pad_id, tok.bos_id] + tok.encode("ab") + [tok.eos_id] + tok.encode("cd")
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, stop_at_eos=False) == "abcd"


def test_char_custom_vocabulary():
    tok = CharTokenizer("ab")
    assert tok.vocab_size == 5
    assert tok.encode("ba") == [4, 3]


def test_char_errors():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="'é' is not in the vocabulary"):
        tok.encode("café")
    with pytest.raises(ValueError, match="id 99 is outside"):
        tok.decode([3, 99])
    with pytest.raises(ValueError, match="id -1 is outside"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="duplicate"):
        CharTokenizer("aba")


# ---- HFTokenizer -----------------------------------------------------------------------------
_CORPUS = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog"] * 20


def _word_level(tmp_path, specials):
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(_CORPUS, trainers.WordLevelTrainer(special_tokens=specials))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def _bpe(tmp_path):
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_hf_word_level_ids_and_specials(tmp_path):
    # Trainer order: the special tokens get ids 0.. in the order given.
    path = _word_level(tmp_path, ["<pad>", "<s>", "</s>", "<unk>"])
    tok = HFTokenizer(str(path))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    # 4 specials + 9 distinct words: the cat sat on mat dog log a and.
    assert tok.vocab_size == 4 + 9
    ids = tok.encode("the cat sat", add_bos=True, add_eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5
    assert tok.decode(ids) == "the cat sat"  # specials skipped, WordLevel joins with spaces
    assert tok.decode(ids + tok.encode("dog"), stop_at_eos=True) == "the cat sat"
    # Unknown words map to <unk> (id 3), they do not raise.
    assert tok.encode("zebra") == [3]


def test_hf_bpe_round_trip_and_qwen_style_specials(tmp_path):
    tok = HFTokenizer(str(_bpe(tmp_path)))  # a directory: reads its tokenizer.json
    # Candidates: eos prefers <|im_end|> (id 2), pad <|endoftext|> (id 0); no bos in Qwen vocab.
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (2, 0, -1)
    text = "the dog and the cat sat on a log"
    ids = tok.encode(text, add_bos=True)
    assert len(ids) < len(text)  # merges learnt: fewer tokens than bytes
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("mat", add_eos=True) + tok.encode(" x")) == "mat"


def test_hf_tokenizer_config_and_explicit_names(tmp_path):
    _bpe(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|endoftext|>"}, "pad_token": "<|im_start|>"}))
    tok = HFTokenizer(str(tmp_path))
    assert (tok.eos_id, tok.pad_id) == (0, 1)  # from tokenizer_config.json, not the defaults
    assert HFTokenizer(str(tmp_path), eos="<|im_end|>").eos_id == 2
    with pytest.raises(ValueError, match="eos token '<nope>' is not in"):
        HFTokenizer(str(tmp_path), eos="<nope>")


def test_hf_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        HFTokenizer(str(tmp_path))
    path = _word_level(tmp_path, ["<unk>"])
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        HFTokenizer(str(path))


def test_load_tokenizer(tmp_path):
    assert isinstance(load_tokenizer("char"), CharTokenizer)
    assert isinstance(load_tokenizer(str(_bpe(tmp_path))), HFTokenizer)


# A Qwen-style template: a default system turn, `raise_exception` on a bad role, generation prompt.
_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("where", ["jinja_file", "tokenizer_config"])
def test_chat_template_renders_as_transformers_does(tmp_path, where):
    from transformers import AutoTokenizer

    _bpe(tmp_path)
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if where == "jinja_file":
        (tmp_path / "chat_template.jinja").write_text(_TEMPLATE)
    else:
        config["chat_template"] = _TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok, ref = HFTokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    for messages in ([{"role": "user", "content": "the cat sat"}],
                     [{"role": "system", "content": "a dog"},
                      {"role": "user", "content": "on the mat"},
                      {"role": "assistant", "content": "the log"},
                      {"role": "user", "content": "and?"}]):
        for gen in (True, False):
            ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
            assert ours == ref.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=gen)
            assert ours.endswith("<|im_start|>assistant\n") == gen
    # The specials in the rendered text are single ids, as transformers tokenizes them.
    text = tok.apply_chat_template([{"role": "user", "content": "a cat"}])
    assert tok.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
    assert tok.encode(text).count(1) == 3  # <|im_start|>: system, user, assistant
    with pytest.raises(Exception, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="chat message 0 must be a dict with 'role' and"):
        tok.apply_chat_template(["the cat"])


def test_no_chat_template_is_an_error_and_char_joins_contents(tmp_path):
    with pytest.raises(ValueError, match="no chat template"):
        HFTokenizer(str(_bpe(tmp_path))).apply_chat_template([{"role": "user", "content": "a"}])
    messages = [{"role": "system", "content": "Q: "}, {"role": "user", "content": "1+2="}]
    assert CharTokenizer().apply_chat_template(messages) == "Q: 1+2="
