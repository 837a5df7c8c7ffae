"""What structured output costs: end-to-end output tok/s with and without a JSON schema, and the grammar
engine's own work per decode step (llguidance, which tideserve uses, against xgrammar).

End to end (``--e2e``): ``LLM.chat`` on the embedded SmolLM2 (or ``--model``), greedy, every request
exactly ``--output-len`` tokens: unconstrained requests ignore EOS, constrained ones follow a schema
that cannot close before that many tokens (an array of at least 16 user records), so both modes
produce the same number of tokens. Batch 1 and batch 32 (``--batches``); the modes run interleaved,
``--repeats`` times after a warm-up, and the medians are reported. ``schema+overlap`` computes each
step's masks on a worker thread during the forward pass (StructuredOutputManager.overlap).

Per step (``--masks``): the same schema, the tokens of ``--batches`` different valid documents fed one
step at a time; for each step the time to fill the batch's token bitmask (llguidance: one
``LLExecutor`` call for the batch, as the engine does; xgrammar: ``BatchGrammarMatcher``) and to advance
the matchers by the sampled tokens, plus the first compile of the schema and the sampler's cost of
applying a mask (the same for both engines). xgrammar is optional: install it into a throwaway place
(it pulls triton and a TVM runtime), e.g.
``pip install --target build/xgt --no-deps xgrammar==0.2.8 apache-tvm-ffi`` and run with
``PYTHONPATH=build/xgt``.

    PYTHONPATH=build/xgt .venv/bin/python benchmarks/structured_output.py --e2e --masks \
        --batches 1,32 --output-len 128 --repeats 3 --json out/structured-output.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

USER = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "email", "role"],
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
                   "role": {"enum": ["admin", "user", "guest"]}},
}
# At least 16 records of ~20 tokens: no output can close before 128 tokens, so max_tokens ends it.
USERS = {"type": "array", "minItems": 16, "maxItems": 64, "items": USER}
NAMES = ["ada", "bob", "chen", "dara", "eve", "femi", "gus", "hana", "ivan", "jo", "kai", "lena"]
ROLES = ["admin", "user", "guest"]


def chats(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"List the users of team {i} as JSON records with name, age, "
                                         "email and role."}] for i in range(n)]


# ---------------------------------------------------------------------------------------------- e2e
def run_e2e(args) -> list[dict]:
    from tideserve import LLM, SamplingParams, StructuredOutputsParams

    kwargs: dict[str, Any] = {"max_num_seqs": max(args.batches), "max_model_len": 1024}
    if args.model:
        kwargs["model"] = args.model
    if args.dtype:
        kwargs["dtype"] = args.dtype
    llm = LLM(**kwargs)
    manager = llm.engine.structured_output
    plain = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    schema = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                            structured_outputs=StructuredOutputsParams(json=USERS))
    modes = {"plain": (plain, False), "schema": (schema, False), "schema+overlap": (schema, True)}

    def once(batch: int, mode: str) -> tuple[float, int]:
        params, overlap = modes[mode]
        manager.overlap = overlap
        t0 = time.perf_counter()
        outs = llm.chat(chats(batch), params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if mode != "plain":
            for o in outs:  # the cut-off document is a prefix of valid JSON, never free text
                assert o.outputs[0].text.startswith("[{"), o.outputs[0].text[:80]
        return elapsed, tokens

    rows = []
    for batch in args.batches:
        for mode in modes:  # warm-up: kernels, the grammar compile (cached afterwards), thread pools
            once(batch, mode)
        samples: dict[str, list[float]] = {m: [] for m in modes}
        counts: dict[str, int] = {}
        for _ in range(args.repeats):
            for mode in modes:
                elapsed, tokens = once(batch, mode)
                samples[mode].append(tokens / elapsed)
                counts[mode] = tokens
        base = statistics.median(samples["plain"])
        for mode in modes:
            med = statistics.median(samples[mode])
            rows.append({"batch": batch, "mode": mode, "output_tokens": counts[mode], "tok_s": round(med, 1),
                         "tok_s_all": [round(x, 1) for x in samples[mode]], "vs_plain": round(med / base, 3)})
            print(f"batch {batch:3d}  {mode:15s} {med:8.1f} tok/s  ({med / base:5.3f}x plain; "
                  f"{counts[mode]} tokens; runs {', '.join(f'{x:.1f}' for x in samples[mode])})", flush=True)
    manager.overlap = False
    return rows


# ---------------------------------------------------------------------------------------------- masks
def documents(n: int, seed: int = 0) -> list[str]:
    """``n`` different valid USERS documents, compact JSON as the grammar writes it."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        users = [{"name": rng.choice(NAMES).title() + str(rng.randint(1, 99)), "age": rng.randint(18, 90),
                  "email": f"{rng.choice(NAMES)}@{rng.choice(NAMES)}.com", "role": rng.choice(ROLES)}
                 for _ in range(16)]
        docs.append(json.dumps(users, separators=(", ", ": ")))
    return docs


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def llguidance_steps(tokenizer, vocab_size: int, eos: list[int], seqs: list[list[int]], steps: int) -> dict:
    from tideserve.structured_output.backend import GrammarCompiler, bitmask_width
    from tideserve.structured_output.manager import StructuredOutputManager
    from tideserve.structured_outputs_params import StructuredOutputsParams

    params = StructuredOutputsParams(json=USERS)
    compiler = GrammarCompiler(tokenizer.hf, vocab_size, eos)
    setup_s = _timed(compiler._tokenizer)
    compile_s = _timed(lambda: compiler.compile(params))
    compiled = compiler.compile(params)
    manager = StructuredOutputManager(tokenizer.hf, vocab_size, eos)
    matchers = [compiled.matcher() for _ in seqs]
    rows = list(enumerate(matchers))
    cpu = torch.device("cpu")
    fill, accept = [], []
    for step in range(steps):
        fill.append(_timed(lambda: manager._fill(rows, cpu)))

        accept.append(_timed(lambda step=step: _accept_step(matchers, seqs, step, "llguidance",
                                                            lambda m: f": {m.error()}")))
    manager.shutdown()
    compiler.shutdown()
    assert bitmask_width(vocab_size) > 0
    return {"setup_ms": setup_s * 1e3, "compile_ms": compile_s * 1e3, "fill": fill, "accept": accept}


