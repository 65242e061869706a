"""Whole models through transformers' attention registry: attngen against SDPA and eager, on a GPU.

Models from configs, random weights (nothing is downloaded): GPT-2 small (12 layers, 12 heads of
64, 1k tokens), a Llama-style model (grouped kv heads 16/4 of 128, RoPE, 2k tokens) and a
gpt-oss-style one (sliding-window and full layers, learnable sinks, mixture of experts; transformers
offers it no SDPA, and FlashAttention has no backward for its sinks). Each trains with bf16
autocast over float32 weights and AdamW, under attngen (`attngen.hf.register` with
specs/causal.toml at the model's head dim; for gpt-oss, causal + window + sinks) and transformers'
"sdpa" (where the model takes it) and "eager".

  1. Agreement: from the same weights and batch, the loss and the gradient of every weight under
     each implementation against float32 eager (no autocast, TF32 off). attngen passes when its
     errors are at most twice the largest of the peers' (their bf16 noise; for
     the loss, a single number, at least half a bf16 ulp of it).
  2. Speed and memory: `--steps` optimizer steps after three warm-up steps, per implementation;
     tokens/s and peak allocated memory over those steps.

With `--generate`, instead, with bf16 weights and transformers' DynamicCache (attngen's prompt
runs `attention`, each later token `attention_with_kvcache`):
  1. Agreement: the prompt, then 16 given tokens one at a time through the cache; the logits of
     those 16 steps under each implementation against float32 eager's (relative error of all of
     them as one vector); attngen passes within twice the largest of the peers'. (Greedy tokens
     are not compared: with random weights the logits are nearly flat, and bf16 rounding tips ties.)
  2. Speed: greedy generation (`model.generate`) of `--new-tokens` tokens after a `--prompt`-token
     prompt, after one warm-up generation: new tokens/s.
With `--padded`, the batch's prompts are of unequal length, left-padded as transformers pads them
for generation (sequence b has b / (2 x batch) of the prompt as padding; attngen runs the prompt
through the spec's packed module, attention_varlen, and each step through attention_with_kvcache
with cache_leftpad). With `--compiled`, every implementation generates from transformers' StaticCache
with the model's forward under torch.compile(mode="reduce-overhead", fullgraph=True): each step
traced whole (attngen's through its custom ops) and replayed as a CUDA graph, without the host time
of eager calls.

    python bench/models.py [--only gpt2-small,llama-style] [--steps 10] [--generate [--prompt 512] [--new-tokens 64] [--padded] [--compiled]]

Prints a table last; writes results.json to $OUT (or ./bench-out).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
import triton
from transformers import GPT2Config, GPT2LMHeadModel, GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attngen.hf
from attngen import load
from attngen.spec import load_spec, parse_spec, retarget

ROOT = Path(__file__).resolve().parent.parent
# gpt-oss's attention: causal, a window on its sliding layers (full layers: no window), a sink per head.
GPT_OSS_SPEC = """name = "gpt_oss"
head_dim = 64
dtype = "bfloat16"
[mask]
expr = "q_idx >= kv_idx and q_idx - kv_idx < window"
[params]
window = "int"
sinks = "float[heads]"
[sink]
expr = "sinks[h]"
"""


@dataclass(frozen=True)
class Model:
    name: str
    make: type
    config: object
    head_dim: int
    batch: int
    seq: int
    peers: tuple[str, ...] = ("sdpa", "eager")
    spec: str | None = None  # spec text; None: specs/causal.toml at head_dim
    params: dict | None = None  # the spec's params for every layer

    @property
    def impls(self) -> tuple[str, ...]:
        return ("attngen", *self.peers)


MODELS = (
    Model("gpt2-small", GPT2LMHeadModel,
          GPT2Config(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257,
                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
          head_dim=64, batch=8, seq=1024),
    Model("llama-style", LlamaForCausalLM,
          LlamaConfig(num_hidden_layers=8, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                      intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096),
          head_dim=128, batch=4, seq=2048),
    Model("gpt-oss-style", GptOssForCausalLM,
          GptOssConfig(num_hidden_layers=8, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                       head_dim=64, intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2,
                       vocab_size=32000, sliding_window=128, max_position_embeddings=4096,
                       layer_types=["sliding_attention", "full_attention"] * 4),
          head_dim=64, batch=4, seq=2048, peers=("eager",), spec=GPT_OSS_SPEC, params={"window": 1 << 30}),
)  # fmt: skip


def models(model: Model, impls, state=None):
    """One model per implementation, all with the same random weights."""
    torch.manual_seed(0)
    first = model.make(copy.deepcopy(model.config))
    state = state or first.state_dict()
    for impl in impls:
        m = model.make(copy.deepcopy(model.config))  # set_attn_implementation writes to the config
        m.load_state_dict(state)
        m.set_attn_implementation(impl)
        yield m.cuda().train()


def loss_and_grads(m, tokens, autocast: bool):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = m(input_ids=tokens, labels=tokens).loss
    grads = torch.autograd.grad(loss, list(m.parameters()))
    return loss.item(), [g.float() for g in grads]


def agreement(model: Model, names: dict, tokens) -> dict:
    """Loss error and the gradients' relative error (all weights as one vector) against float32."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    (reference,) = models(model, ["eager"])
    ref_loss, ref_grads = loss_and_grads(reference, tokens, autocast=False)
    del reference
    ref_norm = torch.stack([g.norm() ** 2 for g in ref_grads]).sum().sqrt().item()
    errors = {}
    for impl, m in zip(model.impls, models(model, [names[i] for i in model.impls]), strict=True):
        loss, grads = loss_and_grads(m, tokens, autocast=True)
        diff = torch.stack([(g - r).norm() ** 2 for g, r in zip(grads, ref_grads, strict=True)]).sum().sqrt().item()
        errors[impl] = {"loss": abs(loss - ref_loss), "grads": diff / ref_norm}
        del m, grads
        torch.cuda.empty_cache()
    noise = {key: max(errors[peer][key] for peer in model.peers) for key in ("loss", "grads")}
    noise["loss"] = max(noise["loss"], 2**-9 * abs(ref_loss))  # one loss is one sample: at least half a bf16 ulp
    ok = all(errors["attngen"][key] <= 2 * noise[key] for key in noise)
    return {"reference_loss": ref_loss, "errors": errors, "ok": ok}


