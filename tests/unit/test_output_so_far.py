"""A streamed request's output per step is O(1) in its length: each RequestOutput reads the request's
append-only token list (and its text, offsets, logprobs) as of its step instead of copying it, and
still says exactly what it said when copied (``outputs.SoFar``)."""
from __future__ import annotations

from conftest_engine import scripted_engine, tiny_llama  # noqa: F401  (fixture)

from kvtune_engine.core.request import SamplingParams
from kvtune_engine.model import load_tokenizer


def test_each_streamed_output_is_its_steps_view_of_the_one_token_list(tiny_llama):  # noqa: F811
    tok = load_tokenizer(tiny_llama)
    ids = tok.encode("one two three four five six seven eight nine ten", add_special_tokens=False)
    eng = scripted_engine(tiny_llama, {"r": ids})
    eng.add_request([1, 40, 41], SamplingParams(max_tokens=len(ids), temperature=0, logprobs=0), request_id="r")
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == "r"]
    final = outs[-1]
    assert final.finished and final.token_ids == ids and len(outs) == len(ids)
    shared = {id(o.so_far.ids) for o in outs}
    assert len(shared) == 1, "each step copied the request's token list"
    texts = "".join(o.delta_text for o in outs)
    for i, o in enumerate(outs):  # read after the request ended: each still says what its step said
        assert o.num_output_tokens == len(o.token_ids) == i + 1
        assert o.token_ids == ids[:i + 1] and o.new_token_ids == [ids[i]]
        assert len(o.logprobs) == len(o.text_offsets) == i + 1 and o.new_text_offsets == o.text_offsets[-1:]
        assert texts.startswith(o.text) and o.text.endswith(o.delta_text)
    assert final.text == texts == tok.decode(ids)
