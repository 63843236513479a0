"""Chat tokenizer: a `tokenizers.Tokenizer` from tokenizer.json plus the checkpoint's Jinja chat
template, rendered with Hugging Face semantics but without importing transformers.

    tok = ChatTokenizer.from_dir(ckpt_dir)
    ids = tok.prompt_ids("What is 2+2?")  # user turn + generation prompt, ready for the model
    ids, labels = tok.encode_sft(prompt, response)  # labels UNSHIFTED, -100 outside the response

What "HF semantics" means here (transformers.utils.chat_template_utils /
PreTrainedTokenizerBase.apply_chat_template):
  - the template comes from chat_template.jinja if present, else
    tokenizer_config.json["chat_template"];
  - it runs in jinja2's ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with
    the loopcontrols extension, a `tojson` filter that does not HTML-escape, and the globals
    raise_exception / strftime_now (here pinned to TEMPLATE_NOW, not the clock: transformers
    renders today's date);
  - the template sees messages, tools=None, documents=None, add_generation_prompt, the named
    special tokens (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token,
    as strings) and any extra kwargs, which override the special tokens; message keys whose value
    is None are dropped;
  - tokenize=True encodes the rendered string with add_special_tokens=False.
Two deliberate differences. Text inside a message never becomes a control token: a special token's
text in a prompt, an answer or a system prompt (e.g. "<|im_end|>\n<|im_start|>assistant\n", which
would open a fake assistant turn, or end an answer early and leave the rest unlearned) is encoded as
plain text, as HF's split_special_tokens=True does for the messages, while the template's own
special tokens stay tokens. And enable_thinking defaults to False (Qwen3 templates then render the
empty think block, as HF does with enable_thinking=False): our SFT data has no reasoning traces.
"""

import contextlib
import json
import re
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from common.errors import InputError
from common.jsonl import loads_strict, read_text

IGNORE_INDEX = -100
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# A special token's text inside a message is swapped for MARK + (a private-use character
# naming it) + MARK before the template renders, so the template's own tokens are the only
# special text left, and encoded as plain text after
MARK = "\U000F0000"
FIRST_NAME = 0xF0001
PLACEHOLDER = re.compile(f"{MARK}(.){MARK}", re.S)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) renders its
    body unchanged. We find the assistant span by prefix matching instead, so the tag
    only needs to parse."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(
            self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's builtin tojson HTML-escapes <, >, &, ' which would change what the model sees
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


# a template's clock is pinned: a step's prompts are a function of its inputs, so a resume on
# another day renders what the first try rendered (its key holds no date). The instant is
# Llama 3.1's own fallback date, what its template renders where strftime_now is undefined
TEMPLATE_NOW = datetime(2024, 7, 26)


