"""Handlers: aligned conversations -> token id sequences per output key (``HANDLERS``, by class name).

=========================================  ==================================================
R1AlpacaStyleInstructionHandler            RL prompts: ``input_ids`` = prompt side of the template
Math17kAlpacaStyleInstructionHandler       (all turn sources), ``attention_mask`` = ones,
                                           ``labels`` = answer ids, other extra keys = column ids
AlpacaStyleInstructionHandler              SFT: ``input_ids``, ``attention_mask``, ``labels``
                                           (-100 on prompt tokens), pack mode
AlpacaStylePairwiseHandler                 DPO/RM: ``chosen_input_ids``, ``chosen_labels``,
                                           ``rejected_input_ids``, ``rejected_labels``
UnpairedPreferenceHandler (posttrain)      KTO: ``input_ids``, ``labels`` (-100 on the prompt),
                                           ``desirable`` (one id: 1 desirable, 0 undesirable)
=========================================  ==================================================
"""

from __future__ import annotations

from posttrain.data import align
from posttrain.data.encoding import TemplateEncoder
from posttrain.errors import ConfigError
from posttrain.registry import Registry

IGNORE_INDEX = -100
Encoded = dict[str, list[int]]


class Handler:
    """Base: ``align(row)`` then ``encode_batch(aligned)``; subclasses set the details."""

    needed_keys: tuple[str, ...] = ("prompt", "response")
    uses_template = True  # registered handlers accept any prompt_type
    align_fn = staticmethod(align.align_alpaca)

    def __init__(self, cfg, tokenizer, template):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.encoder = TemplateEncoder(template, tokenizer)
        self.extra_keys = list(cfg.dataset_additional_keys)
        self.keys: dict[str, str | None] = {}

    def bind_columns(self, columns: list[str]) -> None:
        """Check map_keys and extra keys against the input's columns."""
        self.keys = align.resolve_map_keys(self.map_keys(columns), columns, self.needed_keys)
        missing = [k for k in self.extra_keys if k != "labels" and k not in columns]
        if missing:
            raise ConfigError(f"dataset_additional_keys: column(s) {', '.join(missing)} not in the input. "
                              f"The input has columns: {', '.join(sorted(columns))}.")

    def map_keys(self, columns: list[str]) -> dict | None:
        """The ``map_keys`` the columns are resolved with (the config's)."""
        return self.cfg.map_keys

    def output_keys(self) -> list[str]:
        raise NotImplementedError

    def align(self, row: dict) -> align.Aligned | str:
        return self.align_fn(row, self.keys, self.extra_keys)

    def encode_batch(self, items: list[align.Aligned]) -> list[Encoded]:
        raise NotImplementedError


class R1AlpacaStyleInstructionHandler(Handler):
    """RL prompts with the ground-truth answer as ``labels``."""

    def output_keys(self) -> list[str]:
        extra = [k for k in self.extra_keys if k not in ("input_ids", "attention_mask")]
        return ["input_ids", "attention_mask", *extra]

    def encode_batch(self, items):
        convs = [(a.prompt + [{"role": "assistant", "content": a.responses[0]}], a.system or None) for a in items]
        pairs = self.encoder.encode_pairs_batch(convs)
        answers = self.encoder.encode_texts([a.responses[0] for a in items])
        extra = [k for k in self.output_keys()[2:] if k != "labels"]
        extra_ids = {k: self.encoder.encode_texts([align.text(a.extras.get(k)) for a in items]) for k in extra}
        out = []
        for i, conv_pairs in enumerate(pairs):
            ids = [t for src, _ in conv_pairs for t in src]  # prompt side only; history answers dropped
            enc = {"input_ids": ids, "attention_mask": [1] * len(ids)}
            if "labels" in self.extra_keys:
                enc["labels"] = answers[i]
            for k in extra:
                enc[k] = extra_ids[k][i]
            out.append(enc)
        return out


class Math17kAlpacaStyleInstructionHandler(R1AlpacaStyleInstructionHandler):
    """DAPO-Math-17k rows: prompt is a message list, reward_model.ground_truth the answer."""

    align_fn = staticmethod(align.align_math17k)


