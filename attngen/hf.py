"""Hugging Face transformers: a generated Triton module as a model's attention implementation.

    import attngen, attngen.hf
    causal = attngen.load("specs/causal.toml")            # the spec's mask is the model's mask
    attngen.hf.register("attngen_causal", causal)
    # padded batches in training too: the spec's packed form
    attngen.hf.register("attngen_causal", causal, varlen=attngen.load("specs/causal.toml", varlen=True))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attngen_causal")

transformers calls the registered function with q, k, v as [batch, heads, seq, head_dim] views of
its [batch, seq, heads, head_dim] projections; the kernels read them in place, take grouped kv
heads as they are (no repeat_kv), and write the output in the [batch, seq, heads, head_dim] order
the model reshapes next: no copies. The spec owns the mask: register a causal spec for a decoder,
a sliding-window spec (param `window`) for sliding-window layers, a soft-capping spec (param
`softcap`) for Gemma-style logits, a spec with a learnable sink (`[sink] expr = "sinks[h]"`) for
gpt-oss, whose layers pass their sinks (`s_aux`) to it.

Generation (`model.generate`): a step with fewer queries than keys (the new tokens against
transformers' cache, which passes every key so far) runs the module's `attention_with_kvcache`,
whose positions are transformers': the new tokens are the sequence's last. A sliding-window layer's
cache keeps only the window's keys; masks and scores of relative positions (causal, a window,
ALiBi, soft-capping) read it right, those of absolute positions (a prefix, documents) would not.

Padded batches (transformers' padding mask), as FlashAttention-2 takes them in transformers: each
sequence's positions count from its first token, and the pad rows give 0.
- Registered with the spec's packed module (`varlen=attngen.load(spec, varlen=True)`), a forward
  over a padded batch (training, a prompt) packs the tokens the mask keeps end to end and runs its
  `attention_varlen`, gradients included; the mask may be any pattern.
- A generation step, and without the packed module a prompt too, runs `attention_with_kvcache`
  with the mask as its `cache_leftpad` (each sequence's first key): left padding only, as
  transformers pads prompts for generation. The mask is checked once per forward (one host
  synchronisation: transformers passes every layer the same mask).
- transformers' StaticCache (`cache_implementation="static"`) passes every slot of its cache and a
  mask over the first ones, those in use: their count is the cache length.

What the kernels cannot honour is refused with a clear error, never ignored: dropout, a generation
step's padding that is not left padding (right padding, holes), a static sliding-window cache,
gradients through a cache step, or through a padded batch without the packed module. Under
autocast, q, k and v are cast to its dtype first, as SDPA does (it must be the spec's).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

# transformers' keyword arguments that carry a spec param, per layer: (their name, the param's).
_PER_LAYER_PARAMS = (("sliding_window", "window"), ("softcap", "softcap"))


def attention_function(module, params: dict[str, Any] | None = None, varlen=None) -> Callable:
    """The function transformers' AttentionInterface calls, running `module.attention`.

    Args:
        module: A generated triton_gpu module (attngen.load or `attngen build`).
        params: The spec's runtime params for every layer; a layer's own `sliding_window` or
            `softcap` (as transformers passes them) sets the spec's `window` or `softcap` param.
        varlen: The spec's packed triton_gpu module (attngen.load(spec, varlen=True)), for padded
            batches (see the module doc); None: a padded batch runs attention_with_kvcache.
    """
    import torch

    fixed = dict(params or {})
    spec_params = {*module.PARAMS, *getattr(module, "TENSOR_PARAMS", {})}
    padding = _LeftPadding()
    _register_left_padding_op()

    def attngen_attention(hf_module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if dropout:
            raise ValueError(f"attngen kernels have no attention dropout (got p={dropout}): set the model's to 0")
        if query.shape[2] > key.shape[2]:
            raise ValueError(f"{query.shape[2]} queries against {key.shape[2]} keys: more queries than keys")
        device = query.device.type
        if torch.is_autocast_enabled(device):  # as SDPA does: RoPE leaves Llama's q and k in float32
            query, key, value = (x.to(torch.get_autocast_dtype(device)) for x in (query, key, value))
        layer = dict(fixed)
        sinks = kwargs.get("s_aux")  # gpt-oss: a learnable sink logit per head
        if sinks is not None:
            if not hasattr(module, "SINK_PARAM"):
                raise ValueError(
                    'the model has attention sinks (s_aux), and the spec none: add [sink] expr = "sinks[h]"'
                )
            layer[module.SINK_PARAM] = sinks
        for hf_name, param in _PER_LAYER_PARAMS:
            value_of_layer = kwargs.get(hf_name)
            if value_of_layer is None:
                continue
            if param not in spec_params:
                raise ValueError(f"the model passes {hf_name}={value_of_layer}, and the spec has no `{param}` param")
            layer[param] = value_of_layer
        if query.shape[2] == key.shape[2] and attention_mask is None:
            out = module.attention(query, key, value, scale=scaling, **layer)
            # [batch, seq, heads, head_dim]: contiguous, as the kernels wrote it in the projections' order.
            return out.transpose(1, 2), None
        if query.shape[2] == key.shape[2] and varlen is not None:
            return _unpadded(varlen, query, key, value, attention_mask, scaling, layer), None
        # A generation step (the new tokens against every key so far, the last of which are
        # theirs) or a padded batch: attention_with_kvcache, the keys as its cache (its slots in
        # use: the mask's, with a StaticCache).
        lengths = key.shape[2] if attention_mask is None else attention_mask.shape[-1]
        if lengths < key.shape[2] and kwargs.get("sliding_window") is not None:
            raise ValueError(
                "a static sliding-window cache (a mask over fewer keys than the cache's, with a window):"
                " attngen kernels read caches in position order; use the default DynamicCache"
            )
        if attention_mask is not None:
            layer["cache_leftpad"] = padding.of(attention_mask, key.shape[2])
        if torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
            what = "a padded batch" if attention_mask is not None else "a step from a cache"
            remedy = (
                "register the spec's packed module too: attngen.hf.register(..., varlen=attngen.load(spec, varlen=True))"
                if query.shape[2] == key.shape[2]
                else "train without the cache"
            )
            raise ValueError(
                f"{query.shape[2]} queries against {key.shape[2]} keys with gradients: {what} runs"
                f" attention_with_kvcache, which is inference only ({remedy})"
            )
        out = module.attention_with_kvcache(query, key, value, lengths, scale=scaling, **layer)
        return out.transpose(1, 2), None

    return attngen_attention


def _unpadded(varlen, query, key, value, mask, scale, params):
    """Attention within each sequence of the tokens the padding mask ([batch, seq], 1: a token)
    keeps, packed end to end as FlashAttention-2's unpadding packs them, by the packed module's
    attention_varlen; the padding's rows give 0. [batch, seq, heads, head_dim_v], differentiable."""
    import torch

    batch, seq = query.shape[0], query.shape[2]
    if tuple(mask.shape) != (batch, seq):
        raise ValueError(f"a padding mask of shape {tuple(mask.shape)} for {batch} sequences of {seq} tokens")
    keep = mask.bool()
    tokens = keep.flatten().nonzero().flatten()  # (a host synchronisation)
    lengths = keep.sum(-1, dtype=torch.int32)
    cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])
    packed = (x.transpose(1, 2).reshape(batch * seq, x.shape[1], x.shape[3])[tokens] for x in (query, key, value))
    out = varlen.attention_varlen(*packed, cu_seqlens, cu_seqlens, scale=scale, **params)
    return out.new_zeros(batch * seq, *out.shape[1:]).index_copy(0, tokens, out).view(batch, seq, *out.shape[1:])