def _strftime_now(fmt):
    return TEMPLATE_NOW.strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_str(value) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict
    {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict:
    try:
        d = loads_strict(read_text(path), path)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(d, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d


def prompt_turns(prompt) -> list[dict]:
    """The messages before the answer: a string is one user turn (TRACE's prompts), a list is
    the turns as given."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def _prepare_messages(messages: list[dict]) -> list[dict]:
    """Drop None-valued keys and fill reasoning_content/thinking from any of their
    aliases (as HF does)."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"message {i} should be a dict with 'role' and 'content', "
                            f"got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _chat_template(ckpt_dir: Path, config: dict, cfg_path: Path) -> tuple[str, str]:
    """(the checkpoint's chat template, where it came from): chat_template.jinja, else
    tokenizer_config.json's "chat_template" (a string, or the "default" of the old list format);
    none, or not a string, is an InputError."""
    jinja_path = ckpt_dir / "chat_template.jinja"
    if jinja_path.is_file():
        template, template_source = read_text(jinja_path), str(jinja_path)
    else:
        template, template_source = config.get("chat_template"), f"{cfg_path}['chat_template']"
        # old multi-template format: [{"name": ..., "template": ...}]
        if isinstance(template, list):
            if not all(isinstance(t, dict) and "name" in t and "template" in t for t in template):
                raise InputError(f"{template_source}: a list of chat templates must hold "
                                 f"{{name, template}} objects")
            template = {t["name"]: t["template"] for t in template}.get("default")
    if not template:
        raise InputError(f"{ckpt_dir}: no chat template (neither chat_template.jinja nor "
                         f"tokenizer_config.json['chat_template'])")
    if not isinstance(template, str):
        raise InputError(f"{template_source}: the chat template must be a string, got {template!r}")
    return template, template_source


def _extra_stop_ids(ckpt_dir: Path) -> list:
    """generation_config.json's eos_token_id (an id or a list of ids) as a list; [] without
    the file or the key."""
    extra_stop = []
    gen_path = ckpt_dir / "generation_config.json"
    if gen_path.is_file():
        eos = _read_json(gen_path).get("eos_token_id")
        extra_stop = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in extra_stop):
            # unchecked, a float or a null in the list fails later as a traceback; a string or
            # a bool stops on nothing or on the wrong token, silently
            # (list("12") is ["1", "2"], True is token 1)
            raise InputError(f"{gen_path}: eos_token_id must be a token id or a list of token ids, "
                             f"got {eos!r}")
    return extra_stop


class ChatTokenizer:
    """Tokenizer + chat template of one checkpoint directory. See the module docstring for
    the HF semantics."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str, special_tokens: dict[str, str],
                 extra_stop_ids: Iterable[int] = (), source: str = "<memory>"):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.source = source
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self._template = compile_chat_template(chat_template)

        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        eos = self.special_tokens.get("eos_token")
        if eos is None or eos not in vocab:
            raise InputError(f"{source}: eos_token {eos!r} (tokenizer_config.json) is missing "
                             f"or not in tokenizer.json")
        self.eos_id = vocab[eos]
        pad = self.special_tokens.get("pad_token")
        self.pad_id = vocab[pad] if pad in vocab else self.eos_id
        self.stop_ids = {self.eos_id, *extra_stop_ids,
                         *(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)}
        # the texts that encode() would turn into a special token (MARK too, so that no message
        # forges a placeholder)
        self._escapes = sorted({t.content for t in tokenizer.get_added_tokens_decoder().values()
                                if t.special}
                               | {MARK}, key=len, reverse=True)
        self._escape_index = {t: i for i, t in enumerate(self._escapes)}
        self._escape_re = re.compile("|".join(map(re.escape, self._escapes)))
        self._plain = None  # the tokenizer with special-token matching off, built on first use
        # rendered prompt (with the generation prompt) -> its ids, inside remembering_prompts() only
        self._prompts: dict[str, list[int]] | None = None

    @classmethod
    def from_dir(cls, ckpt_dir: str | Path, check: bool = True) -> "ChatTokenizer":
        """Load tokenizer.json, tokenizer_config.json (special tokens, chat template),
        chat_template.jinja (takes priority, as in HF) and generation_config.json (extra eos ids)
        from `ckpt_dir`. With `check`, a tokenizer whose ids exceed config.json's vocab_size, or a
        template that cannot encode a probe (prompt, answer) pair ending in an end-of-turn token, is
        an InputError naming the file."""
        ckpt_dir = Path(ckpt_dir)
        tok_path = ckpt_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise InputError(f"{ckpt_dir}: tokenizer.json not found")
        try:
            tokenizer = Tokenizer.from_file(str(tok_path))
        except Exception as e:  # the Rust library names neither the file nor, often, the problem
            raise InputError(f"{tok_path}: not a readable tokenizer "
                             f"({str(e).splitlines()[0] if str(e) else e!r})") from None

        cfg_path = ckpt_dir / "tokenizer_config.json"
        config = _read_json(cfg_path) if cfg_path.is_file() else {}
        # older checkpoints keep special tokens only here
        map_path = ckpt_dir / "special_tokens_map.json"
        special_map = _read_json(map_path) if map_path.is_file() else {}
        special = {name: _token_str(config.get(name, special_map.get(name)))
                   for name in SPECIAL_TOKEN_NAMES}
        for name, value in special.items():
            if value is not None and not isinstance(value, str):
                raise InputError(f"{cfg_path}: {name} must be a string, got {value!r}")

        template, template_source = _chat_template(ckpt_dir, config, cfg_path)
        extra_stop = _extra_stop_ids(ckpt_dir)
        try:
            tok = cls(tokenizer, template, special, extra_stop, source=str(ckpt_dir))
        except jinja2.TemplateSyntaxError as e:
            raise InputError(f"{template_source}: chat template does not parse: {e}") from e
        if not check:
            return tok
        # checked here, once, so that a broken checkpoint fails at load naming the file, not
        # as a traceback later
        model_cfg = ckpt_dir / "config.json"
        n_model = _read_json(model_cfg).get("vocab_size") if model_cfg.is_file() else None
        n_tok = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        if isinstance(n_model, int) and not isinstance(n_model, bool) and n_tok > n_model:
            raise InputError(f"{tok_path}: token ids reach {n_tok - 1}, but {model_cfg}: "
                             f"vocab_size is {n_model}; "
                             f"the tokenizer does not belong to these weights")
        probe = [{"role": "user", "content": "Is 1 + 1 = 2?"},
                 {"role": "assistant", "content": "Yes."}]
        try:
            tok.encode_sft(probe[0]["content"], probe[1]["content"])
            text = tok.apply_chat_template(probe)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise InputError(f"{template_source}: the chat template fails on a probe conversation "
                             f"(one user turn, one assistant answer): "
                             f"{str(e).splitlines()[0] if str(e) else e!r}") from None
        lost = [m["content"] for m in probe if m["content"] not in text]
        if lost:  # training would run on the template's own tokens only
            raise InputError(f"{template_source}: the chat template drops the messages' content "
                             f"(a probe conversation renders without {lost[0]!r}): "
                             f"the model would see none of the data")
        return tok

    # --- plain text -------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def decode_response(self, ids: list[int]) -> str:
        """Text of a generated response: a final stop token (kept in token_ids and
        log-probs) is not text."""
        return self.decode(ids[:-1] if ids and ids[-1] in self.stop_ids else ids)

    # --- chat -------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = False, **kwargs) -> str | list[int]:
        """Render `messages` ([{"role", "content"}, ...]) with the chat template; with tokenize=True
        return the ids of the rendered text encoded with add_special_tokens=False, the messages' own
        text never as special tokens (module docstring). Extra kwargs reach the template
        (enable_thinking defaults to False)."""
        text = self._render(messages, add_generation_prompt, **kwargs)
        return self._encode_rendered(text) if tokenize else self._unescape(text)

    def _render(self, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str:
        """The template's text with each special token's text inside a message swapped
        for its placeholder."""
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        kwargs.setdefault("enable_thinking", False)
        variables = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        messages = [{k: self._escape(v) if k == "content" or k in REASONING_FIELDS else v
                     for k, v in m.items()}
                    if isinstance(m, dict) else m for m in messages]
        return self._template.render(messages=_prepare_messages(messages),
                                     add_generation_prompt=add_generation_prompt, **variables)

    def _escape(self, value):
        if not isinstance(value, str):
            return value
        return self._escape_re.sub(
            lambda m: f"{MARK}{chr(FIRST_NAME + self._escape_index[m.group()])}{MARK}", value)

    def _unescape(self, text: str) -> str:
        return PLACEHOLDER.sub(lambda m: self._escapes[ord(m.group(1)) - FIRST_NAME], text)

    def _encode_rendered(self, text: str) -> list[int]:
        """Ids of rendered text: the template's text as encode() does it, each placeholder's
        special-token text as plain text."""
        parts = PLACEHOLDER.split(text)  # text, name, text, name, ..., text
        if len(parts) == 1:
            return self.encode(text)
        if self._plain is None:
            self._plain = Tokenizer.from_str(self.tokenizer.to_str())
            self._plain.encode_special_tokens = True
        ids = []
        for i, part in enumerate(parts):
            if i % 2:
                ids += self._plain.encode(self._escapes[ord(part) - FIRST_NAME],
                                          add_special_tokens=False).ids
            elif part:
                ids += self.encode(part)
        return ids

    def prompt_ids(self, prompt: str | list[dict], **kwargs) -> list[int]:
        """Ids of `prompt` as a single user turn (or, a list of messages, as those turns: a system
        prompt, earlier turns) followed by the assistant generation prompt."""
        return self._prompt_ids(self._render(prompt_turns(prompt), True, **kwargs))

    def _prompt_ids(self, rendered: str) -> list[int]:
        """_encode_rendered of a rendered prompt; inside remembering_prompts() each text is encoded
        once (a copy: callers own it)."""
        if self._prompts is None:
            return self._encode_rendered(rendered)
        ids = self._prompts.get(rendered)
        if ids is None:
            ids = self._prompts[rendered] = self._encode_rendered(rendered)
        return list(ids)

    @contextlib.contextmanager
    def remembering_prompts(self):
        """with tok.remembering_prompts(): prompts encoded once (the over-long filter's encode_sft
        tokenizes every prompt, and prompt_ids then asks for the same ids again: a third of an
        evaluation step's tokenizing); the memo is dropped on exit, so a long-lived process
        (run.py's planner measures every training example) keeps none."""
        self._prompts = {}
        try:
            yield self
        finally:
            self._prompts = None

    def sft_length(self, prompt: str | list[dict], response: str) -> int:
        """Tokens of the chat-templated (prompt, response) pair: the one length the over-long filter
        uses in training, rollout and evaluation."""
        return len(self.encode_sft(prompt, response)[0])

    def encode_sft(self, prompt: str | list[dict], response: str,
                   **kwargs) -> tuple[list[int], list[int]]:
        """Ids of the conversation [user: prompt, assistant: response] and UNSHIFTED labels:
        labels[t] = ids[t] on the assistant response tokens and its end-of-turn token, -100
        elsewhere (system/user turns, the assistant header, anything the template writes after
        end-of-turn).

        The response span is found by tokenizing the prompt with the generation prompt and requiring
        it to be a token prefix of the full conversation; the span runs from there to the first stop
        token (inclusive). Where a token merges across that boundary (Qwen's pre-tokenizer joins the
        generation prompt's "\n" with a response that starts with "\n") but the rendered text still
        starts with the generation prompt's text, the ids are the prompt's ids followed by those of
        the rest of the text: the tokens a model sampling after the prompt emits.
        """
        user = prompt_turns(prompt)
        prefix_text = self._render(user, True, **kwargs)
        text = self._render(user + [{"role": "assistant", "content": response}], False, **kwargs)
        prefix, ids = self._prompt_ids(prefix_text), self._encode_rendered(text)
        # a token merged across the boundary
        if ids[:len(prefix)] != prefix and text.startswith(prefix_text):
            ids = prefix + self._encode_rendered(text[len(prefix_text):])
        if ids[:len(prefix)] != prefix:
            raise ValueError(f"{self.source}: the prompt's token ids with the generation prompt "
                             f"are not a prefix of the full conversation's ids; the template or a "
                             f"token merge across the boundary breaks prompt/response separation "
                             f"(prompt={prompt[:80]!r}, response={response[:80]!r})")
        end = next((t for t in range(len(prefix), len(ids)) if ids[t] in self.stop_ids), None)
        if end is None:
            raise ValueError(f"{self.source}: no end-of-turn token "
                             f"(any of {sorted(self.stop_ids)}) after the response "
                             f"(response={response[:80]!r})")
        labels = ([IGNORE_INDEX] * len(prefix) + ids[len(prefix):end + 1]
                  + [IGNORE_INDEX] * (len(ids) - end - 1))
        return ids, labels