class AlpacaStyleInstructionHandler(Handler):
    """SFT. ``labels`` = -100 on prompt tokens, the token ids on answers (the model shifts them)."""

    def output_keys(self) -> list[str]:
        return ["input_ids", "attention_mask", "labels"]

    def encode_batch(self, items):
        convs = [(a.prompt + [{"role": "assistant", "content": a.responses[0]}], a.system or None) for a in items]
        out = []
        eos = self.encoder.eos_id
        for conv_pairs in self.encoder.encode_pairs_batch(convs):
            ids: list[int] = []
            labels: list[int] = []
            for src, tgt in conv_pairs:
                ids += src + tgt
                labels += [IGNORE_INDEX] * len(src) + tgt
            if eos is not None and (self.encoder.template.efficient_eos
                                    or (self.cfg.append_eod and (not ids or ids[-1] != eos))):
                ids.append(eos)
                labels.append(eos)
            out.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
        return out


class AlpacaStylePairwiseHandler(Handler):
    """DPO and reward models: prompt + chosen, prompt + rejected; labels -100 on the prompt."""

    needed_keys = ("prompt",)
    align_fn = staticmethod(align.align_pairwise)

    def output_keys(self) -> list[str]:
        return ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]

    def encode_batch(self, items):
        convs = []
        for a in items:
            for answer in a.responses[:2]:
                convs.append((a.prompt + [{"role": "assistant", "content": answer}], a.system or None))
        encoded = self.encoder.encode_pairs_batch(convs)
        add_eos = self.encoder.template.efficient_eos and self.encoder.eos_id is not None
        out = []
        for i in range(len(items)):
            enc: Encoded = {}
            for name, conv_pairs in (("chosen", encoded[2 * i]), ("rejected", encoded[2 * i + 1])):
                prompt = [t for src, tgt in conv_pairs[:-1] for t in src + tgt] + conv_pairs[-1][0]
                answer = conv_pairs[-1][1] + ([self.encoder.eos_id] if add_eos else [])
                enc[f"{name}_input_ids"] = prompt + answer
                enc[f"{name}_labels"] = [IGNORE_INDEX] * len(prompt) + answer
            out.append(enc)
        return out


class UnpairedPreferenceHandler(AlpacaStyleInstructionHandler):
    """KTO (posttrain; the seed has no unpaired data): rows of a prompt, one completion and a bool
    ``label`` (true: desirable). Encoded as SFT rows plus ``desirable`` = ``[1]`` or ``[0]``. The
    columns default to TRL's names ``prompt`` / ``completion`` / ``label`` where the input has them
    and ``map_keys`` does not say otherwise; a missing or non-bool label stops preprocessing with
    the row named (:class:`~posttrain.data.align.RowError`)."""

    align_fn = staticmethod(align.align_unpaired)
    TRL_COLUMNS = {"prompt": "prompt", "response": "completion"}

    def __init__(self, cfg, tokenizer, template):
        if cfg.pack:
            raise ConfigError("pack: true with handler_name: UnpairedPreferenceHandler: each KTO row is trained "
                              "with its own label, so rows cannot be packed; set pack: false")
        super().__init__(cfg, tokenizer, template)

    def map_keys(self, columns: list[str]) -> dict:
        given = dict(self.cfg.map_keys or {})
        return {**{k: c for k, c in self.TRL_COLUMNS.items() if k not in given and c in columns}, **given}

    def output_keys(self) -> list[str]:
        return ["input_ids", "labels", "desirable"]

    def encode_batch(self, items):
        rows = super().encode_batch(items)
        return [{"input_ids": enc["input_ids"], "labels": enc["labels"], "desirable": [int(item.extras["label"])]}
                for enc, item in zip(rows, items)]


# handler_name -> Handler subclass; register one with @HANDLERS.register("MyHandler").
HANDLERS = Registry("data handler", key="handler_name")
for _cls in (R1AlpacaStyleInstructionHandler, Math17kAlpacaStyleInstructionHandler,
             AlpacaStyleInstructionHandler, AlpacaStylePairwiseHandler, UnpairedPreferenceHandler):
    HANDLERS.add(_cls.__name__, _cls)


