"""Text in and out of the models: a checkpoint's tokenizer.json through the `tokenizers`
library, its chat template (tokenizer_config.json, Jinja) and its end-of-sequence ids.

    tok = tokenizer.from_checkpoint(path)      # None when the directory has no tokenizer.json
    ids = tok.encode("Hello", chat=True)       # the chat template around one user message
    text = tok.decode(ids)
    stream = tok.stream()                      # incremental decoding, for printing as it comes
    piece = stream.add(token_id)               # the new text (possibly "", bytes pending)

`embedded()` builds the small byte-level BPE tokenizer of the embedded tiny models in code
(trained on a fixed text, so no download; 512 ids like their vocabulary): any text encodes and
decodes back unchanged, and whatever ids a random model produces decode to some text.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Iterable

EMBEDDED_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen's ChatML: what the embedded tokenizer (and a checkpoint without a template) uses
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# The text the embedded tokenizer's merges are learned from (any text still encodes: the
# alphabet is every byte).
_EMBEDDED_TEXT = """
The quick brown fox jumps over the lazy dog. Hello, world! How are you today? I am fine,
thank you. Expert-parallel mixture-of-experts models send each token to the devices that hold
the experts its router picks, run the experts there, and bring the outputs back to combine
them with the router weights. Dispatch moves tokens; combine returns them. A mesh of devices
spans one or more processes on one or more hosts, and every process runs the same program.
Once upon a time there was a small model that wanted to write a story about the sea, the
mountains, the rivers and the cities of the world. It read books, papers, letters, poems and
songs; it counted numbers: one, two, three, four, five, six, seven, eight, nine, ten, 2024,
3.14159, 42. What is the capital of France? Paris is the capital of France. Why is the sky
blue? Because air scatters blue light more than red light. Please explain how attention works
in a transformer: queries, keys and values; softmax over the scores; a weighted sum.
def main(): print("hello") return 0 # code, {brackets}, [lists], (tuples), <tags>, a = b + c * d
"""


def _token_text(value) -> str | None:
  """A tokenizer_config.json token entry: a string or {"content": ...}."""
  if isinstance(value, dict):
    return value.get("content")
  return value


def _as_list(value) -> list:
  if value is None:
    return []
  return list(value) if isinstance(value, (list, tuple)) else [value]


class TextTokenizer:
  """A `tokenizers.Tokenizer` with the end-of-sequence ids and chat template of a model."""

  def __init__(self, tokenizer, eos_ids: Iterable[int] = (), chat_template: str | None = None,
               bos_token: str | None = None, eos_token: str | None = None,
               add_bos: bool = False, source: str = ""):
    self.tokenizer = tokenizer
    self.eos_ids = tuple(sorted({int(i) for i in eos_ids}))
    self.chat_template = chat_template
    self.bos_token, self.eos_token = bos_token, eos_token
    self.add_bos = add_bos
    self.source = source

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def apply_chat_template(self, text: str) -> str:
    """One user message in the chat template, with the assistant's turn opened."""
    template = self.chat_template or CHATML_TEMPLATE
    return _compiled_template(template).render(
        messages=[{"role": "user", "content": text}], add_generation_prompt=True,
        bos_token=self.bos_token or "", eos_token=self.eos_token or "")

  def encode(self, text: str, chat: bool = False) -> list[int]:
    if chat:  # the template writes the special tokens itself (as transformers does)
      return self.tokenizer.encode(self.apply_chat_template(text), add_special_tokens=False).ids
    ids = self.tokenizer.encode(text).ids
    bos = self.tokenizer.token_to_id(self.bos_token) if self.bos_token else None
    if self.add_bos and bos is not None and ids[:1] != [bos]:
      ids = [bos] + ids
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

  def stream(self) -> "StreamDecoder":
    return StreamDecoder(self)

  def save(self, directory: str) -> None:
    """Writes tokenizer.json and tokenizer_config.json (what `from_checkpoint` reads)."""
    self.tokenizer.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos,
              "bos_token": self.bos_token, "eos_token": self.eos_token,
              "chat_template": self.chat_template}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
      json.dump(config, f, indent=1)


