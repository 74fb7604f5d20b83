"""The artifact's tokenizer for the HTTP server: encode, incremental decode, chat template, stop strings.

`load_tokenizer(artifact_dir, manifest)` reads the tokenizer files the exporter copied from the
checkpoint (`tokenizer.json` through the `tokenizers` library; special tokens and the chat template
from `tokenizer_config.json`, `chat_template.jinja` or `chat_template.json`; end-of-sequence ids from
`generation_config.json` and the manifest). An artifact without `tokenizer.json` has no tokenizer: the
server then takes and returns token ids only.

Chat templates are Jinja, rendered in jinja2's immutable sandbox with the globals transformers gives
them (`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML). jinja2 is imported only
when a template is rendered.

Standard library, `tokenizers` and (for chat templates) `jinja2` only: this module is on the
JAX-free serving path.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from tlaloc_jax import artifact as af

# Prompt ids an incremental detokenizer decodes with the first new tokens, so that a token whose text
# depends on what precedes it (a SentencePiece word start, a byte-level continuation) reads right.
_CONTEXT_IDS = 5
_REPLACEMENT = "\ufffd"


class ChatTemplateError(ValueError):
    """A chat request the template cannot render (no template, a template error, bad messages)."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_listed(root: Path, manifest: af.Manifest, name: str) -> str | None:
    """The text of a tokenizer file the manifest lists (inside the artifact, its sha256 checked), or None when it
    lists none by that name: a file the exporter did not copy is never read, whatever lies in the directory."""
    path = af.artifact_file(root, manifest, name)
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise af.ManifestError(f"tokenizer file {name!r} cannot be read as UTF-8 text: {e}") from None


def read_listed_json(root: Path, manifest: af.Manifest, name: str) -> dict:
    text = read_listed(root, manifest, name)
    if text is None:
        return {}
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise af.ManifestError(f"tokenizer file {name!r} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def _chat_template(root: Path, manifest: af.Manifest, config: dict) -> str | None:
    """The checkpoint's chat template: chat_template.jinja, chat_template.json, then tokenizer_config.json."""
    jinja = read_listed(root, manifest, "chat_template.jinja")
    if jinja is not None:
        return jinja
    template = read_listed_json(root, manifest, "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):   # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class TextTokenizer:
    """An artifact's tokenizer. Encode and decode are the `tokenizers` library's, on tokenizer.json."""

    def __init__(self, root: Path, manifest: af.Manifest):
        from tokenizers import Tokenizer
        self.root = root
        text = read_listed(root, manifest, "tokenizer.json")
        if text is None:
            raise af.ManifestError("the manifest lists no tokenizer.json")
        try:
            self.tok = Tokenizer.from_str(text)
        except Exception as e:   # noqa: BLE001 - tokenizers raises its own Exception type for a corrupt file
            raise af.ManifestError(f"tokenizer file 'tokenizer.json' does not load: {e}") from None
        config = read_listed_json(root, manifest, "tokenizer_config.json")
        self.special_tokens = {k: t for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                               if (t := _token_text(config.get(k))) is not None}
        self.chat_template = _chat_template(root, manifest, config)
        eos = set(manifest.model.eos_token_ids)
        gen = read_listed_json(root, manifest, "generation_config.json").get("eos_token_id")
        eos.update(gen if isinstance(gen, list) else [gen] if isinstance(gen, int) else [])
        if "eos_token" in self.special_tokens and (i := self.tok.token_to_id(self.special_tokens["eos_token"])) is not None:
            eos.add(i)
        self.eos_token_ids = frozenset(int(i) for i in eos)
        self._template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (what a logprobs entry names)."""
        return self.tok.decode([int(token_id)], skip_special_tokens=False)

    def detokenizer(self, prompt_ids: Sequence[int]) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The chat template applied to `messages` (each {"role", "content"}; an assistant's may hold
        tool_calls, a tool's its tool_call_id) and `tools` (OpenAI's function declarations), as text to encode
        without adding special tokens (the template writes them)."""
        if self.chat_template is None:
            raise ChatTemplateError("this artifact's tokenizer has no chat template (tokenizer_config.json "
                                    "chat_template, chat_template.jinja or chat_template.json)")
        if self._template is None:
            self._template = _compile(self.chat_template)
        import jinja2
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools or None, **self.special_tokens)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
            # A template that reads a field the messages lack (a sandboxed template cannot do worse).
            raise ChatTemplateError(f"the chat template failed on the messages: {type(e).__name__}: {e}") from None


def _compile(source: str):
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatTemplateError("chat templates need jinja2 (pip install jinja2)") from None

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): pass-through."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def undefined(x):
        if isinstance(x, jinja2.Undefined):
            raise jinja2.TemplateError("tojson got a value the messages do not have")
        raise TypeError(f"tojson cannot write a {type(x).__name__}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                          default=undefined)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the artifact's chat template does not compile: {e}") from None


def load_tokenizer(artifact_dir: str | os.PathLike, manifest: af.Manifest) -> TextTokenizer | None:
    """The artifact's tokenizer, or None when the exporter copied no tokenizer.json. Reads only the files the
    manifest lists, each checked like every other file of the artifact; a corrupt one is a ManifestError."""
    if not any(t.file == "tokenizer.json" for t in manifest.tokenizer_files):
        return None
    return TextTokenizer(Path(artifact_dir), manifest)


class IncrementalDetokenizer:
    """Text of a growing id sequence, piece by piece, never splitting a character.

    Each new token decodes the ids from `prefix` on (a few earlier ids for context) and emits only what
    extends the text already emitted. When the decoded text ends in U+FFFD, the last tokens hold part
    of a UTF-8 character (byte-level vocabularies split multi-byte characters across tokens): nothing is
    emitted until a later token completes it. `flush()` emits whatever is still held (an incomplete
    character at the very end then reads as U+FFFD, as a full decode would give).
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int]):
        self._decode = tokenizer.decode
        self.ids = list(prompt_ids[-_CONTEXT_IDS:])
        self.prefix = 0                 # ids[prefix:read] is context already emitted
        self.read = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) <= len(before) or (text.endswith(_REPLACEMENT) and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


@dataclass
class StopStrings:
    """Stop strings over a growing text: where the first one starts, and how much text to hold back
    while streaming (a stop string may begin in the text already produced)."""

    strings: tuple[str, ...]

    @property
    def holdback(self) -> int:
        return max((len(s) for s in self.strings), default=1) - 1

    def find(self, text: str, new_from: int) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string that ends at or after text[new_from:]."""
        start = max(0, new_from - self.holdback)
        best = None
        for s in self.strings:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best
