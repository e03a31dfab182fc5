"""Tokenizers: a fixed character vocabulary for synthetic tasks, and Hugging Face
`tokenizer.json` files (through `tokenizers`) for real models.

Both expose the same small interface: `encode(text) -> list[int]`, `decode(ids) -> str`,
`vocab_size`, the ids `pad_id`, `bos_id`, `eos_id`, and `apply_chat_template(messages)`: the
Hugging Face chat template of a tokenizer directory (`chat_template.jinja`, or `chat_template` in
`tokenizer_config.json`), rendered as transformers renders it (sandboxed Jinja, trimmed blocks);
the character tokenizer joins the message contents.
"""

from __future__ import annotations

import functools
import json
import os
import string
from collections.abc import Sequence

# Printable ASCII without the rarely useful whitespace variants: digits, letters, punctuation,
# space and newline. Three special ids come first.
_CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"
_SPECIALS = ("<pad>", "<bos>", "<eos>")


class CharTokenizer:
    """One id per character; pad=0, bos=1, eos=2. Unknown characters raise."""

    pad_id, bos_id, eos_id = 0, 1, 2

    def __init__(self, chars: str = _CHARS):
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer: duplicate characters in the vocabulary")
        self._chars = chars
        self._to_id = {c: i + len(_SPECIALS) for i, c in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        return len(self._chars) + len(_SPECIALS)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        try:
            ids = [self._to_id[c] for c in text]
        except KeyError as e:
            msg = f"CharTokenizer: character {e.args[0]!r} is not in the vocabulary"
            raise ValueError(msg) from None
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Sequence[int], *, stop_at_eos: bool = True,
               errors: str = "strict") -> str:
        """Text of `ids`; special ids are dropped, and decoding stops at eos if `stop_at_eos`.

        An id outside the vocabulary raises with `errors="strict"`; with `errors="replace"` it
        becomes U+FFFD (a model whose embedding table is larger than the vocabulary, as the
        presets' 128 rows for 99 symbols, can sample such ids: they make an answer wrong, not
        a crash)."""
        if errors not in ("strict", "replace"):
            raise ValueError(f"errors must be 'strict' or 'replace', got {errors!r}")
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                if errors == "replace":
                    out.append("\ufffd")
                    continue
                raise ValueError(f"CharTokenizer: id {i} is outside [0, {self.vocab_size})")
            if i == self.eos_id and stop_at_eos:
                break
            if i < len(_SPECIALS):
                continue
            out.append(self._chars[i - len(_SPECIALS)])
        return "".join(out)

    def apply_chat_template(self, messages: Sequence[dict], *,
                            add_generation_prompt: bool = True) -> str:
        """No template: the messages' contents, joined (synthetic tasks)."""
        return "".join(str(m["content"]) for m in messages)


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (file or model directory) through `tokenizers`.

    Special tokens: explicit `pad`/`bos`/`eos` names (which must exist), else the
    `pad_token`/`bos_token`/`eos_token` of a `tokenizer_config.json` next to the file, else the
    first of the usual names found in the vocabulary. No eos is an error; no pad falls back to
    eos; no bos gives `bos_id == -1` (Qwen models have none) and `add_bos` then adds nothing.
    """

    def __init__(self, path: str, *, pad: str | None = None, bos: str | None = None,
                 eos: str | None = None):
        import tokenizers

        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"HFTokenizer: no tokenizer.json at {path}")
        self._tok = tokenizers.Tokenizer.from_file(path)
        tok_config = _special_tokens(os.path.join(os.path.dirname(path), "tokenizer_config.json"))

        def find(kind: str, name: str | None, candidates: Sequence[str]) -> int:
            if name:
                i = self._tok.token_to_id(name)
                if i is None:
                    raise ValueError(f"HFTokenizer: {kind} token {name!r} is not in {path}")
                return i
            configured = [tok_config[kind]] if kind in tok_config else []
            for c in configured + list(candidates):
                i = self._tok.token_to_id(c)
                if i is not None:
                    return i
            return -1

        self.chat_template = _chat_template(os.path.dirname(path))
        self._special_names = tok_config
        self.eos_id = find("eos", eos, ("<|im_end|>", "<|endoftext|>", "</s>", "<eos>"))
        self.bos_id = find("bos", bos, ("<s>", "<bos>"))
        self.pad_id = find("pad", pad, ("<|endoftext|>", "<pad>", "</s>"))
        if self.eos_id < 0:
            raise ValueError(f"HFTokenizer: no end-of-sequence token found in {path}")
        if self.pad_id < 0:
            self.pad_id = self.eos_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = [self.bos_id] if add_bos and self.bos_id >= 0 else []
        return bos + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Sequence[int], *, stop_at_eos: bool = True) -> str:
        ids = [int(i) for i in ids]
        if stop_at_eos and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[dict], *,
                            add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` (`[{"role": ..., "content": ...}]`) under the
        directory's chat template, ending with the assistant header when
        `add_generation_prompt`. A directory without a template is an error."""
        if self.chat_template is None:
            raise ValueError("HFTokenizer: this tokenizer has no chat template (no "
                             "chat_template.jinja and no chat_template in tokenizer_config.json)"
                             "; give prompts as text")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"chat message {i} must be a dict with 'role' and 'content', "
                                 f"got {m!r}")
        specials = {f"{k}_token": v for k, v in self._special_names.items()}
        return _compiled_template(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **specials)


def _chat_template(directory: str) -> str | None:
    """The chat template of a tokenizer directory: `chat_template.jinja` (transformers 5), else
    `chat_template` of `tokenizer_config.json` (a string, or the one named "default")."""
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja) as f:
            return f.read()
    config_path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.exists(config_path):
        return None
    with open(config_path) as f:
        template = json.load(f).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template or None


@functools.cache
def _compiled_template(template: str):
    """The template compiled as transformers compiles chat templates: a sandboxed environment
    with trimmed blocks, `raise_exception`, an unescaped `tojson` and `strftime_now`."""
    import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def _special_tokens(config_path: str) -> dict[str, str]:
    """{"pad"|"bos"|"eos": token} from a Hugging Face tokenizer_config.json, if it exists."""
    if not os.path.exists(config_path):
        return {}
    with open(config_path) as f:
        config = json.load(f)
    out = {}
    for kind in ("pad", "bos", "eos", "unk"):
        token = config.get(f"{kind}_token")
        if isinstance(token, dict):  # older files: {"content": "<|endoftext|>", ...}
            token = token.get("content")
        if token:
            out[kind] = token
    return out


def load_tokenizer(spec: str) -> CharTokenizer | HFTokenizer:
    """`"char"` for the character tokenizer, else a path to a Hugging Face tokenizer."""
    if spec == "char":
        return CharTokenizer()
    return HFTokenizer(spec)