class _LeftPadding:
    """Each sequence's first key from transformers' padding mask, [batch, up to kv_len] (1: a
    token; a StaticCache's covers the slots in use), as attention_with_kvcache's cache_leftpad.
    The last few masks' are kept while those masks are alive and unchanged, so that the layers of
    one forward check theirs once (a model of sliding-window and full layers passes two)."""

    KEPT = 4

    def __init__(self):
        self._kept = []  # (weak reference to a mask, its version, kv_len, its starts), the newest first

    def of(self, mask, kv_len):
        import torch

        if torch.compiler.is_compiling():  # (the check reads the mask on the host: an op torch.compile keeps whole)
            return torch.ops.attngen.left_padding(mask, kv_len)
        for kept, version, keys, starts in self._kept:
            if kept() is mask and mask._version == version and keys == kv_len:
                return starts
        if mask.dim() != 2 or mask.shape[1] > kv_len:
            raise ValueError(
                f"a padding mask of shape {tuple(mask.shape)} for {kv_len} keys: attngen kernels take a 2-D mask"
            )
        tokens = mask.bool().int()
        capturing = mask.is_cuda and torch.cuda.is_current_stream_capturing()  # (a CUDA graph cannot read it)
        if not capturing and not bool((tokens[:, 1:] >= tokens[:, :-1]).all()):  # (the host synchronisation)
            raise ValueError(
                "attngen kernels take left padding only (a mask of zeros, then ones, per sequence) from a"
                " cache, as transformers pads prompts for generation: pad on the left (tokenizer.padding_side"
                " = 'left'). A forward without a cache takes any padding with the spec's packed module:"
                " attngen.hf.register(..., varlen=attngen.load(spec, varlen=True))"
            )
        starts = (mask.shape[1] - tokens.sum(-1)).to(torch.int32)  # (the leading zeros)
        self._kept = [(weakref.ref(mask), mask._version, kv_len, starts), *self._kept[: self.KEPT - 1]]
        return starts


def _register_left_padding_op():
    """attngen::left_padding(mask, kv_len): _LeftPadding's starts as a torch op, so that torch.compile
    traces a model's forward whole (fullgraph) around it; under CUDA-graph capture the mask is not
    checked (the check reads it on the host)."""
    import torch

    if hasattr(torch.ops.attngen, "left_padding"):
        return
    checked = _LeftPadding()

    # (the schema spelled out: this module's annotations are strings, which torch does not read)
    @torch.library.custom_op("attngen::left_padding", mutates_args=(), schema="(Tensor mask, SymInt kv_len) -> Tensor")
    def left_padding(mask, kv_len):
        return checked.of(mask, kv_len).clone()  # (an op's output is its own: not the kept starts)

    @left_padding.register_fake
    def _(mask, kv_len):
        return mask.new_empty(mask.shape[:1], dtype=torch.int32)


def register(name: str, module, params: dict[str, Any] | None = None, varlen=None) -> str:
    """Register `module` as transformers attention `name` (params and varlen: attention_function's);
    returns `name` for `attn_implementation`.

    The mask function registered with it is transformers' own for FlashAttention-2: no mask at all
    without padding, else the [batch, kv_len] padding mask (see the module doc). Under torch.compile
    the mask is kept either way: whether it pads is known only where it lives (FlashAttention-2's
    function asks the device, which a whole graph cannot), and the kernels read no padding as none.
    """
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    def padding_mask(batch_size, q_length, kv_length, *args, attention_mask=None, **kwargs):
        if attention_mask is not None and torch.compiler.is_compiling():
            return attention_mask[:, -kv_length:]
        return flash_attention_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, **kwargs)

    AttentionInterface.register(name, attention_function(module, params, varlen))
    AttentionMaskInterface.register(name, padding_mask)
    return name