def training(model: Model, impl: str, tokens, steps: int) -> dict:
    """Tokens/s and peak memory of `steps` AdamW steps after three warm-up steps."""
    (m,) = models(model, [impl])
    optimizer = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result = {
        "tokens_per_s": steps * tokens.numel() / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "last_loss": loss.item(),
    }
    return result


def cache_step_logits(m, prompt, mask, steps) -> torch.Tensor:
    """The logits of each of `steps`' tokens fed one at a time through the cache, after the prompt
    (its padding mask growing by a token a step)."""
    out = m(input_ids=prompt, attention_mask=mask, use_cache=True)
    logits = []
    for token in steps.T:
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        out = m(input_ids=token[:, None], attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits[:, -1].float())
    return torch.stack(logits)


def generation(model: Model, names: dict, prompt_len: int, new_tokens: int, padded: bool, compiled: bool) -> dict:
    """Per implementation: the cache steps' logit error against float32 eager, and the new tokens/s
    of greedy generation; padded: sequence b's prompt left-padded by b / (2 x batch) of it;
    compiled: from a static cache, the forward compiled and replayed as CUDA graphs."""
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(1, model.config.vocab_size, (model.batch, prompt_len), generator=generator).cuda()
    steps = torch.randint(1, model.config.vocab_size, (model.batch, 16), generator=generator).cuda()
    mask = torch.ones_like(prompt)
    if padded:
        for b in range(model.batch):
            mask[b, : b * prompt_len // (2 * model.batch)] = 0
        prompt = prompt.masked_fill(mask == 0, 0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with torch.no_grad():
        (reference,) = models(model, ["eager"])
        ref = cache_step_logits(reference.eval(), prompt, mask, steps)
        del reference
        results = {}
        for impl, m in zip(model.impls, models(model, [names[i] for i in model.impls]), strict=True):
            m = m.eval().to(torch.bfloat16)
            error = ((cache_step_logits(m, prompt, mask, steps) - ref).norm() / ref.norm()).item()
            settings = {
                "max_new_tokens": new_tokens,
                "min_new_tokens": new_tokens,
                "do_sample": False,
                "pad_token_id": 0,
            }
            if compiled:
                settings["cache_implementation"] = "static"
                torch._dynamo.reset()
                m.forward = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
            m.generate(prompt, attention_mask=mask, **settings)  # warm-up: compiles the kernels (and the graphs)
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = m.generate(prompt, attention_mask=mask, **settings)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            rate = (out.shape[1] - prompt_len) * model.batch / seconds
            results[impl] = {"logits_error": error, "new_tokens_per_s": rate}
            del m
            torch.cuda.empty_cache()
    noise = max(results[peer]["logits_error"] for peer in model.peers)
    return {"impls": results, "ok": results["attngen"]["logits_error"] <= 2 * noise}


def registered(model: Model) -> dict:
    """The implementation names transformers knows: attngen's registered module and the peers."""
    if model.spec is None:
        spec = retarget(load_spec(ROOT / "specs" / "causal.toml"), model.head_dim, "bfloat16")
    else:
        spec = parse_spec(model.spec, "bench/models.py")
    module, varlen = load(spec, "triton_gpu"), load(spec, "triton_gpu", varlen=True)
    names = {"attngen": attngen.hf.register(f"attngen_{spec.name}", module, model.params, varlen=varlen)}
    return names | {peer: peer for peer in model.peers}


def run_model(model: Model, steps: int) -> dict:
    names = registered(model)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (model.batch, model.seq), generator=generator).cuda()
    result = {"model": model.name, "batch": model.batch, "seq": model.seq, "agreement": agreement(model, names, tokens)}
    result["training"] = {}
    for impl in model.impls:
        result["training"][impl] = training(model, names[impl], tokens, steps)
        torch.cuda.empty_cache()  # the model and optimizer of `training` are gone: measure the next alone
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="comma-separated model names")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--generate", action="store_true", help="time greedy generation instead of training")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--padded", action="store_true", help="with --generate: left-padded prompts of unequal length")
    parser.add_argument(
        "--compiled", action="store_true", help="with --generate: a static cache, torch.compile, CUDA graphs"
    )
    args = parser.parse_args()
    chosen = [m for m in MODELS if args.only is None or m.name in args.only.split(",")]
    out_dir = Path(os.environ.get("OUT", "bench-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
    }
    if args.generate:
        generation_table(chosen, args.prompt, args.new_tokens, args.padded, args.compiled, env, out_dir)
        return
    results = []
    for model in chosen:
        results.append(run_model(model, args.steps))
        print(f"{model.name}: {results[-1]}", flush=True)
        (out_dir / "results.json").write_text(json.dumps({"environment": env, "models": results}, indent=1))
    print(f"\n{env}\nerrors against float32 eager (loss: absolute; grads: relative norm); training: bf16 autocast")
    header = f"{'model':13} {'impl':8} {'loss err':>9} {'grad err':>9} {'tokens/s':>9} {'peak GiB':>9} {'/sdpa':>6} {'/eager':>7}"
    print(header)
    for r in results:
        train = r["training"]
        for impl in train:
            e, t = r["agreement"]["errors"][impl], train[impl]
            speed = [
                f"{t['tokens_per_s'] / train[p]['tokens_per_s']:.2f}" if p in train else "–" for p in ("sdpa", "eager")
            ]
            print(
                f"{r['model']:13} {impl:8} {e['loss']:9.2e} {e['grads']:9.2e} {t['tokens_per_s']:9.0f}"
                f" {t['peak_gib']:9.2f} {speed[0]:>6} {speed[1]:>7}"
            )
        print(f"{r['model']:13} attngen within twice the peers' error: {r['agreement']['ok']}")


def generation_table(
    chosen, prompt_len: int, new_tokens: int, padded: bool, compiled: bool, env: dict, out_dir: Path
) -> None:
    """Each chosen model's generation(), then its table."""
    results = []
    for model in chosen:
        run = generation(model, registered(model), prompt_len, new_tokens, padded, compiled)
        results.append({"model": model.name, "batch": model.batch, "prompt": prompt_len, "new_tokens": new_tokens})
        results[-1] |= {"padded": padded, "compiled": compiled}
        results[-1]["generation"] = run
        print(f"{model.name}: {results[-1]}", flush=True)
        (out_dir / "results.json").write_text(json.dumps({"environment": env, "models": results}, indent=1))
    prompts = f"prompts of {prompt_len} left-padded by 0..1/2" if padded else f"prompts of {prompt_len}"
    cache = "StaticCache, torch.compile + CUDA graphs" if compiled else "DynamicCache"
    print(f"\n{env}\ngreedy generation, bf16 weights, {cache}: {prompts}, {new_tokens} new tokens")
    print(f"{'model':13} {'batch':>5} {'impl':8} {'logits err':>10} {'tokens/s':>9} {'/sdpa':>6} {'/eager':>7}")
    for r in results:
        gen = r["generation"]["impls"]
        for impl, g in gen.items():
            rate = g["new_tokens_per_s"]
            speed = [f"{rate / gen[p]['new_tokens_per_s']:.2f}" if p in gen else "–" for p in ("sdpa", "eager")]
            row = f"{r['model']:13} {r['batch']:5} {impl:8} {g['logits_error']:10.2e} {rate:9.0f}"
            print(f"{row} {speed[0]:>6} {speed[1]:>7}")
        print(f"{r['model']:13} attngen's cache steps within twice the peers' error: {r['generation']['ok']}")


if __name__ == "__main__":
    main()
