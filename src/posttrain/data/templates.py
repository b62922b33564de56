"""Chat templates: ``configs/model/templates.json`` (the seed's format) and the tokenizer's own.

A template turns a conversation into *elements*: plain strings, and :class:`Special` tokens
(``bos_token``, ``eos_token`` or a literal special token) whose ids come from the tokenizer.
Turn ``t`` (0-based, one user message and its answer) renders as::

    t == 0:  prefix + format_system(system or default_system) + format_user(user)
    t  > 0:  format_separator + format_user(user)
    answer:  format_assistant(answer)          default slots: "{{content}}" + eos (no eos if efficient_eos)

``replace_eos`` makes ``stop_words[0]`` the end-of-sequence token (``<|im_end|>`` for Qwen), so the
eos slot and the rollout's stop token agree. ``template_class: ReasoningTemplate`` (qwen3) adds the
empty thought ``<think>\\n\\n</think>\\n\\n``: to the prompt when ``enable_thinking`` is false (and
strips thoughts from assistant turns), to the answer when it is true and the answer has none.
``prompt_type: hf_chat_template`` uses ``tokenizer.apply_chat_template`` instead
(:class:`HFChatTemplate`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from posttrain.errors import ConfigError, DataError
from posttrain.paths import configs_dir, shipped_file

HF_CHAT_TEMPLATE = "hf_chat_template"
CONTENT = "{{content}}"
EMPTY_THOUGHT = "<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class Special:
    """A slot that is one token id: ``bos_token``, ``eos_token`` or a literal special token."""

    name: str


Element = Union[str, Special]
Message = dict[str, str]


@dataclass(frozen=True)
class Formatter:
    slots: tuple = ()
    tool_format: str | None = None

    def apply(self, content: str = "") -> list[Element]:
        out: list[Element] = []
        for slot in self.slots:
            if isinstance(slot, str):
                if slot:
                    out.append(slot.replace(CONTENT, content))
            elif isinstance(slot, (list, tuple)):
                out.extend(Special(str(s)) for s in slot)
            elif isinstance(slot, dict) and "token" in slot:
                out.append(Special(str(slot["token"])))
            else:
                raise ConfigError(f"template slot {slot!r}: expected a string, a list such as "
                                  "[\"bos_token\"], or {\"token\": ...}")
        return out


def _formatter(spec: Any, default: Formatter) -> Formatter:
    if spec is None:
        return default
    if not isinstance(spec, dict):
        raise ConfigError(f"template formatter {spec!r} must be a mapping with 'slots'")
    slots = tuple(tuple(s) if isinstance(s, list) else s for s in spec.get("slots", ()))
    return Formatter(slots=slots, tool_format=spec.get("tool_format"))


@dataclass(frozen=True)
class Template:
    """One named chat template (LlamaFactory-style, as in the seed's templates.json)."""

    name: str
    format_user: Formatter
    format_assistant: Formatter
    format_system: Formatter
    format_function: Formatter = Formatter()
    format_observation: Formatter = Formatter()
    format_tools: Formatter = Formatter()
    format_separator: Formatter = Formatter()
    format_prefix: Formatter = Formatter()
    default_system: str = ""
    stop_words: tuple[str, ...] = ()
    efficient_eos: bool = False
    replace_eos: bool = False
    force_system: bool = False
    enable_thinking: bool = False
    thought_words: tuple[str, str] = ("<think>", "</think>")
    extra: dict = field(default_factory=dict, compare=False)

    # --- elements ---------------------------------------------------------------------
    def system_elements(self, system: str, tools: str = "") -> list[Element]:
        return self.format_system.apply(system + tools)

    def message_elements(self, messages: list[Message], system: str | None = None,
                         tools: str = "") -> list[list[Element]]:
        """Elements of each message, in order (user, assistant, user, ...)."""
        system = system or self.default_system
        out = []
        for i, message in enumerate(messages):
            elements: list[Element] = []
            if i == 0:
                elements += self.format_prefix.apply()
                if system or tools or self.force_system:
                    elements += self.system_elements(system, tools)
            elif i % 2 == 0:
                elements += self.format_separator.apply()
            elements += self._role_formatter(message).apply(message["content"])
            out.append(elements)
        return out

    def _role_formatter(self, message: Message) -> Formatter:
        role = message.get("role")
        table = {"user": self.format_user, "assistant": self.format_assistant,
                 "observation": self.format_observation, "function": self.format_function}
        if role not in table:
            raise ConfigError(f"message role {role!r} is not one of {', '.join(table)}")
        return table[role]

    def pair_elements(self, messages: list[Message], system: str | None = None,
                      tools: str = "") -> list[tuple[list[Element], list[Element]]]:
        """``[(source, target), ...]``: one pair per user/assistant turn (seed's encode_multiturn)."""
        if len(messages) % 2:
            messages = [*messages, {"role": "assistant", "content": ""}]
        per_message = self.message_elements(messages, system, tools)
        return [(per_message[i], per_message[i + 1]) for i in range(0, len(per_message), 2)]

    def prompt_elements(self, messages: list[Message] | str, system: str | None = None) -> list[Element]:
        """The prompt side of a conversation that ends with a user turn (what the rollout continues)."""
        messages = as_messages(messages)
        pairs = self.pair_elements(messages, system)
        # history turns: user + answer; the last turn: user only
        out: list[Element] = []
        for i, (src, tgt) in enumerate(pairs):
            out += src
            if i < len(pairs) - 1:
                out += tgt
        return out

    # --- text ------------------------------------------------------------------------
    def eos_text(self, tokenizer=None) -> str:
        if self.replace_eos and self.stop_words:
            return self.stop_words[0]
        return getattr(tokenizer, "eos_token", None) or ""

    def special_text(self, special: Special, tokenizer=None) -> str:
        if special.name == "eos_token":
            return self.eos_text(tokenizer)
        if special.name == "bos_token":
            return getattr(tokenizer, "bos_token", None) or ""
        return special.name

    def to_text(self, elements: list[Element], tokenizer=None) -> str:
        return "".join(e if isinstance(e, str) else self.special_text(e, tokenizer) for e in elements)

    def render_prompt(self, messages: list[Message] | str, system: str | None = None, tokenizer=None) -> str:
        """Prompt text ready for generation, e.g. ``<|im_start|>system\\n...<|im_start|>assistant\\n``."""
        return self.to_text(self.prompt_elements(messages, system), tokenizer)

    def render_conversation(self, messages: list[Message], system: str | None = None, tokenizer=None) -> str:
        """A whole conversation (prompt and answers) as training text."""
        return "".join(self.to_text(s, tokenizer) + self.to_text(t, tokenizer)
                       for s, t in self.pair_elements(messages, system))

    def get_stop_words(self, tokenizer=None) -> list[str]:
        """Strings the rollout stops on: the template's stop words, else the tokenizer's eos."""
        if self.stop_words:
            return list(self.stop_words)
        eos = getattr(tokenizer, "eos_token", None)
        return [eos] if eos else []


class ReasoningTemplate(Template):
    """qwen3: thoughts handled according to ``enable_thinking`` (see the module docstring)."""

    def remove_thought(self, text: str) -> str:
        start, end = (re.escape(w) for w in self.thought_words)
        return re.sub(rf"{start}.*?{end}\s*", "", text, flags=re.DOTALL).lstrip()

    def has_thought(self, text: str) -> bool:
        return self.thought_words[0] in text and self.thought_words[1] in text

    def pair_elements(self, messages, system=None, tools=""):
        messages = [dict(m) for m in messages]
        last_answer = messages[-1]["content"] if len(messages) % 2 == 0 else ""
        last = len(messages) - 1 if len(messages) % 2 == 0 else -1
        for i, m in enumerate(messages):  # history thoughts always go; the last answer's unless thinking
            if m["role"] == "assistant" and (i != last or not self.enable_thinking):
                m["content"] = self.remove_thought(m["content"])
        pairs = super().pair_elements(messages, system, tools)
        if not self.has_thought(last_answer) or not self.enable_thinking:
            src, tgt = pairs[-1]
            if self.enable_thinking:
                pairs[-1] = (src, [EMPTY_THOUGHT, *tgt])
            else:
                pairs[-1] = ([*src, EMPTY_THOUGHT], tgt)
        return pairs


class Llama2Template(Template):
    """llama2: the system block goes inside the first user message."""

    def message_elements(self, messages, system=None, tools=""):
        system = system or self.default_system
        out = []
        for i, message in enumerate(messages):
            elements: list[Element] = []
            content = message["content"]
            if i == 0:
                elements += self.format_prefix.apply()
                if system or tools:
                    content = self.to_text(self.system_elements(system, tools)) + content
            elif i % 2 == 0:
                elements += self.format_separator.apply()
            elements += self._role_formatter(message).apply(content)
            out.append(elements)
        return out


TEMPLATE_CLASSES = {"Template": Template, "ReasoningTemplate": ReasoningTemplate,
                    "Llama2Template": Llama2Template}


def as_messages(query: list[Message] | str) -> list[Message]:
    if isinstance(query, str):
        return [{"role": "user", "content": query}]
    return list(query)


@dataclass
class HFChatTemplate:
    """``prompt_type: hf_chat_template``: the tokenizer's own Jinja chat template.

    A turn's source is the text ``apply_chat_template`` adds for the user message (with the
    generation prompt), its target the text the assistant message adds. This needs the rendering
    of a conversation prefix to be a prefix of the whole rendering, which holds for the usual
    templates (Qwen, Llama 3); otherwise a :class:`DataError` says so.
    """

    enable_thinking: bool = False
    name: str = HF_CHAT_TEMPLATE
    stop_words: tuple[str, ...] = ()
    efficient_eos: bool = False
    needs_tokenizer: bool = True

    def _render(self, tokenizer, messages, generation_prompt: bool) -> str:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ConfigError("prompt_type hf_chat_template needs a tokenizer that has a chat_template "
                              "(tokenizer_config.json 'chat_template'); pick a template from templates.json")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                             enable_thinking=self.enable_thinking)

    def _with_system(self, messages, system):
        messages = as_messages(messages)
        return ([{"role": "system", "content": system}] if system else []) + messages

    def pair_elements(self, messages, system=None, tools="", tokenizer=None) -> list[tuple[list[str], list[str]]]:
        msgs = self._with_system(messages, system)
        first = 1 if system else 0
        pairs, done = [], ""
        for j in range(first, len(msgs), 2):
            prompt = self._render(tokenizer, msgs[: j + 1], True)
            full = (self._render(tokenizer, msgs[: j + 2], False) if j + 1 < len(msgs) else prompt)
            if not prompt.startswith(done) or not full.startswith(prompt):
                raise DataError("the tokenizer's chat template does not render conversations "
                                "incrementally (a prefix renders differently); use a templates.json prompt_type")
            pairs.append(([prompt[len(done):]], [full[len(prompt):]]))
            done = full
        return pairs

    def render_prompt(self, messages, system=None, tokenizer=None) -> str:
        return self._render(tokenizer, self._with_system(messages, system), True)

    def render_conversation(self, messages, system=None, tokenizer=None) -> str:
        return self._render(tokenizer, self._with_system(messages, system), False)

    def get_stop_words(self, tokenizer=None) -> list[str]:
        eos = getattr(tokenizer, "eos_token", None)
        return [eos] if eos else []