def _accept_step(matchers: list, seqs: list[list[int]], step: int, engine: str,
                 why: Callable[[Any], str] = lambda m: "") -> None:
    """Every matcher takes its sequence's token ``step``; a refusal is an error naming the engine."""
    for m, seq in zip(matchers, seqs):
        if not m.accept_token(seq[step]):
            raise RuntimeError(f"{engine} refused token {seq[step]} at step {step}{why(m)}")


def xgrammar_steps(tokenizer, vocab_size: int, eos: list[int], seqs: list[list[int]], steps: int) -> dict:
    import xgrammar as xgr

    info_box: dict = {}
    setup_s = _timed(lambda: info_box.setdefault(
        "info", xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab_size, stop_token_ids=eos)))
    compiler = xgr.GrammarCompiler(info_box["info"])
    box: dict = {}
    compile_s = _timed(lambda: box.setdefault("g", compiler.compile_json_schema(
        json.dumps(USERS), any_whitespace=False, separators=(", ", ": "))))
    matchers = [xgr.GrammarMatcher(box["g"]) for _ in seqs]
    bitmask = xgr.allocate_token_bitmask(len(seqs), vocab_size)
    batch = xgr.BatchGrammarMatcher() if len(seqs) > 1 else None
    fill, accept = [], []
    for step in range(steps):
        if batch is None:
            fill.append(_timed(lambda: matchers[0].fill_next_token_bitmask(bitmask, 0)))
        else:
            fill.append(_timed(lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask)))

        accept.append(_timed(lambda step=step: _accept_step(matchers, seqs, step, "xgrammar")))
    return {"setup_ms": setup_s * 1e3, "compile_ms": compile_s * 1e3, "fill": fill, "accept": accept}


def apply_cost(batch: int, vocab_size: int, repeats: int = 50) -> float:
    """Milliseconds for the sampler to apply a full batch's bitmask to float32 logits (engine-agnostic).

    Measured on one torch thread: on a shared machine a second OpenMP thread that is descheduled makes
    every small parallel op wait ~10 ms at its barrier, which is the thread governor's problem, not the
    mask's (the engine sizes its threads to the free cores)."""
    from tideserve.model.layers.sampler import AllowedTokenMask, apply_allowed_token_mask
    from tideserve.structured_output.backend import bitmask_width

    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, bitmask_width(vocab_size)), dtype=torch.int32)
    mask = AllowedTokenMask(list(range(batch)), bitmask)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = []
    try:
        for _ in range(repeats):
            logits = torch.randn(batch, vocab_size)
            times.append(_timed(lambda logits=logits: apply_allowed_token_mask(logits, mask)))
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times) * 1e3


