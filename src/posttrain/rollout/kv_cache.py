"""KV caches for the native engine, on Hugging Face's ``Cache`` API.

``SlabLayer`` preallocates one [B, H, capacity, D] buffer per key/value and writes each step's
keys/values in place, so a decode step costs no copy of the cache (``DynamicLayer`` concatenates,
copying the whole cache every step). Models with sliding-window or linear-attention layers fall
back to ``DynamicCache``. ``select_rows`` keeps/repeats batch rows (expanding a prompt to its n
samples, dropping finished rows); ``concat_caches`` joins prefill chunks of equal length;
``to_static`` copies a prefilled slab cache into Hugging Face's ``StaticCache`` for a decode on fixed
shapes (CUDA graphs).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticCache, StaticLayer


class SlabLayer(DynamicLayer):
    """A full-attention cache layer with a preallocated sequence capacity (doubled when a write
    would pass it)."""

    def __init__(self, capacity: int, **kwargs):
        super().__init__(**kwargs)
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        batch, heads, _, dim = key_states.shape
        self.key_buf = key_states.new_empty((batch, heads, self.capacity, dim))
        self.value_buf = value_states.new_empty((batch, value_states.shape[1], self.capacity, value_states.shape[3]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:  # multi-turn rows can outgrow the first estimate: double, keep what is written
            self._grow(max(end, 2 * self.capacity))
        self.key_buf[:, :, self.length:end] = key_states
        self.value_buf[:, :, self.length:end] = value_states
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def _grow(self, capacity: int) -> None:
        for name in ("key_buf", "value_buf"):
            old = getattr(self, name)
            new = old.new_empty((old.shape[0], old.shape[1], capacity, old.shape[3]))
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)
        self.capacity = capacity

    def _refresh_views(self) -> None:
        self.keys = self.key_buf[:, :, :self.length]
        self.values = self.value_buf[:, :, :self.length]

    def get_seq_length(self) -> int:
        return self.length

    def select(self, index: torch.Tensor) -> None:
        self.key_buf = _written_rows(self.key_buf, index, self.length)
        self.value_buf = _written_rows(self.value_buf, index, self.length)
        self._refresh_views()

    def concat(self, others: list["SlabLayer"]) -> None:
        self.key_buf = torch.cat([self.key_buf] + [o.key_buf for o in others], dim=0)
        self.value_buf = torch.cat([self.value_buf] + [o.value_buf for o in others], dim=0)
        self._refresh_views()


def _written_rows(buf: torch.Tensor, index: torch.Tensor, length: int) -> torch.Tensor:
    """A slab of ``buf``'s capacity holding its rows ``index`` (repeated where ``index`` repeats):
    only the ``length`` written positions are copied, the rest stays unwritten, as in any slab."""
    out = buf.new_empty((index.numel(), *buf.shape[1:]))
    torch.index_select(buf[:, :, :length], 0, index, out=out[:, :, :length])
    return out


def new_cache(model: Any, capacity: int) -> Cache:
    """A cache for ``capacity`` positions: slab layers when every layer is plain full attention."""
    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        return DynamicCache()
    cache = DynamicCache(config=config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [SlabLayer(capacity) for _ in cache.layers]
    return cache


def slab_model(model: Any) -> bool:
    """Whether ``model``'s caches are slab caches (every layer plain full attention)."""
    layers = new_cache(model, 1).layers
    return bool(layers) and all(isinstance(layer, SlabLayer) for layer in layers)


def _initialized(layer) -> bool:
    return bool(getattr(layer, "is_initialized", False)) and getattr(layer, "keys", None) is not None


def concat_caches(caches: list[Cache]) -> Cache:
    """Concatenate caches of equal sequence length along the batch dimension (into the first)."""
    first = caches[0]
    for layer_idx, layer in enumerate(first.layers):
        if len(caches) == 1 or not _initialized(layer):
            continue
        others = [c.layers[layer_idx] for c in caches[1:]]
        if isinstance(layer, SlabLayer):
            layer.concat(others)
        else:
            layer.keys = torch.cat([layer.keys] + [o.keys for o in others], dim=0)
            layer.values = torch.cat([layer.values] + [o.values for o in others], dim=0)
    return first


def select_rows(cache: Cache, index: torch.Tensor) -> None:
    """Keep (and repeat, where ``index`` repeats) the batch rows ``index`` of every layer, in place."""
    for layer in cache.layers:
        if not _initialized(layer):
            continue
        if isinstance(layer, SlabLayer):
            layer.select(index)
        elif layer.keys.numel() > 0:
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)


def slab_only(cache: Cache) -> bool:
    """Whether every layer is an initialized slab (so :func:`take_rows` / :func:`put_rows` apply)."""
    return bool(cache.layers) and all(isinstance(layer, SlabLayer) and layer.is_initialized for layer in cache.layers)


def take_rows(cache: Cache, index: torch.Tensor, extra: int) -> Cache:
    """A new slab cache with copies of the rows ``index`` and room for ``extra`` more positions: a
    forward step over some rows only (the rest of the batch is not computed)."""
    sub = DynamicCache()
    sub.layers = []
    for layer in cache.layers:
        part = SlabLayer(layer.length + extra)
        part.lazy_initialization(layer.key_buf[index, :, :0], layer.value_buf[index, :, :0])
        part.key_buf[:, :, :layer.length] = layer.key_buf[index, :, :layer.length]
        part.value_buf[:, :, :layer.length] = layer.value_buf[index, :, :layer.length]
        part.length = layer.length
        part._refresh_views()
        sub.layers.append(part)
    return sub


def put_rows(cache: Cache, sub: Cache, index: torch.Tensor) -> None:
    """Write the positions that ``sub`` (from :func:`take_rows`) added back into rows ``index``; the
    other rows get the same number of positions, unwritten (the caller masks them)."""
    for layer, part in zip(cache.layers, sub.layers):
        start, end = layer.length, part.length
        if end > layer.capacity:
            layer._grow(max(end, 2 * layer.capacity))
        # zeros for the other rows: masked positions must still be finite (0 x NaN is NaN in attention)
        layer.key_buf[:, :, start:end] = 0
        layer.value_buf[:, :, start:end] = 0
        layer.key_buf[index, :, start:end] = part.key_buf[:, :, start:end]
        layer.value_buf[index, :, start:end] = part.value_buf[:, :, start:end]
        layer.length = end
        layer._refresh_views()


def to_static(cache: Cache, model: Any, capacity: int) -> StaticCache | None:
    """A ``StaticCache`` of ``capacity`` positions holding the rows of a prefilled slab cache; None
    when the model has layers other than full attention (the caller keeps the dynamic cache)."""
    if not slab_only(cache):
        return None
    static = StaticCache(config=model.config, max_cache_len=capacity)
    if len(static.layers) != len(cache.layers) or any(type(layer) is not StaticLayer for layer in static.layers):
        return None
    for layer, slab in zip(static.layers, cache.layers):
        layer.lazy_initialization(slab.keys, slab.values)
        layer.keys[:, :, :slab.length] = slab.keys
        layer.values[:, :, :slab.length] = slab.values
        layer.cumulative_length.fill_(slab.length)
    return static