class StreamDecoder:
  """Decodes one sequence's tokens as they come: `add(id)` returns the text they add.

  The whole sequence is decoded again each time and the new suffix returned, so tokens that
  only form a character together (byte-level BPE) are printed once the character is complete.
  """

  def __init__(self, tok: TextTokenizer):
    self._tok, self._ids, self._printed = tok, [], ""

  def add(self, token_id: int) -> str:
    self._ids.append(int(token_id))
    text = self._tok.decode(self._ids)
    if text.endswith("\ufffd") or not text.startswith(self._printed):
      return ""  # an incomplete character, or a decoder that rewrites earlier text: wait
    piece, self._printed = text[len(self._printed):], text
    return piece

  def flush(self) -> str:
    """What is left (an incomplete character at the end decodes as U+FFFD)."""
    text = self._tok.decode(self._ids)
    piece = text[len(self._printed):] if text.startswith(self._printed) else ""
    self._printed = text
    return piece


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
  import jinja2
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.globals["raise_exception"] = raise_exception
  return env.from_string(template)


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _chat_template(config: dict, directory: str) -> str | None:
  template = config.get("chat_template")
  if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
    named = {entry.get("name"): entry.get("template") for entry in template}
    template = named.get("default") or next(iter(named.values()), None)
  jinja_file = os.path.join(directory, "chat_template.jinja")  # transformers >= 4.43 writes it
  if template is None and os.path.isfile(jinja_file):
    with open(jinja_file) as f:
      template = f.read()
  return template


def from_checkpoint(directory: str) -> TextTokenizer | None:
  """The tokenizer of a Hugging Face model directory, or None without tokenizer.json.

  End of sequence: generation_config.json's `eos_token_id` (an id or a list), else
  config.json's, else tokenizer_config.json's `eos_token`.
  """
  path = os.path.join(directory, "tokenizer.json")
  if not os.path.isfile(path):
    return None
  from tokenizers import Tokenizer

  tokenizer = Tokenizer.from_file(path)
  config = _read_json(os.path.join(directory, "tokenizer_config.json"))
  bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
  eos_ids = (_as_list(_read_json(os.path.join(directory, "generation_config.json"))
                      .get("eos_token_id"))
             or _as_list(_read_json(os.path.join(directory, "config.json")).get("eos_token_id")))
  if not eos_ids and eos is not None and tokenizer.token_to_id(eos) is not None:
    eos_ids = [tokenizer.token_to_id(eos)]
  return TextTokenizer(tokenizer, eos_ids, _chat_template(config, directory), bos, eos,
                       bool(config.get("add_bos_token", False)), source=path)


@functools.lru_cache(maxsize=4)
def _embedded_tokenizer(vocab_size: int):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(EMBEDDED_SPECIAL),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  words = _EMBEDDED_TEXT.split()
  # the text, and every word pair of it, so that there are enough merges to fill the vocabulary
  lines = [_EMBEDDED_TEXT] + [f"{a} {b}" for a, b in zip(words, words[1:])]
  tokenizer.train_from_iterator(lines, trainer)
  filler = vocab_size - tokenizer.get_vocab_size()  # ids the merges did not reach
  if filler > 0:
    from tokenizers import AddedToken
    tokenizer.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True)
                                  for i in range(filler)])
  return tokenizer


def embedded(vocab_size: int = 512) -> TextTokenizer:
  """The embedded tiny models' tokenizer: byte-level BPE, `vocab_size` ids (>= 259),
  <|endoftext|> = 0 and <|im_end|> = 2 end a sequence, ChatML chat template."""
  if vocab_size < 256 + len(EMBEDDED_SPECIAL):
    raise ValueError(f"the embedded tokenizer needs a vocabulary of at least "
                     f"{256 + len(EMBEDDED_SPECIAL)} ids (every byte and its special tokens), "
                     f"got {vocab_size}")
  import copy
  tokenizer = copy.deepcopy(_embedded_tokenizer(vocab_size))
  ids = [tokenizer.token_to_id(t) for t in EMBEDDED_SPECIAL]
  return TextTokenizer(tokenizer, (ids[0], ids[2]), CHATML_TEMPLATE, None, EMBEDDED_SPECIAL[0],
                       source="embedded byte-level BPE")
