"""attngen.hf: generated kernels inside Hugging Face transformers models (Triton interpreter). A
GPT-2 and a Llama-style model (grouped kv heads, RoPE), random weights from a small config: the loss
and every parameter's gradient agree with transformers' eager attention, and so does greedy
generation (its steps through attention_with_kvcache), left-padded prompts included, and training
on padded batches through the spec's packed module; what the kernels cannot honour (dropout, a
generation step's right padding, gradients through a cache step or through a padded batch
without the packed module) is refused."""

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM

import attngen.hf
from attngen.spec import packed
from tests import harness
from tests.strategies import spec_toml


def _causal(head_dim: int, dtype: str = "float32"):
    return harness.load_target(
        harness.spec_from_text(spec_toml("kv_idx <= q_idx", head_dim=head_dim, extra=(f'dtype = "{dtype}"',))),
        "triton_gpu",
    )


def _causal_varlen(head_dim: int):
    return harness.load_target(
        packed(harness.spec_from_text(spec_toml("kv_idx <= q_idx", head_dim=head_dim, extra=('dtype = "float32"',)))),
        "triton_gpu",
    )


def _models(make, config, name):
    """The same random weights under eager attention and under the registered attngen attention.
    Each model gets its own config: set_attn_implementation writes to the config object."""
    torch.manual_seed(0)
    eager = make(copy.deepcopy(config)).eval()
    eager.set_attn_implementation("eager")
    ours = make(copy.deepcopy(config))
    ours.load_state_dict(eager.state_dict())
    ours.set_attn_implementation(name)
    assert eager.config._attn_implementation == "eager" and ours.config._attn_implementation == name
    return eager, ours.eval()


def _loss_and_grads(model, tokens):
    loss = model(input_ids=tokens, labels=tokens).loss
    grads = torch.autograd.grad(loss, [p for p in model.parameters()])
    return loss.detach(), grads


CONFIGS = {
    "gpt2": (GPT2LMHeadModel, GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=97, n_positions=64,
                                         attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, initializer_range=0.3), 32),
    "llama": (LlamaForCausalLM, LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            hidden_size=64, intermediate_size=128, vocab_size=97,
                                            max_position_embeddings=64, initializer_range=0.3), 16),
}  # fmt: skip


@pytest.mark.parametrize("model_name", sorted(CONFIGS))
def test_a_model_trains_through_the_registered_kernels(model_name):
    make, config, head_dim = CONFIGS[model_name]
    name = attngen.hf.register(f"attngen_test_{model_name}", _causal(head_dim))
    eager, ours = _models(make, config, name)
    tokens = torch.randint(0, config.vocab_size, (2, 29), generator=torch.Generator().manual_seed(1))
    loss, grads = _loss_and_grads(ours, tokens)
    ref_loss, ref_grads = _loss_and_grads(eager, tokens)
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    for (param_name, _), grad, ref in zip(ours.named_parameters(), grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=2e-5, rtol=1e-4, msg=param_name)


@pytest.mark.parametrize("model_name", sorted(CONFIGS))
def test_a_model_trains_on_padded_batches_through_the_packed_kernels(model_name):
    """Registered with the spec's packed module, a padded batch (right padding, left padding and a
    hole) trains through attention_varlen: the loss over the tokens and every gradient as eager
    attention's with the same mask."""
    make, config, head_dim = CONFIGS[model_name]
    name = attngen.hf.register(
        f"attngen_test_padded_training_{model_name}", _causal(head_dim), varlen=_causal_varlen(head_dim)
    )
    eager, ours = _models(make, config, name)
    tokens = torch.randint(0, config.vocab_size, (3, 23), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(tokens)
    mask[0, 17:], mask[1, :6], mask[2, 9:12] = 0, 0, 0
    # No loss on the padding, nor on a token predicted from it (a pad row's output is 0 here, and
    # whatever eager's softmax over no key gives there)
    labels = tokens.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)

    def loss_and_grads(model):
        loss = model(input_ids=tokens, attention_mask=mask, labels=labels).loss
        return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))

    (loss, grads), (ref_loss, ref_grads) = loss_and_grads(ours), loss_and_grads(eager)
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    for (param_name, _), grad, ref in zip(ours.named_parameters(), grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=2e-5, rtol=1e-4, msg=param_name)


