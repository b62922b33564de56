"""Template elements -> token ids, in batches, with a fast tokenizer.

The seed encodes every slot string separately (``tokenizer.encode(slot, add_special_tokens=False)``)
and concatenates the ids; so does :class:`TemplateEncoder`, but for a whole batch of rows in one
call to the fast tokenizer (strings repeated within a batch, such as the system prompt, are
tokenised once).
"""

from __future__ import annotations

from posttrain.data.templates import Element, HFChatTemplate, Message, Special, Template, as_messages
from posttrain.errors import ConfigError

Pair = tuple[list[int], list[int]]


class TemplateEncoder:
    """Encode conversations with ``template`` and ``tokenizer`` (a HF fast tokenizer)."""

    def __init__(self, template: Template | HFChatTemplate, tokenizer):
        self.template = template
        self.tokenizer = tokenizer
        self.eos_id = eos_token_id(template, tokenizer)

    # --- ids of elements ---------------------------------------------------------------
    def special_ids(self, special: Special) -> list[int]:
        tok = self.tokenizer
        if special.name == "eos_token":
            return [self.eos_id] if self.eos_id is not None else []
        if special.name == "bos_token":
            return [tok.bos_token_id] if tok.bos_token_id is not None else []
        tid = tok.convert_tokens_to_ids(special.name)
        if tid is None or (tok.unk_token_id is not None and tid == tok.unk_token_id):
            raise ConfigError(f"template {self.template.name}: special token {special.name!r} is not in the "
                              "tokenizer's vocabulary")
        return [tid]

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (no special tokens added), in one batched call."""
        if not texts:
            return []
        unique = list(dict.fromkeys(texts))
        ids = self.tokenizer(unique, add_special_tokens=False, return_attention_mask=False,
                             return_token_type_ids=False)["input_ids"]
        table = dict(zip(unique, ids))
        return [table[t] for t in texts]

    def encode_elements(self, rows: list[list[Element]]) -> list[list[int]]:
        texts = [e for row in rows for e in row if isinstance(e, str)]
        it = iter(self.encode_texts(texts))
        out = []
        for row in rows:
            ids: list[int] = []
            for e in row:
                ids += next(it) if isinstance(e, str) else self.special_ids(e)
            out.append(ids)
        return out

    # --- conversations -----------------------------------------------------------------
    def _pairs(self, messages, system) -> list[tuple[list[Element], list[Element]]]:
        if getattr(self.template, "needs_tokenizer", False):
            return self.template.pair_elements(messages, system, tokenizer=self.tokenizer)
        return self.template.pair_elements(messages, system)

    def encode_pairs_batch(self, conversations: list[tuple[list[Message], str | None]]) -> list[list[Pair]]:
        """``[(messages, system), ...]`` -> per conversation, ``[(source_ids, target_ids), ...]``."""
        all_pairs = [self._pairs(m, s) for m, s in conversations]
        flat = [part for pairs in all_pairs for pair in pairs for part in pair]
        ids = iter(self.encode_elements(flat))
        return [[(next(ids), next(ids)) for _ in pairs] for pairs in all_pairs]

    def encode_prompt(self, messages: list[Message] | str, system: str | None = None) -> list[int]:
        """Token ids of the prompt (history turns + last user turn + generation header)."""
        pairs = self.encode_pairs_batch([(as_messages(messages), system)])[0]
        ids: list[int] = []
        for i, (src, tgt) in enumerate(pairs):
            ids += src + (tgt if i < len(pairs) - 1 else [])
        return ids


def eos_token_id(template, tokenizer) -> int | None:
    """The id that ends an answer: ``stop_words[0]`` when the template replaces eos, else the tokenizer's."""
    if getattr(template, "replace_eos", False) and template.stop_words:
        tid = tokenizer.convert_tokens_to_ids(template.stop_words[0])
        if tid is not None and tid != tokenizer.unk_token_id:
            return tid
        ids = tokenizer.encode(template.stop_words[0], add_special_tokens=False)
        if len(ids) == 1:
            return ids[0]
        raise ConfigError(f"template {template.name}: stop word {template.stop_words[0]!r} is not one token "
                          "of this tokenizer, so it cannot replace eos; pick a template made for this model")
    return tokenizer.eos_token_id


def stop_token_ids(template, tokenizer) -> list[int]:
    """Token ids the rollout should stop on (stop words that are single tokens, plus eos)."""
    ids = []
    for word in template.get_stop_words(tokenizer):
        tid = tokenizer.convert_tokens_to_ids(word)
        if tid is not None and tid != tokenizer.unk_token_id:
            ids.append(tid)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))
