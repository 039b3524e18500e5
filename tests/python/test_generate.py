"""transformers' generate with a static cache through torchreplay (docs/guide.md, "Hugging Face
generate"): the decode step compiled by transformers itself with CompileConfig(backend=
"torchreplay") (on the CPU it needs the private `_compile_all_devices`), or model.forward
compiled by the user. Tiny random configs of five decoder architectures with grouped-query
attention; every case compares tokens and the scores of every step bit for bit with eager's
generate (Note [transformers' attention as eager runs it]) and checks that the step replayed."""
import json

import pytest
import torch

import torchreplay

transformers = pytest.importorskip("transformers")

ARCHS = ["llama", "qwen2", "mistral", "gemma", "phi3"]


def _model(arch):
    from torchreplay_bench.generate import tiny_model
    return tiny_model(arch)


def _compile_config():
    cc = transformers.CompileConfig(backend="torchreplay")  # mode "reduce-overhead", transformers' default
    cc._compile_all_devices = True  # transformers compiles the decode step on CUDA only otherwise
    return cc


def _generate(model, ids, **kw):
    kw = {**dict(max_new_tokens=8, do_sample=False, cache_implementation="static", output_scores=True,
                 return_dict_in_generate=True, pad_token_id=0), **kw}
    with torch.no_grad():
        return model.generate(ids, **kw)


def _assert_same(got, want, what):
    assert torch.equal(got.sequences, want.sequences), what
    for step, (g, w) in enumerate(zip(got.scores, want.scores)):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32)), f"{what}: scores of step {step}"


def _engines(before):
    seen = {s["name"] for s in before}
    return [s for s in torchreplay.stats() if s["name"] not in seen]


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_with_a_static_cache_replays_eagers_bits(arch):
    model = _model(arch)
    ids = torch.randint(3, 512, (1, 8), generator=torch.Generator().manual_seed(1))
    before = torchreplay.stats()
    want = _generate(model, ids)
    for i in range(2):
        _assert_same(_generate(model, ids, compile_config=_compile_config()), want, f"{arch}, generate {i}")
    engines = _engines(before)
    # The second generate's new cache moves the step's static inputs: captured again, then rebound
    # per call from the next move on (Engine::RunKeyed).
    assert sum(s["replays"] for s in engines) >= 10 and sum(s["captures"] for s in engines) <= 2, engines


def test_prompts_of_any_length_share_one_capture_under_a_fixed_cache_length():
    """With max_cache_len= the static cache has one shape whatever the prompt: 20 prompts of 3 to
    60 tokens replay the decode step's capture (the prefill runs eagerly; the new caches of the
    second and third generates capture it again, later ones are rebound per call)."""
    model = _model("llama")
    g = torch.Generator().manual_seed(2)
    before = torchreplay.stats()
    for n in range(3, 61, 3):
        ids = torch.randint(3, 512, (1, n), generator=g)
        _assert_same(_generate(model, ids, compile_config=_compile_config(), max_cache_len=128),
                     _generate(model, ids, max_cache_len=128), f"prompt of {n}")
    engines = _engines(before)
    assert sum(s["captures"] for s in engines) <= 3 and sum(s["replays"] for s in engines) >= 20 * 6, engines


@pytest.mark.parametrize("threads", [1, 3])
def test_more_new_tokens_than_the_fixed_cache_length_holds(threads):
    """max_new_tokens beyond max_cache_len: transformers sizes the cache for the prompt and the new
    tokens (the larger of the two lengths), a shape the step captures and replays."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = _model("llama")
        ids = torch.randint(3, 512, (1, 8), generator=torch.Generator().manual_seed(6))
        before = torchreplay.stats()
        kw = dict(max_new_tokens=24, min_new_tokens=24, max_cache_len=16)
        got = _generate(model, ids, compile_config=_compile_config(), **kw)
        _assert_same(got, _generate(model, ids, **kw), "past the cache length")
    finally:
        torch.set_num_threads(saved)
    assert got.sequences.shape == (1, 32)
    engines = _engines(before)
    assert sum(s["captures"] for s in engines) == 1 and sum(s["replays"] for s in engines) >= 20, engines


def test_a_padded_batch_and_sampling():
    """A batch of 4 prompts, left-padded with an attention mask; and sampling with a seed (the
    draws happen outside the compiled step, on its bitwise logits)."""
    model = _model("qwen2")
    tok = torch.randint(3, 512, (4, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(tok)
    for row, pad in enumerate((0, 3, 5, 7)):
        tok[row, :pad], mask[row, :pad] = 0, 0
    _assert_same(_generate(model, tok, attention_mask=mask, compile_config=_compile_config()),
                 _generate(model, tok, attention_mask=mask), "batch of 4")
    runs = []
    for compile_config in (None, _compile_config()):
        torch.manual_seed(4)
        runs.append(_generate(model, tok[:1], do_sample=True, top_k=50, temperature=0.8, compile_config=compile_config))
    _assert_same(runs[1], runs[0], "sampling")


def test_model_forward_compiled_by_the_user():
    """The CPU way without the private flag: model.forward compiled with torchreplay's backend.
    Prefill and decode steps are compiled, and a compiled forward takes transformers' traced
    branch of the causal mask (masking_utils._ignore_causal_mask_sdpa never skips the mask while
    compiling, torch < 2.14) where eager may skip it: another program, whose scores differ from
    eager's in the last bits on some CPUs (docs/guide.md, "Hugging Face generate"). Eager's
    tokens; scores close, not promised bitwise."""
    from differential import assert_close_not_bitwise
    model = _model("llama")
    ids = torch.randint(3, 512, (1, 8), generator=torch.Generator().manual_seed(5))
    want = _generate(model, ids)
    model.forward = torch.compile(model.forward, backend="torchreplay", mode="reduce-overhead")
    before = torchreplay.stats()
    for i in range(2):
        got = _generate(model, ids)
        assert torch.equal(got.sequences, want.sequences), f"generate {i}"
        for step, (g, w) in enumerate(zip(got.scores, want.scores)):
            assert_close_not_bitwise(g, w, rtol=0, atol=1e-6, what=f"generate {i}: scores of step {step}")
    assert sum(s["replays"] for s in _engines(before)) >= 8


def test_the_generate_benchmark_checks_its_rows(tmp_path, capsys):
    """python -m torchreplay_bench.generate: each row checked against eager's generate; the
    command fails if torchreplay's is not bitwise."""
    from torchreplay_bench import generate

    assert generate.main(["--archs", "mistral", "--threads", "1", "--modes", "eager,torchreplay,aot_eager",
                          "--new-tokens", "8", "--rounds", "1", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    rows = {line.split()[2]: line.split("  ")[-1].strip() for line in table.splitlines()[2:]}
    assert rows["torchreplay"] == "bitwise" and rows["eager"] == "bitwise", table
    assert rows["aot_eager"] in ("bitwise", "same tokens"), table
    # The step split: our replay is found inside the compiled frame; aot_eager's graph records none.
    split = {r["mode"]: r for r in json.load(open(tmp_path / "generate.json"))}
    assert 0 < split["torchreplay"]["graph_us"] < split["torchreplay"]["frame_us"], split["torchreplay"]
    assert split["torchreplay"]["guards_us"] > 0 and split["aot_eager"]["graph_us"] == 0, split
    assert "guards_us" not in split["eager"]