def default_templates_path() -> Path:
    return configs_dir() / "model" / "templates.json"


def _read_template_file(path: Path) -> dict[str, dict]:
    path = shipped_file(path)
    if not path.is_file():
        raise ConfigError(f"prompt_type_path {path}: no such file")
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: malformed JSON at line {err.lineno}, column {err.colno}: {err.msg}") from None
    if isinstance(entries, dict):
        entries = [dict(v, name=k) for k, v in entries.items()]
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "name" in e for e in entries):
        raise ConfigError(f"{path}: expected a list of templates, each with a 'name'")
    return {e["name"]: e for e in entries}


def load_templates(path: str | Path | None = None) -> dict[str, dict]:
    """Raw template specs by name: the shipped file, then ``path`` (its names win)."""
    specs: dict[str, dict] = {}
    shipped = default_templates_path()
    if shipped.is_file():
        specs.update(_read_template_file(shipped))
    if path is not None and Path(path).resolve() != shipped.resolve():
        specs.update(_read_template_file(Path(path)))
    return specs


def build_template(spec: dict, enable_thinking: bool = False) -> Template:
    name = spec["name"]
    efficient_eos = bool(spec.get("efficient_eos", False))
    user_default = Formatter(slots=(CONTENT,))
    assistant_default = Formatter(slots=(CONTENT,) if efficient_eos else (CONTENT, ("eos_token",)))
    cls_name = spec.get("template_class") or ("Llama2Template" if name.startswith("llama2") else "Template")
    if cls_name not in TEMPLATE_CLASSES:
        raise ConfigError(f"template {name}: template_class {cls_name!r} is unknown; known: "
                          f"{', '.join(TEMPLATE_CLASSES)}")
    fmt_user = _formatter(spec.get("format_user"), user_default)
    known = {"name", "format_user", "format_assistant", "format_system", "format_function",
             "format_observation", "format_tools", "format_separator", "format_prefix",
             "default_system", "stop_words", "efficient_eos", "replace_eos", "force_system",
             "template_class", "thought_words"}
    return TEMPLATE_CLASSES[cls_name](
        name=name,
        format_user=fmt_user,
        format_assistant=_formatter(spec.get("format_assistant"), assistant_default),
        format_system=_formatter(spec.get("format_system"), user_default),
        format_function=_formatter(spec.get("format_function"), Formatter()),
        format_observation=_formatter(spec.get("format_observation"), fmt_user),
        format_tools=_formatter(spec.get("format_tools"), Formatter()),
        format_separator=_formatter(spec.get("format_separator"), Formatter()),
        format_prefix=_formatter(spec.get("format_prefix"), Formatter()),
        default_system=spec.get("default_system") or "",
        stop_words=tuple(spec.get("stop_words") or ()),
        efficient_eos=efficient_eos,
        replace_eos=bool(spec.get("replace_eos", False)),
        force_system=bool(spec.get("force_system", False)),
        enable_thinking=bool(enable_thinking),
        thought_words=tuple(spec.get("thought_words") or ("<think>", "</think>")),
        extra={k: v for k, v in spec.items() if k not in known},
    )


def get_template(name: str, path: str | Path | None = None, enable_thinking: bool = False):
    """The template ``name`` from templates.json (+ ``path``), or ``hf_chat_template``.

    Unknown names raise :class:`ConfigError` listing the known ones.
    """
    if name == HF_CHAT_TEMPLATE:
        return HFChatTemplate(enable_thinking=enable_thinking)
    specs = load_templates(path)
    if name not in specs:
        where = f"{default_templates_path()}" + (f" and {path}" if path else "")
        raise ConfigError(f"prompt_type '{name}' is not a known template (looked in {where}). Known: "
                          f"{', '.join(sorted(specs) + [HF_CHAT_TEMPLATE])}. Add it to templates.json or "
                          "point prompt_type_path at a file that defines it.")
    return build_template(specs[name], enable_thinking=enable_thinking)