def run_masks(args) -> list[dict]:
    from tideserve.model.loader import default_model_path
    from tideserve.tokenizer.tokenizer import load_tokenizer

    path = args.model or default_model_path()
    tokenizer = load_tokenizer(path)
    vocab_size = args.vocab_size
    eos = list(dict.fromkeys(tokenizer.stop_token_ids))
    engines = {"llguidance": llguidance_steps}
    try:
        import xgrammar  # noqa: F401

        engines["xgrammar"] = xgrammar_steps
    except ImportError:
        print("xgrammar is not installed: measuring llguidance only (see the module docstring)")
    rows = []
    for batch in args.batches:
        seqs = [tokenizer.hf.encode(doc, add_special_tokens=False) for doc in documents(batch)]
        steps = min(len(s) for s in seqs)
        for _ in range(args.mask_repeats):  # interleaved; the first round includes cold caches
            for name, fn in engines.items():
                r = fn(tokenizer, vocab_size, eos, seqs, steps)
                rows.append({"engine": name, "batch": batch, "steps": steps, "setup_ms": round(r["setup_ms"], 2),
                             "compile_ms": round(r["compile_ms"], 3),
                             "fill_us_median": round(statistics.median(r["fill"]) * 1e6, 1),
                             "fill_us_mean": round(statistics.mean(r["fill"]) * 1e6, 1),
                             "fill_us_p90": round(sorted(r["fill"])[int(0.9 * len(r["fill"]))] * 1e6, 1),
                             "accept_us_median": round(statistics.median(r["accept"]) * 1e6, 1)})
        for name in engines:
            mine = [r for r in rows if r["engine"] == name and r["batch"] == batch]
            fill = statistics.median(r["fill_us_median"] for r in mine)
            p90 = statistics.median(r["fill_us_p90"] for r in mine)
            mean = statistics.median(r["fill_us_mean"] for r in mine)
            accept = statistics.median(r["accept_us_median"] for r in mine)
            compile_ms = statistics.median(r["compile_ms"] for r in mine)
            setup = statistics.median(r["setup_ms"] for r in mine)
            print(f"batch {batch:3d}  {name:10s} mask fill {fill:8.1f} us/step (mean {mean:8.1f}, p90 {p90:8.1f})"
                  f"  accept {accept:7.1f} us/step  compile {compile_ms:7.2f} ms  tokenizer setup {setup:7.1f} ms  "
                  f"({steps} steps)", flush=True)
        apply_us = apply_cost(batch, vocab_size) * 1e3
        rows.append({"engine": "sampler (apply, 1 thread)", "batch": batch, "apply_us_median": round(apply_us, 1)})
        print(f"batch {batch:3d}  sampler applies the mask in {apply_us:8.1f} us/step (1 torch thread)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--e2e", action="store_true", help="end-to-end tok/s with and without a schema")
    ap.add_argument("--masks", action="store_true", help="per-step grammar cost, llguidance vs xgrammar")
    ap.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved end-to-end repeats (median)")
    ap.add_argument("--mask-repeats", type=int, default=3, help="interleaved per-step repeats (median)")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--vocab-size", type=int, default=49152, help="the model's logits width")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if not (args.e2e or args.masks):
        args.e2e = args.masks = True
    import llguidance

    versions = {"torch": torch.__version__, "llguidance": getattr(llguidance, "__version__", "?"),
                "python": platform.python_version(), "torch_threads": torch.get_num_threads()}
    try:
        from importlib.metadata import version

        versions["xgrammar"] = version("xgrammar")
    except Exception:  # noqa: BLE001 - not installed
        pass
    print("versions:", versions, flush=True)
    result: dict[str, Any] = {"versions": versions, "args": {k: v for k, v in vars(args).items() if k != "json"}}
    if args.masks:
        result["masks"] = run_masks(args)
    if args.e2e:
        result["e2e"] = run_e2e(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
