"""What training a tensor param costs ([grad] params), on a GPU, against FlexAttention's captured-buffer gradients.

bf16, causal, B = 1, 16 heads of 128, N = 4096 and 8192. Three scores: ALiBi with learned per-head
slopes (`score + slopes[h] * (kv_idx - q_idx)`, specs/alibi_slopes.toml), a learned full additive
bias (`score + bias[b, h, q_idx, kv_idx]`, float32 [1, 16, N, N]), and a learned relative table
(`score + rel[h, q_idx - kv_idx + 128]`, float32 [16, 257], distances past 128 clamped: T5's
relative bias without the log buckets, specs/relative_bias.toml's score). Forward + backward
time (triton.testing.do_bench median) of the same spec with and without [grad], and of
torch.compile(flex_attention) with the same score_mod reading the tensor, which then requires
grad. Every gradient is first checked against float64 on a slice of the heads (attngen.exactness's
rule), ours and Flex's; ours is also run twice and compared bitwise (Flex's accumulates the
captured tensors' gradients with atomics).

    python bench/param_grads.py [--scores slopes,bias,rel]

Prints a table last; writes results.json to $OUT (or ./bench-out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attngen import load
from attngen.exactness import check_grads
from attngen.reference import attention_ref_torch
from attngen.spec import parse_spec

ROOT = Path(__file__).resolve().parent.parent
HEADS, DIM = 16, 128
SCORES = {  # expr, declaration, [triton] table (the bias: specs/bias.toml's, for its float32 tiles)
    "slopes": ("score + slopes[h] * (kv_idx - q_idx)", 'slopes = "float[heads]"', ""),
    "bias": (
        "score + bias[b, h, q_idx, kv_idx]",
        'bias = "float[batch, heads, q_len, kv_len]"',
        "[triton]\nblock_n = 64\nnum_stages = 2\ndkdv_num_stages = 2\ndq_num_stages = 2\n",
    ),
    "rel": (
        "score + rel[h, q_idx - kv_idx + 128]",
        'rel = "float[heads, buckets]"',
        "[triton]\nblock_n = 64\nnum_stages = 2\ndq_num_stages = 2\ndkdv_num_stages = 2\n",
    ),
}
BUCKETS = 257  # the relative table's: distances -128..128


def spec_text(name: str, trained: bool) -> str:
    expr, declared, tiles = SCORES[name]
    grad = f'\n[grad]\nparams = ["{name}"]\n' if trained else ""
    return (
        f'name = "{name}_{"trained" if trained else "fixed"}"\nhead_dim = {DIM}\ndtype = "bfloat16"\n\n'
        f'[mask]\ncausal = true\n\n[score]\nexpr = "{expr}"\n\n[params]\n{declared}\n{grad}\n{tiles}'
    )


def flex_options(flex, name, value, block_mask, q, k, v, dout) -> dict:
    """The first of FLEX_OPTIONS whose forward and backward compile and run on this GPU."""
    for options in FLEX_OPTIONS:
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        param = value.detach().requires_grad_()
        try:
            out = flex_call(flex, name, param, block_mask, options)(*leaves)
            torch.autograd.grad(out, [*leaves, param], dout)
            return options
        except Exception as error:  # noqa: BLE001  (the autotuner finding no config that fits)
            failure = error
    raise failure


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


# Flex's own backward configs can overflow the H200's shared memory with a captured tensor's
# gradient (its autotuner then has no valid config): each Flex row takes the first that runs.
FLEX_OPTIONS = ({}, {"bwd_num_stages": 1})


def flex_call(flex, name, tensor, block_mask, options):
    """Flex's attention with the score reading `tensor`: one score_mod closure per tensor, so the
    compiled call is not traced again per call."""
    if name == "slopes":
        score_mod = lambda score, b, h, q_idx, kv_idx: score + tensor[h] * (kv_idx - q_idx)
    elif name == "rel":
        score_mod = lambda score, b, h, q_idx, kv_idx: score + tensor[h, (q_idx - kv_idx + 128).clamp(0, BUCKETS - 1)]
    else:
        score_mod = lambda score, b, h, q_idx, kv_idx: score + tensor[b, h, q_idx, kv_idx]
    return lambda *x: flex(*x, score_mod=score_mod, block_mask=block_mask, kernel_options=options)


def row(name: str, length: int, flex) -> dict:
    trained_spec, fixed_spec = (parse_spec(spec_text(name, t), f"{name}.toml") for t in (True, False))
    trained, fixed = load(trained_spec, "triton_gpu"), load(fixed_spec, "triton_gpu")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, HEADS, length, DIM, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4)
    )
    shape = {"slopes": (HEADS,), "rel": (HEADS, BUCKETS)}.get(name, (1, HEADS, length, length))
    value = (
        torch.rand(shape, device="cuda", generator=g) * 0.05
        if name == "slopes"
        else torch.randn(shape, device="cuda", generator=g)
    )
    causal = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, length, length)

    def timed(make, with_param):
        """Forward + backward of one implementation on the whole problem."""
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        param = value.detach().requires_grad_(with_param)
        call = make(param)
        inputs = [*leaves, param] if with_param else leaves
        return time_ms(lambda: torch.autograd.grad(call(*leaves), inputs, dout))

    options = flex_options(flex, name, value, causal, q, k, v, dout)
    # Each a function of the param giving a function of (q, k, v).
    impls = {
        "ours, trained": lambda param: lambda *x: trained.attention(*x, **{name: param}),
        "ours, fixed": lambda param: lambda *x: fixed.attention(*x, **{name: param}),
        "Flex, trained": lambda param: flex_call(flex, name, param, causal, options),
    }
    # Exactness on two heads (the float64 reference holds their scores).
    heads = slice(0, 2)
    small = [x[:, heads] for x in (q, k, v, dout)]
    small_value = value[:, heads] if name == "bias" else value[heads]
    reference = {}
    for dtype in (torch.float64, torch.bfloat16):
        leaves = [x.detach().clone().requires_grad_() for x in small[:3]]
        param = (
            small_value.detach().clone().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
        )
        out, _ = attention_ref_torch(trained_spec, *leaves, dtype=dtype, **{name: param})
        reference[dtype] = torch.autograd.grad(out, [*leaves, param], small[3].to(out.dtype))
    result = {"spec": name, "length": length, "flex kernel_options": options}
    names = ("dq", "dk", "dv", f"d{name}")
    for label, make in impls.items():
        with_param = "trained" in label
        if with_param:
            leaves = [x.detach().clone().requires_grad_() for x in small[:3]]
            param = small_value.detach().clone().requires_grad_()
            call = make(param)
            grads = torch.autograd.grad(call(*leaves), [*leaves, param], small[3])
            again = torch.autograd.grad(call(*leaves), [*leaves, param], small[3])
            verdict = check_grads(
                "bfloat16", dict(zip(names, grads)), dict(zip(names, reference[torch.float64])),
                dict(zip(names, reference[torch.bfloat16])),
            )  # fmt: skip
            result[f"{label} exact"] = verdict.ok
            result[f"{label} message"] = verdict.message
            result[f"{label} bitwise repeatable"] = all(torch.equal(a, b) for a, b in zip(grads, again))
        result[f"{label} ms"] = timed(make, with_param)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scores", default=",".join(SCORES), help="comma-separated, of: " + ", ".join(SCORES))
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT", "bench-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    flex = torch.compile(flex_attention)
    rows = [row(name, length, flex) for name in args.scores.split(",") for length in (4096, 8192)]
    (out_dir / "results.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print(env)
    print(
        "f+b ms (backward of the forward's graph); exact: gradients by attngen.exactness; repeat: bitwise on a second run"
    )
    print(
        "| score | N | ours trained | ours fixed | trained / fixed | Flex trained | Flex / ours | exact ours, Flex | repeat ours, Flex |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ours, fixed, flex_ms = r["ours, trained ms"], r["ours, fixed ms"], r["Flex, trained ms"]
        print(
            f"| {r['spec']} | {r['length']} | {ours:.2f} | {fixed:.2f} | {ours / fixed:.2f} | {flex_ms:.2f} | {flex_ms / ours:.2f} "
            f"| {r['ours, trained exact']}, {r['Flex, trained exact']} | {r['ours, trained bitwise repeatable']}, {r['Flex, trained bitwise repeatable']} |"
        )


if __name__ == "__main__":
    main()