def test_under_autocast_a_bfloat16_spec_serves_as_sdpa_would():
    """Llama's RoPE leaves q and k in float32 under bf16 autocast; they are cast, as SDPA casts them."""
    make, config, head_dim = CONFIGS["llama"]
    name = attngen.hf.register("attngen_test_autocast", _causal(head_dim, "bfloat16"))
    eager, ours = _models(make, config, name)
    tokens = torch.randint(0, config.vocab_size, (2, 29), generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ours(input_ids=tokens, labels=tokens).loss.item()
    exact = eager(input_ids=tokens, labels=tokens).loss.item()
    assert abs(loss - exact) <= 2**-8 * abs(exact)  # one bf16 rounding of the loss


def test_what_the_kernels_cannot_honour_is_refused():
    make, config, head_dim = CONFIGS["gpt2"]
    name = attngen.hf.register("attngen_test_refusals", _causal(head_dim))
    _, ours = _models(make, config, name)
    tokens = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    padding = torch.ones_like(tokens)
    padding[0, 9:] = 0  # right padding
    with pytest.raises(ValueError, match="left padding only"):
        ours(input_ids=tokens, attention_mask=padding)
    with pytest.raises(ValueError, match="a padded batch runs attention_with_kvcache, which is inference only"):
        ours(input_ids=tokens, attention_mask=padding.flip(1), labels=tokens).loss.backward()
    ours.train()  # GPT-2 passes its attn_pdrop in training
    ours.config.attn_pdrop = 0.1
    for block in ours.transformer.h:
        block.attn.attn_dropout.p = 0.1
    with pytest.raises(ValueError, match="no attention dropout"):
        ours(input_ids=tokens)


@pytest.mark.parametrize("model_name", sorted(CONFIGS))
def test_greedy_generation_through_the_cache_matches_eager_attention(model_name):
    """The prompt runs `attention`, each new token `attention_with_kvcache` against transformers'
    cache: the same tokens as eager attention, and the same logits at every step."""
    make, config, head_dim = CONFIGS[model_name]
    name = attngen.hf.register(f"attngen_test_generate_{model_name}", _causal(head_dim))
    eager, ours = _models(make, config, name)
    prompt = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    _assert_generate_alike(ours, eager, prompt, torch.ones_like(prompt))


def _assert_generate_alike(ours, eager, prompt, mask, **settings):
    """Greedy generation of 4 tokens: the same tokens, and the same logits at every step."""
    runs = [
        model.generate(
            prompt,
            attention_mask=mask,
            max_new_tokens=4,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **settings,
        )
        for model in (ours, eager)
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for step, (logits, ref) in enumerate(zip(runs[0].logits, runs[1].logits, strict=True)):
        torch.testing.assert_close(logits, ref, atol=2e-5, rtol=1e-4, msg=f"step {step}")


@pytest.mark.parametrize("model_name", sorted(CONFIGS))
@pytest.mark.parametrize("varlen, cache", [(False, "dynamic"), (True, "dynamic"), (False, "static")])
def test_left_padded_prompts_generate_as_eager_attention_does(model_name, varlen, cache):
    """Prompts of 9, 4 and 6 tokens, left-padded: the padding mask becomes cache_leftpad at each
    step, and for the prompt too without the packed module (with it, attention_varlen runs the
    prompt); transformers' StaticCache passes all its slots, the mask those in use. The same tokens
    and logits as eager attention with the mask and the same cache."""
    make, config, head_dim = CONFIGS[model_name]
    packed_module = _causal_varlen(head_dim) if varlen else None
    name = attngen.hf.register(f"attngen_test_padded_{model_name}_{varlen}", _causal(head_dim), varlen=packed_module)
    eager, ours = _models(make, config, name)
    prompt = torch.randint(1, config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(prompt)
    mask[1, :5], mask[2, :3] = 0, 0
    _assert_generate_alike(
        ours, eager, prompt.masked_fill(mask == 0, 0), mask, pad_token_id=0, cache_implementation=cache
    )


def test_generation_under_torch_compile_traces_each_step_whole():
    """The model's forward under torch.compile(fullgraph=True), as compiled generation runs it (a
    static cache, left-padded prompts): no graph break (the padding mask's check is an op, the
    cache step attention_with_kvcache's ops), the same tokens and logits as eager attention."""
    make, config, head_dim = CONFIGS["llama"]
    name = attngen.hf.register("attngen_test_compiled", _causal(head_dim))
    eager, ours = _models(make, config, name)
    torch._dynamo.reset()
    ours.forward = torch.compile(ours.forward, fullgraph=True, backend="aot_eager")
    prompt = torch.randint(1, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(prompt)
    mask[1, :4] = 0
    _assert_generate_alike(
        ours, eager, prompt.masked_fill(mask == 0, 0), mask, pad_token_id=0, cache_implementation="static"
    )


def test_a_cache_step_with_gradients_is_refused():
    attention = attngen.hf.attention_function(_causal(32))
    q = torch.randn(1, 2, 1, 32, requires_grad=True)
    k = torch.randn(1, 2, 6, 32)
    with pytest.raises(ValueError, match="inference only"):
        attention(None, q, k, k, None)
    with pytest.raises(ValueError, match="more queries than keys"):
        attention(None, k, q, q, None)


def test_a_layers_sliding_window_needs_a_window_param():
    attention = attngen.hf.attention_function(_causal(32))
    q = torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match="sliding_window=4, and the spec has no `window` param"):
        attention(None, q, q, q, None, sliding_window=4)


def test_gpt_oss_trains_its_sinks_through_the_kernels():
    """gpt-oss: sliding-window and full layers, learnable sinks passed by each layer (s_aux). A spec
    with a window param and a sink trains it: loss and every gradient, the sinks' included, agree
    with transformers' eager attention (which has the sinks too)."""
    config = GptOssConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          hidden_size=64, intermediate_size=64, num_local_experts=2, num_experts_per_tok=1,
                          vocab_size=97, sliding_window=8, max_position_embeddings=64, initializer_range=0.3,
                          layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    text = spec_toml("kv_idx <= q_idx and q_idx - kv_idx < window", head_dim=16, extra=('dtype = "float32"',))
    text += '[params]\nwindow = "int"\nsinks = "float[heads]"\n[sink]\nexpr = "sinks[h]"\n'
    module = harness.load_target(harness.spec_from_text(text), "triton_gpu")
    name = attngen.hf.register("attngen_test_gpt_oss", module, params={"window": 1 << 20})  # full layers: no window
    eager, ours = _models(GptOssForCausalLM, config, name)
    for model in (eager, ours):
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=2.0, generator=torch.Generator().manual_seed(4))
    tokens = torch.randint(0, config.vocab_size, (2, 29), generator=torch.Generator().manual_seed(5))
    loss, grads = _loss_and_grads(ours, tokens)
    ref_loss, ref_grads = _loss_and_grads(eager, tokens)
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    for (param_name, _), grad, ref in zip(ours.named_parameters(), grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=2e-5, rtol=1e-4, msg=param_name)
    assert any("sinks" in n for n, _ in ours.named_parameters())


def test_a_model_with_sinks_needs_a_spec_with_one():
    attention = attngen.hf.attention_function(_causal(32))
    q = torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match="attention sinks \\(s_aux\\), and the spec none"):
        attention(None, q, q, q, None, s_aux=torch.zeros(2))


def test_a_padding_mask_is_checked_once_while_it_lives_unchanged(monkeypatch):
    """The layers of a forward share their mask: its starts are computed (and checked, a host
    synchronisation) once; a mask changed in place, or a new one, is checked again."""
    padding = attngen.hf._LeftPadding()
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    first = padding.of(mask, 4)
    assert first.tolist() == [2, 0] and first.dtype == torch.int32
    assert padding.of(mask, 4) is first
    other = torch.tensor([[0, 1, 1, 1], [0, 0, 0, 1]])
    assert padding.of(other, 4).tolist() == [1, 3] and padding.of(mask, 4) is first  # two masks kept
    mask[0, 2] = 0  # in place: its version moves on
    assert padding.of(mask, 4).tolist() == [3, 0]
    with pytest.raises(ValueError, match="left padding only"):
        padding.of(torch.tensor([[1, 0, 1, 1]]), 4)
    with pytest.raises(ValueError, match="a padding mask of shape"):
        padding.of(mask, 3)
